"""A request's prompt checked on the HTTP thread, before anything is queued:
rendered and tokenized as the generation thread would (kept for it, so it is not
done twice), refused when empty, too long for the server (counted piece by piece
before the whole is rendered), or holding token ids outside the vocabulary; and
the request as the generation thread then takes it."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..errors import ImageInputError, ServeRequestError
from .mlx_lm_server import CompletionRequest
from .tenants import PUBLIC, Tenant
from .vision import RenderedImages, has_images, render_images

PIECE_CHARS = 1 << 14  # text is counted in pieces of about this many characters, cut at whitespace


@dataclass
class Rendered:
    """A prompt as the HTTP thread rendered and tokenized it when checking it
    (mlx_lm.server's rendering), so the generation thread need not again."""

    prompt: list[int]
    segments: list[list[int]]
    kinds: list[str]
    state: str
    messages: list | None  # the messages as rendered (content parts flattened)

    def unpack(self) -> tuple:
        """Fresh lists: mlx_lm.server trims the segments it is given."""
        return list(self.prompt), [list(s) for s in self.segments], list(self.kinds), self.state, None


@dataclass
class StoreRequest(CompletionRequest):
    """mlx-lm's request, plus the tenant it came from, its timeline (perf_counter
    instants by name, written by the HTTP and generation threads) and what it
    asked the store to keep."""

    tenant: Tenant = PUBLIC
    timeline: dict = field(default_factory=dict)
    rendered: Rendered | RenderedImages | None = None
    arrival: int | None = None  # its token in Arrivals until it is queued
    # How long to keep what it stores: (end, class) per marked prefix, (None, class)
    # for all of it (store/retention.py); and the client's prompt_cache_key.
    retention: tuple = ()
    cache_key: str | None = None


def prompt_limit(generator) -> int | None:
    """The most tokens a prompt may have: --max-prompt-tokens, else the model's context."""
    given = generator.cli_args.max_prompt_tokens
    return given if given is not None else generator.model_provider.max_positions


def check_prompt(generator, request, chat_template_kwargs, tenant: Tenant = PUBLIC) -> Rendered | RenderedImages | None:
    """Render and tokenize the prompt, or ServeRequestError (before anything is
    queued). Returns the result for the generation thread to use as it is
    (None for a prompt with images to a model mlx_lm.server renders them for)."""
    provider = generator.model_provider
    tokenizer = provider.tokenizer
    if tokenizer is None:
        raise ServeRequestError("the model is still loading; retry shortly", status=503)
    tokenizer = provider.piecewise(tokenizer, tenant)
    limit = prompt_limit(generator)
    _check_length(tokenizer, request, limit)
    if request.request_type == "text":
        prompt = _text_tokens(tokenizer, request.prompt, provider.vocab_size)
        rendered = Rendered(prompt, [prompt], ["assistant"], "normal", None)
    elif provider.vision is None and provider.processor is None and has_images(request.messages):
        raise ServeRequestError("this model takes no images (serve a vision-language model's folder for them)")
    elif provider.vision is not None and has_images(request.messages):
        # Rendered here to refuse a bad image with a 400; the generation thread takes it as it is.
        kwargs = generator.template_kwargs(chat_template_kwargs)
        try:
            rendered = render_images(provider.vision, provider.tokenizer, request.messages, request.tools, kwargs)
            # The images past what the store holds are processed now, here, several at once;
            # those before it never are (unless the store lets go of them before the fetch).
            held = generator.store_cache.restorable_length(tenant, rendered.prompt.keys)
            provider.vision.vision.prepare(rendered.prompt, held)
        except ImageInputError as e:
            raise ServeRequestError(str(e), param=e.part) from None
        prompt = rendered.ids
    else:
        probe = CompletionRequest("chat", "", copy.deepcopy(request.messages), request.tools, request.role_mapping)
        args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)
        try:
            prompt, segments, kinds, state, vision = generator.render(tokenizer, probe, args)
        except Exception as e:
            raise ServeRequestError(f"the messages cannot be rendered: {e}") from None
        prompt = [int(t) for t in prompt]
        rendered = None if vision is not None else Rendered(prompt, segments, kinds, state, probe.messages)
    if not prompt:
        raise ServeRequestError("the prompt is empty")
    if limit is not None and len(prompt) > limit:
        raise ServeRequestError(
            f"the prompt has {len(prompt)} tokens; this server takes at most {limit} (--max-prompt-tokens)"
        )
    return rendered


def _check_length(tokenizer, request, limit: int | None) -> None:
    """Refuse a prompt whose text alone holds more tokens than the server takes,
    counting piece by piece and stopping past the limit, before the whole of it
    is rendered and tokenized (a 10 MB prompt took 15-24 s to tokenize)."""
    if limit is None:
        return
    texts = [request.prompt] if request.request_type == "text" else list(_message_texts(request.messages))
    texts = [t for t in texts if isinstance(t, str)]
    if sum(len(t) for t in texts) <= limit * 2:
        return  # fewer characters than twice the limit: counted whole, after rendering, at little cost
    counted = at_least_tokens(tokenizer, texts, limit)
    if counted > limit:
        raise ServeRequestError(
            f"the prompt has more than {limit} tokens; this server takes at most {limit} (--max-prompt-tokens)",
            param="prompt" if request.request_type == "text" else "messages",
        )


def _text_tokens(tokenizer, prompt, vocab: int | None) -> list[int]:
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer.encode(prompt)]
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ServeRequestError("prompt must be a string or a list of token ids (one prompt per request)")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ServeRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return list(prompt)


def _message_texts(messages):
    """The text of every message's content (strings and text parts)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part.get("text") for part in content if isinstance(part, dict))


def at_least_tokens(tokenizer, texts: list[str], bound: int) -> int:
    """A lower bound on the tokens of `texts`, counted in pieces cut where a word
    begins, one token taken off each cut (a token may straddle it); it stops once
    past `bound`."""
    counted = 0
    for text in texts:
        start = 0
        while start < len(text) and counted <= bound:
            end = start + PIECE_CHARS
            if end < len(text):
                space = text.rfind(" ", start + PIECE_CHARS // 2, end)
                end = space if space > start else end
            counted += max(0, len(tokenizer.encode(text[start:end], add_special_tokens=False)) - 1)
            start = end
    return counted
