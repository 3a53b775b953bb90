"""Serving a vision-language model (an mlx-vlm folder) through mlx_lm.server's
own image path, with the store underneath.

mlx_lm.server serves a request with images on its own, after the batch (one at
a time), asking its cache for the prompt's *cache key* and its model for the
embeddings of the images past the hit (`embed_inputs`). promptstore supplies:
- `ServedVisionModel`, mlx-lm's model protocol over a promptstore.vision
  VisionModel: text tokens, or embeddings, in; logits out. Positions come from
  the prompt its caches were bound to (`bind`), so an mrope model (Qwen-VL)
  places every token where a full prefill of that prompt would; caches bound to
  no prompt (text requests, batches, the store's own forwards) take text
  positions.
- `render_images`: the request rendered by the model's processor (images from
  data URLs or base64; a local file only under --allowed-image-folder; never a
  download), as mlx-lm's `Vision`: the image keys as its cache key (the store
  fetches and inserts by them), and references to the prompt in place of pixel
  tensors (mlx-lm hands back those of the images past the hit).
A text request (no image anywhere in it) is served as for a text model.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from ..errors import ImageInputError, ServeConfigError
from .mlx_lm_server import Vision, load_tokenizer

log = logging.getLogger("promptstore.serve")

IMAGE_PARTS = ("image_url", "input_image", "image")


def vision_folder(path: str | Path) -> bool:
    """Whether the model folder at `path` is a vision-language model's (its config has a vision tower)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def has_images(messages) -> bool:
    """Whether any message holds an image part."""
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for message in messages or ()
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


@dataclass(frozen=True)
class ImageRef:
    """What mlx-lm's Vision holds for an image: the prompt it belongs to, and which it is."""

    prompt: object
    index: int


class ServedVisionModel(nn.Module):
    """mlx-lm's model protocol over a VisionModel (see the module's note)."""

    image_keys = True  # the store accepts image keys in this model's namespaces

    def __init__(self, vision):
        super().__init__()
        self.vision = vision
        text = getattr(vision.vlm.config, "text_config", None)
        self.args = SimpleNamespace(
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            vocab_size=getattr(text, "vocab_size", None),
        )
        self._prompts = _Bindings()

    @property
    def layers(self):
        return self.vision.layers

    def make_cache(self) -> list:
        return self.vision.make_cache()

    def bind(self, cache: list, prompt) -> None:
        """Positions of forwards over `cache` are `prompt`'s (until the cache is dropped)."""
        self._prompts.bind(cache, prompt)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
        prompt = self._prompts.of(cache)
        if prompt is None:
            return self.vision.text_forward(inputs, cache, input_embeddings)
        offset = int(cache[0].offset)
        return self.vision.language_forward(inputs, input_embeddings, cache, offset, prompt)

    def prefill(self, prompt, cache: list, start: int, points, step: int, stored, marks=None) -> int:
        """Run `prompt` from `start` (where `cache` is) up to its last token, in steps of
        `step`, calling `stored(position)` at each of `points` and at the end: the
        prompt's checkpoints and the prompt itself are stored before generation, as a
        text prompt's are. The vision tower runs once, only for images past `start`.
        Returns where it stopped: the last token, or the start of an image the prompt
        ends in (mlx-lm embeds that one). marks["embedded"]: when the embeddings were made."""
        marks = {} if marks is None else marks
        end = len(prompt) - 1
        end = next((s.start for s in prompt.spans if s.start <= end < s.end), end)
        if end <= start:  # restored whole: no embeddings to make
            if prompt.spans and prompt.spans[-1].end <= start:
                self.vision.count("vision_skipped")
            return start
        embeddings = self.vision.embed(prompt, start)  # counts a run of the vision tower, or a skip
        mx.eval(embeddings)
        marks["embedded"] = time.perf_counter()
        position = start
        for point in [p for p in sorted(points) if start < p < end] + [end]:
            for lo in range(position, point, step):
                hi = min(lo + step, point)
                self.vision.forward(prompt, cache, lo, embeddings[:, lo - start : hi - start])
                mx.eval([c.state for c in cache])
            stored(point)
            position = point
        return end

    def embed_inputs(self, rest: mx.array, pixel_values: list[ImageRef]) -> mx.array:
        """Embeddings of the prompt's last `len(rest)` positions (mlx-lm asks for them
        when images lie past the hit), the vision tower run over its images."""
        prompt = pixel_values[0].prompt
        return self.vision.embed(prompt, len(prompt) - rest.size)[0]


class _Bindings:
    """Caches (by their first layer) to the prompt they hold; gone with the cache."""

    def __init__(self):
        self._of = weakref.WeakKeyDictionary()

    def bind(self, cache: list, prompt) -> None:
        self._of[cache[0]] = prompt

    def of(self, cache):
        if not cache:
            return None
        try:
            return self._of.get(cache[0])
        except TypeError:  # a layer that cannot be weakly referenced was never bound
            return None


def load_vision(provider, model_path: str) -> None:
    """Load the mlx-vlm folder at `model_path` into `provider` as mlx-lm's _load sets a model."""
    from ..vision import ImageLimits, VisionModel

    args = provider.cli_args
    if provider.is_distributed:
        raise ServeConfigError("a vision-language model is not served sharded (mlx.launch) yet")
    if args.adapter_path or args.draft_model:
        raise ServeConfigError("a vision-language model is served without adapters or a draft model")
    folders = tuple(Path(f) for f in (getattr(args, "allowed_image_folder", None) or ()))
    limits = ImageLimits(max_images=args.max_images, allowed_folders=folders)
    vision = VisionModel.load(model_path, limits=limits)
    config = json.loads((Path(model_path) / "config.json").read_text())
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(
        Path(model_path), provider._tokenizer_config, eos_token_ids=[eos] if isinstance(eos, int) else eos
    )
    provider.reset()
    provider.model_key = (model_path, None, None)
    provider.model = ServedVisionModel(vision)
    provider.tokenizer = tokenizer
    provider.processor = None  # images are rendered here (render_images), never by mlx-lm
    provider.draft_model = None
    provider.is_batchable = False  # mlx-lm serves image requests one at a time; text ones follow them
    log.info("vision-language model %s (%s)", model_path, vision.vlm.config.model_type)


def chat_parts(messages: list[dict]) -> list[dict]:
    """The messages with every image part as VisionModel.render takes it ({"type": "image", "image": source})."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind, where = part.get("type"), part.get("where") or f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in IMAGE_PARTS:
                parts.append({"type": "image", "image": image_source(part, where), "where": where})
            else:
                raise ImageInputError(f"a content part of type {kind!r} is not taken here", where)
        out.append(dict(message, content=parts))
    return out


def image_source(part: dict, where: str):
    """The source string of an image part (OpenAI's image_url {url} or a string, Responses' image_url)."""
    value = part.get("image_url", part.get("image"))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageInputError("an image part needs its image as a data URL or base64", where)
    return value


def refuse_remote_images(messages) -> None:
    """ImageInputError for an image part naming an http(s) URL: this server fetches nothing
    (mlx_lm.server's handler would download it before anything else is read)."""
    for i, message in enumerate(messages or ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                value = part.get("image_url", part.get("image"))
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str) and url.strip()[:8].lower().startswith(("http://", "https://")):
                    raise ImageInputError(
                        "remote image URLs are refused: this server fetches nothing; send a data URL",
                        f"messages[{i}].content[{j}]",
                    )


@dataclass
class RenderedImages:
    """A chat with images as the model's processor rendered it (on the HTTP thread,
    when the request is checked: the generation thread takes it as it is)."""

    ids: list[int]
    state: str  # mlx-lm's initial state of the reply's text (normal, or reasoning)
    prompt: object  # the VisionPrompt

    def vision(self) -> Vision:
        """mlx-lm's Vision of it: the image keys as the cache key, references as pixel values."""
        refs = [ImageRef(self.prompt, k) for k in range(len(self.prompt.spans))]
        starts = [s.start for s in self.prompt.spans]
        return Vision(pixel_values=refs, starts=starts, cache_key=[int(k) for k in self.prompt.keys])


def render_images(model: ServedVisionModel, tokenizer, messages: list[dict], tools, template_kwargs: dict):
    """The RenderedImages of a chat with images (ImageInputError for a bad image)."""
    prompt = model.vision.prompt(chat_parts(messages), tools=tools, **template_kwargs)
    ids = [int(t) for t in prompt.ids]
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids):
        state = "reasoning"
    return RenderedImages(ids, tokenizer.response_initial_state or state, prompt)
