"""The HTTP handler: mlx-lm's, with API keys, the served model only, and every
request checked at the door (door.py, schemas.py) and its prompt checked before
it is queued (checks.py); the Messages and Responses APIs (apis/) beside its
chat and text completions; /metrics and /health. Its headers come within
--header-timeout (connections.py)."""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import ImageInputError, ServeRequestError
from ..store.retention import CLASSES
from . import apis
from .apis.exchange import failure
from .checks import StoreRequest, check_prompt
from .connections import HeadDeadline
from .door import drain, read_body
from .mlx_lm_server import APIHandler
from .schemas import ChatCompletionBody, CompletionBody, checked
from .tenants import PUBLIC, Tenant
from .vision import refuse_remote_images

log = logging.getLogger("promptstore.serve")

COMPLETIONS = {
    "/v1/chat/completions": ChatCompletionBody,
    "/chat/completions": ChatCompletionBody,
    "/v1/completions": CompletionBody,
}
MAX_TOKENS_UNKNOWN_CONTEXT = 1 << 20  # the most max_tokens may ask of a model that states no context


class StoreHandler(HeadDeadline, APIHandler):
    """mlx-lm's handler (see the module's docstring)."""

    tenant: Tenant = PUBLIC
    api: apis.Exchange | None = None  # the Messages or Responses API serving this request
    capped: str | None = None  # how max_tokens was capped, said in a header of the reply
    headers_sent = False
    retention: str | None = None  # the class the request asked for all it stores (prompt_cache_retention)
    cache_key: str | None = None  # its prompt_cache_key

    def do_POST(self):
        """Every POST gets an answer: a fault of the server's is a 500 in the API's
        shape (or, once a reply began, the end of the connection), never a
        connection closed with nothing said."""
        try:
            self._post()
        except OSError as e:
            log.debug("client went away: %s", e)
        except Exception as e:
            log.exception("request failed: %s", e)
            if not self.headers_sent:
                self._error(500, f"the request failed: {e}")
            self.close_connection = True

    def _post(self) -> None:
        self.capped, self.headers_sent, self.unread = None, False, 0  # this request's, not an earlier one's
        self.arrived = time.perf_counter()  # its headers read: its body, checks and the rest count from here
        self.retention = self.cache_key = None
        route = self.path.split("?")[0].rstrip("/")
        self.api = apis.route(self)
        if self.api is None and route not in COMPLETIONS:
            self._discard_body()
            self._error(404, f"no such endpoint: POST {route}")
            return
        tenant = self._authorize()
        if tenant is None:
            return
        self.tenant = tenant
        try:
            body = read_body(self, self.response_generator.cli_args.max_body_bytes)
        except ServeRequestError as e:
            self._error(e.status, str(e), e.param)
            drain(self)
            return
        if self.api is not None:
            self.api.serve(body)
        else:
            self.complete(route, body)

    def do_GET(self):
        if self.path.split("?")[0] == "/metrics":
            self.handle_metrics()
            return
        if self.path.startswith("/v1/") and self._authorize() is None:
            return
        super().do_GET()

    def handle_metrics(self) -> None:
        """Prometheus's text format, for whoever MetricsAccess lets read it."""
        generator = self.response_generator
        refusal = generator.metrics_access.refusal(self.headers.get("Authorization"))
        if refusal is not None:
            self._error(*refusal)
            return
        body = generator.metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def handle_health_check(self) -> None:
        status, body = self.response_generator.health()
        self.start_json_reply(status)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    def handle_models_request(self):
        provider = self.response_generator.model_provider
        wanted = "/".join(self.path.split("/")[3:]) or None
        models = [{"id": provider.public_id, "object": "model", "created": self.created}]
        body = {"object": "list", "data": [m for m in models if wanted in (None, m["id"])]}
        self.start_json_reply(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    def _authorize(self) -> Tenant | None:
        key = self.headers.get("x-api-key")  # the Messages API's header
        authorization = self.headers.get("Authorization") or (f"Bearer {key}" if key else None)
        tenant = self.response_generator.keyring.tenant(authorization)
        if tenant is None:
            self._discard_body()
            self._error(401, "missing or unknown API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        return tenant

    def _discard_body(self, limit: int = 1 << 20) -> None:
        # Read what the client sent so closing the socket does not reset it
        # before the client reads the answer.
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < n <= limit:
            self.rfile.read(n)
        elif n > limit:
            self.unread = n
            drain(self)

    # --- what a reply says ----------------------------------------------------------

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        """An error in the shape of the API this request is for (OpenAI's for
        chat and text completions)."""
        if self.api is not None:
            self.api.error(status, message, param)  # in that API's shape
            return
        kind = "server_error" if status >= 500 else "invalid_request_error"
        code = {401: "invalid_api_key", 404: "model_not_found" if param == "model" else "not_found"}.get(status)
        data = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
        self.start_json_reply(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def extra_headers(self, status_code: int) -> None:
        if self.capped is not None and status_code == 200:
            self.send_header("X-Max-Tokens-Capped", self.capped)

    def end_headers(self):
        super().end_headers()
        self.headers_sent = True

    # --- chat and text completions ---------------------------------------------------

    def complete(self, route: str, body: dict) -> None:
        """A chat or text completion: the body checked against its schema, taken as
        mlx_lm.server's handler takes it, and served by mlx_lm.server's handler."""
        chat = COMPLETIONS[route] is ChatCompletionBody
        try:
            self._take(checked(COMPLETIONS[route], body), body)
            if chat:
                refuse_remote_images(body.get("messages"))  # before mlx-lm's handler would download them
            request = self.handle_chat_completions() if chat else self.handle_text_completions()
        except ServeRequestError as e:
            self._error(e.status, str(e), e.param)
            return
        except ImageInputError as e:
            self._error(400, str(e), e.part)
            return
        except Exception as e:  # mlx_lm.server's own reading (an image it cannot fetch, say)
            self._error(400, f"the request cannot be read: {e}")
            return
        self.handle_completion(request, self.stop_words)

    def _take(self, body, raw: dict) -> None:
        """The checked body as mlx_lm.server's do_POST sets it on its handler (the
        server's defaults for what the client left out), then what only the server
        can check: the served model, its adapter and draft model, token ids."""
        args = self.response_generator.cli_args
        given = lambda value, default: default if value is None else value  # noqa: E731
        self.body = raw
        self.stream = body.stream
        self.stream_options = body.stream_options.model_dump() if body.stream_options is not None else None
        self.requested_model = body.model
        self.requested_draft_model = body.draft_model or "default_model"
        self.num_draft_tokens = given(body.num_draft_tokens, args.num_draft_tokens)
        self.adapter = body.adapters
        completion = getattr(body, "max_completion_tokens", None)  # chat's newer name, which wins
        self.max_tokens = self.check_max_tokens(
            given(completion, given(body.max_tokens, args.max_tokens)),
            "max_completion_tokens" if completion is not None else "max_tokens",
        )
        self.temperature = given(body.temperature, args.temp)
        self.top_p, self.top_k, self.min_p = (
            given(body.top_p, args.top_p),
            given(body.top_k, args.top_k),
            given(body.min_p, args.min_p),
        )
        self.repetition_penalty = given(body.repetition_penalty, 0.0)
        self.repetition_context_size = given(body.repetition_context_size, 20)
        self.presence_penalty = given(body.presence_penalty, 0.0)
        self.presence_context_size = given(body.presence_context_size, 20)
        self.frequency_penalty = given(body.frequency_penalty, 0.0)
        self.frequency_context_size = given(body.frequency_context_size, 20)
        self.xtc_probability, self.xtc_threshold = given(body.xtc_probability, 0.0), given(body.xtc_threshold, 0.1)
        self.logit_bias = self._token_bias(body.logit_bias)
        logprobs = body.logprobs
        self.logprobs = bool(logprobs)
        top = 0 if isinstance(logprobs, bool) else logprobs  # a completion's logprobs: how many top tokens
        self.top_logprobs = given(body.top_logprobs, top or -1)
        self.seed = body.seed
        self.chat_template_kwargs = getattr(body, "chat_template_kwargs", None)
        self.stop_words = body.stop or []
        self.retention = getattr(body, "prompt_cache_retention", None)
        self.cache_key = getattr(body, "prompt_cache_key", None)
        self.check_served()

    def check_served(self) -> None:
        """The model, adapter and draft model asked for are the ones served."""
        provider = self.response_generator.model_provider
        args = provider.cli_args
        if self.adapter is not None and self.adapter != args.adapter_path:
            served = f"serves adapter {args.adapter_path!r} only" if args.adapter_path else "serves no adapters"
            raise ServeRequestError(f"adapters {self.adapter!r} cannot be used: this server {served}", param="adapters")
        if self.requested_draft_model not in ("default_model", args.draft_model):
            served = (
                f"drafts with {args.draft_model!r} only" if args.draft_model else "was started without a draft model"
            )
            raise ServeRequestError(
                f"draft_model {self.requested_draft_model!r} cannot be used: this server {served}", param="draft_model"
            )
        if self.requested_model not in provider.names:
            message = f"model {self.requested_model!r} not served: this server serves {provider.public_id!r}"
            raise ServeRequestError(message, status=404, param="model")

    def _token_bias(self, bias: dict | None) -> dict | None:
        if bias is None:
            return None
        vocab = self.response_generator.model_provider.vocab_size
        out = {int(k): float(v) for k, v in bias.items()}
        outside = [k for k in out if vocab is not None and not 0 <= k < vocab]
        if outside:
            raise ServeRequestError(
                f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab})", param="logit_bias"
            )
        return out

    def check_max_tokens(self, value: int, name: str) -> int:
        """`value` (max_tokens or the API's name for it), refused when more than
        the model's context (or --max-tokens-limit) could ever hold."""
        provider = self.response_generator.model_provider
        context = provider.max_positions
        ceiling = context or MAX_TOKENS_UNKNOWN_CONTEXT
        if value > ceiling:
            what = "the model's context" if context else "what this server generates for one request"
            raise ServeRequestError(f"{name} must be at most {ceiling} ({what}), got {value}", param=name)
        limit = self.response_generator.cli_args.max_tokens_limit
        if limit is not None and value > limit:
            self.capped = f"{value} -> {limit} (--max-tokens-limit)"
            return limit
        return value

    def fit(self, request: StoreRequest, max_tokens: int, name: str) -> int:
        """max_tokens capped to what the model's context holds after the prompt;
        the reply says so in a header (X-Max-Tokens-Capped)."""
        context = self.response_generator.model_provider.max_positions
        if context is None or request.rendered is None:
            return max_tokens
        room = context - len(request.rendered.prompt)
        if room < 1:
            raise ServeRequestError(
                f"the prompt has {len(request.rendered.prompt)} tokens: it fills the model's context ({context})",
                param="messages" if request.request_type == "chat" else "prompt",
            )
        if max_tokens > room:
            self.capped = f"{max_tokens} -> {room} (the model's context of {context} less the prompt)"
            log.info("%s %d capped to %d: the model's context is %d tokens", name, max_tokens, room, context)
            return room
        return max_tokens

    def handle_completion(self, request, stop_words):
        """mlx_lm.server's, with the request admitted first, and every failure
        answered in the API's shape (before the reply began: a 500 or 503;
        while it streams: an error event)."""
        generator = self.response_generator
        try:
            request = self.admit(request)
            self.max_tokens = self.fit(request, self.max_tokens, "max_tokens")
        except ServeRequestError as e:
            self._error(e.status, str(e), e.param)
            return
        try:
            self.completion_answering(request, stop_words, self._refused)
        except OSError as e:
            log.debug("client went away: %s", e)
        except Exception as e:
            log.warning("reply ended by an error: %s", e)
            self._failed(*failure(e))
        finally:
            generator.arrivals.done(request.arrival)  # queued by generate, or never will be

    def _refused(self, error: Exception) -> None:
        """A request the generator would not take, answered in the API's shape."""
        if isinstance(error, ServeRequestError):
            self._error(error.status, str(error), error.param)
        else:
            self._error(*failure(error))

    def _failed(self, status: int, message: str) -> None:
        """A reply that failed after it began: an error event in a stream, else
        the error in place of the reply whose headers were never sent."""
        try:
            if self.headers_sent:
                if self.stream:
                    error = {"message": message, "type": "server_error", "param": None, "code": None}
                    self.wfile.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True
                return
            self.forget_headers()  # the 200's status line, never sent
            self._error(status, message)
        except OSError:
            pass  # the client went away

    def admit(self, request) -> StoreRequest:
        """The request as the generation thread takes it (for the served model, its
        prompt rendered and checked, its tenant), or ServeRequestError before
        anything is queued. The Messages and Responses APIs admit theirs here too."""
        generator = self.response_generator
        received = time.perf_counter()
        with generator.arrivals.checking() as arrival:
            rendered = check_prompt(generator, request, self.chat_template_kwargs, self.tenant)
        timeline = {"arrived": getattr(self, "arrived", received), "received": received, "checked": time.perf_counter()}
        extra = {"tenant": self.tenant, "timeline": timeline, "rendered": rendered, "arrival": arrival}
        kept = ((None, CLASSES[self.retention]),) if self.retention else ()
        return StoreRequest(**vars(request), **extra, retention=kept, cache_key=self.cache_key)
