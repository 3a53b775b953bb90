"""The Anthropic Messages API and OpenAI's Responses API on `promptstore serve`.
Each request is translated into the chat request mlx_lm.server renders for
/v1/chat/completions and served by the same generation thread and store, so a
conversation renders to the same tokens, and hits the same nodes, whichever of
the three APIs sends it; only the request's and the reply's shapes differ."""

from __future__ import annotations

from .exchange import Exchange
from .messages import CountTokensAPI, MessagesAPI
from .responses import ResponsesAPI

ROUTES: dict[str, type[Exchange]] = {
    "/v1/messages": MessagesAPI,
    "/v1/messages/count_tokens": CountTokensAPI,
    "/v1/responses": ResponsesAPI,
}


def route(handler) -> Exchange | None:
    """The API serving a POST to the handler's path (a query, such as the
    Anthropic SDK's `?beta=true`, is ignored); None for mlx_lm.server's own paths."""
    api = ROUTES.get(handler.path.split("?")[0].rstrip("/"))
    return api(handler) if api is not None else None
