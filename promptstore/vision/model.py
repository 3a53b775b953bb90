"""An mlx-vlm vision-language model as the store binds and runs it.

`VisionModel` wraps mlx-vlm's model and processor:
- it is what `PromptStore.bind` takes: its parameters are the whole model's
  (the vision tower's included: other vision weights, another namespace), its
  caches mirror the language model's layout as promptstore caches, and it
  declares image keys, so the store accepts them in place of placeholders;
- `prompt()` renders chat messages with images into a `VisionPrompt`: the
  model's token ids, the keys the store sees (promptstore.vision.keys), the
  processor's image tensors and, for mrope models (Qwen-VL), every position's
  3-D rotary position, rebuilt from the ids and image grids alone;
- `embed(prompt, start)` gives the input embeddings of positions [start, n):
  the vision tower runs only when an image's run ends past `start`, so a hit
  that covers every image of the prompt never runs it;
- `forward` runs prompt positions [start, end) from their embeddings;
  `decoder(prompt)` is an mlx-lm model for mlx-lm's generation loop, placing
  generated tokens where a full prefill of the longer prompt would.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ImageInputError, ModelPathError, UnsupportedCacheError
from .images import DEFAULT_LIMITS, ImageLimits, load_image, load_images
from .keys import ImageSpan, image_digest, keyed_tokens, placeholder_spans, processor_digest
from .processing import CachedImages, joined
from .towers import batch_windows

# Processor outputs that are not image tensors for get_input_embeddings.
_TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass
class VisionPrompt:
    """A prompt with its images, as the model and the store take it.

    ids: the model's token ids; keys: what the store sees (ids with each image's
    placeholder run replaced by its key); spans: each image's run and digest;
    images: the decoded images, in order (processed when their embeddings are
    wanted: VisionModel.inputs); mask: the processor's attention mask; made:
    every image's tensors where the processor made them with the text (numpy),
    else None; positions: mrope positions (3, 1, n), None for models with 1-D
    positions; delta: what mrope adds to a text position past the last image."""

    ids: np.ndarray
    keys: np.ndarray
    spans: tuple[ImageSpan, ...]
    images: tuple = ()
    mask: np.ndarray | None = None
    made: dict | None = None
    positions: mx.array | None = None
    delta: int = 0

    def __len__(self) -> int:
        return len(self.ids)


class VisionModel(nn.Module):
    """An mlx-vlm model and its processor, bound and run by the store (see the module's note)."""

    image_keys = True  # promptstore.store.tokens: ids from IMAGE_KEYS up are accepted

    def __init__(self, model: nn.Module, processor, *, limits: ImageLimits = DEFAULT_LIMITS):
        super().__init__()
        self.vlm = model
        self._processor, self._limits = processor, limits
        self._tally = _Tally()  # not a dict: an nn.Module keeps dicts as part of its parameter tree
        config = model.config
        self._placeholder = _placeholder_id(config)
        self._mrope = hasattr(model.language_model, "get_rope_index")
        settings = getattr(processor, "image_processor", None)
        settings = settings.to_dict() if hasattr(settings, "to_dict") else {}
        settings["image_seq_length"] = getattr(processor, "image_seq_length", None)
        self._processor_key = processor_digest(settings)
        if hasattr(processor, "image_processor"):  # each image processed once (vision/processing.py)
            processor.image_processor = CachedImages(processor.image_processor, self._processor_key)
        self.windows_batched = batch_windows(model)  # the same tower in fewer kernels (vision/towers.py)

    @classmethod
    def load(cls, path: str | Path, *, limits: ImageLimits = DEFAULT_LIMITS) -> VisionModel:
        """The mlx-vlm model folder at `path` (local; nothing is downloaded)."""
        from mlx_vlm import load

        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ModelPathError(f"{path}: not a model folder (no config.json)")
        model, processor = load(str(folder))
        return cls(model, processor, limits=limits)

    # --- what the store binds -----------------------------------------------------------

    @property
    def layers(self):
        return self.vlm.language_model.layers

    @property
    def tokenizer(self):
        return getattr(self._processor, "tokenizer", self._processor)

    @property
    def processor(self):
        return self._processor

    def make_cache(self) -> list:
        """mlx-lm caches in the language model's layout (promptstore adopts them)."""
        from mlx_lm.models import cache as lm_cache

        lm = self.vlm.language_model
        if not hasattr(lm, "make_cache"):
            return [lm_cache.KVCache() for _ in lm.layers]
        out = []
        for c in lm.make_cache():
            kind = type(c).__name__
            if kind == "KVCache":
                out.append(lm_cache.KVCache())
            elif kind == "RotatingKVCache":
                out.append(lm_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep))
            else:
                raise UnsupportedCacheError(
                    f"{self.vlm.config.model_type}: mlx-vlm's {kind} has no promptstore kind yet"
                )
        return out

    def counts(self) -> dict[str, int]:
        """Prompts whose embeddings ran the vision tower (`vision_runs`), those whose
        hit covered every image so that it did not (`vision_skipped`), and images
        processed by the image processor (`images_processed`)."""
        counts = self._tally.read()
        cached = getattr(self._processor, "image_processor", None)
        if isinstance(cached, CachedImages):
            counts["images_processed"] = cached.processed
        return counts

    def count(self, name: str) -> None:
        self._tally.add(name)

    # --- prompts ------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], **template_kwargs) -> tuple[str, list]:
        """The chat template's text of `messages` and their images, in order.

        A message's content is a string or a list of parts: {"type": "text", "text": ...}
        and {"type": "image", "image": source} (a PIL image, bytes, a data URL, base64,
        or a file under the allowed folders: promptstore.vision.images). template_kwargs:
        the chat template's (tools, say), beside add_generation_prompt=True."""
        sources, rendered = [], []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.get("type") == "image":
                        where = part.get("where") or f"messages[{i}].content[{j}]"  # the caller's name for it
                        if len(sources) >= self._limits.max_images:
                            raise ImageInputError(f"more than {self._limits.max_images} images", where)
                        sources.append((part.get("image"), where))
                        parts.append({"type": "image"})
                    else:
                        parts.append(part)
                message = dict(message, content=parts)
            rendered.append(message)
        images = load_images(sources, self._limits)
        template_kwargs.setdefault("add_generation_prompt", True)
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, **template_kwargs)
        return text, images

    def prompt(self, messages: Sequence[dict] | str, images: Sequence = (), **template_kwargs) -> VisionPrompt:
        """A VisionPrompt of chat `messages` (see render), or of a rendered `text` and its `images`.

        Images are laid out, keyed and decoded here, and processed only where their
        processor cannot say their layout without it (CachedImages.deferred): the rest
        are processed when their embeddings are first wanted (`inputs`, `prepare`)."""
        if isinstance(messages, str):
            text = messages
            images = [load_image(im, f"images[{k}]", self._limits) for k, im in enumerate(images)]
        else:
            text, images = self.render(messages, **template_kwargs)
        try:
            with self._deferred():
                processed = self._processor(images=images or None, text=[text], return_tensors="np")
        except Exception as e:  # noqa: BLE001 - the processor's refusal, said as the caller's error
            raise ImageInputError(f"the model's processor refused the prompt: {e}") from None
        ids = np.asarray(processed["input_ids"]).reshape(-1).astype(np.int64)
        tensors = {k: np.asarray(v) for k, v in processed.items() if k not in _TEXT_INPUTS}
        lengths = self._run_lengths(tensors, len(images))
        try:
            runs = placeholder_spans(ids, self._placeholder, lengths)
        except ValueError as e:
            raise ImageInputError(str(e)) from None
        spans = tuple(
            ImageSpan(s, e, image_digest(im, self._processor_key)) for (s, e), im in zip(runs, images, strict=True)
        )
        made = tensors if images and _holds_pixels(tensors, len(images)) else None
        positions, delta = self._positions(ids, tensors.get("image_grid_thw")) if self._mrope else (None, 0)
        # Computed now: a prompt made on one thread (a server's HTTP thread) is run on another,
        # and MLX's streams are per thread.
        if positions is not None:
            mx.eval(positions)
        mask = np.asarray(processed["attention_mask"])
        return VisionPrompt(ids, keyed_tokens(ids, spans), spans, tuple(images), mask, made, positions, delta)

    def _deferred(self):
        cached = getattr(self._processor, "image_processor", None)
        return cached.deferred() if isinstance(cached, CachedImages) else nullcontext()

    def prepare(self, prompt: VisionPrompt, start: int = 0) -> None:
        """Process now, several at once, the images of `prompt` whose runs end past `start`
        (those a hit of `start` tokens leaves to the vision tower), so that their
        embeddings need no processing later."""
        cached = getattr(self._processor, "image_processor", None)
        if prompt.made is None and isinstance(cached, CachedImages):
            wanted = [im for im, span in zip(prompt.images, prompt.spans, strict=True) if span.end > start]
            try:
                cached.prepare(wanted)
            except Exception as e:  # noqa: BLE001 - the processor's refusal, said as the caller's error
                raise ImageInputError(f"the model's processor refused an image: {e}") from None

    def inputs(self, prompt: VisionPrompt, needed: Sequence[int] | None = None) -> dict[str, mx.array]:
        """The image tensors get_input_embeddings takes for images `needed` (all by default),
        processing those not processed yet."""
        needed = list(range(len(prompt.spans))) if needed is None else list(needed)
        if prompt.made is not None:
            data = _picked(prompt.made, needed, len(prompt.spans)) or prompt.made
        else:
            cached = self._processor.image_processor
            try:
                parts = [cached.one(prompt.images[k]) for k in needed]
            except Exception as e:  # noqa: BLE001 - the processor's refusal, said as the caller's error
                raise ImageInputError(f"the model's processor refused an image: {e}") from None
            if any(p is None for p in parts):
                raise UnsupportedCacheError(f"{self.vlm.config.model_type}: an image's tensors have a layout not known")
            data = joined(parts)
        out = {k: mx.array(v) for k, v in data.items()}
        out["mask"] = mx.array(prompt.mask)
        return out

    def _run_lengths(self, tensors: dict, n_images: int) -> list[int]:
        if not n_images:
            return []
        grid = tensors.get("image_grid_thw")
        if grid is not None:
            merge = self.vlm.config.vision_config.spatial_merge_size
            return [int(np.prod(g)) // (merge * merge) for g in grid]
        per_image = getattr(self._processor, "image_seq_length", None)
        if per_image is None:
            raise UnsupportedCacheError(
                f"{self.vlm.config.model_type}: the length of an image's placeholder run is unknown"
            )
        return [int(per_image)] * n_images

    def _positions(self, ids: np.ndarray, grid: np.ndarray | None) -> tuple[mx.array, int]:
        grid = mx.array(grid) if grid is not None else None
        positions, deltas = self.vlm.language_model.get_rope_index(mx.array(ids[None]), grid, None, None)
        return positions, int(np.asarray(deltas).reshape(-1)[0])

    # --- running ------------------------------------------------------------------------

    def embed(self, prompt: VisionPrompt, start: int = 0) -> mx.array:
        """Input embeddings of positions [start, n) (1, n - start, hidden)."""
        ids = mx.array(prompt.ids[None])
        needed = [k for k, span in enumerate(prompt.spans) if span.end > start]
        if needed:
            self.count("vision_runs")
            ids, inputs = self._only_images(prompt, needed)
            kwargs = {k: v for k, v in inputs.items() if k != "pixel_values"}
            out = self.vlm.get_input_embeddings(ids, inputs["pixel_values"], **kwargs)
            return out.inputs_embeds[:, start:]
        if prompt.spans:
            self.count("vision_skipped")
        return self.vlm.get_input_embeddings(ids[:, start:], None).inputs_embeds

    def _only_images(self, prompt: VisionPrompt, needed: list[int]) -> tuple[mx.array, dict]:
        """The prompt's ids and image tensors for embedding only the images `needed` (those
        past a hit): the others' placeholders become padding, whose embeddings lie before
        the hit and are dropped, so the vision tower never sees those images."""
        ids = mx.array(prompt.ids[None])
        if len(needed) == len(prompt.spans):
            return ids, self.inputs(prompt)
        if prompt.made is not None and _picked(prompt.made, needed, len(prompt.spans)) is None:
            return ids, self.inputs(prompt)  # a layout not known here: every image, as the model takes them
        inputs = self.inputs(prompt, needed)
        keep = np.zeros(len(prompt.ids), dtype=bool)
        for k in needed:
            keep[prompt.spans[k].start : prompt.spans[k].end] = True
        pad = getattr(self.vlm.config, "pad_token_id", None) or 0
        masked = np.where((prompt.ids == self._placeholder) & ~keep, pad, prompt.ids)
        return mx.array(masked[None]), inputs

    def forward(self, prompt: VisionPrompt, cache: list, start: int, embeddings: mx.array) -> mx.array:
        """Run prompt positions [start, start + len(embeddings)) through the language model: logits."""
        end = start + embeddings.shape[1]
        return self.language_forward(mx.array(prompt.ids[None, start:end]), embeddings, cache, start, prompt)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        """mlx-lm's model protocol for text tokens alone (what the store itself runs to
        learn its caches' shapes): a prompt with images goes through forward/decoder."""
        return self.text_forward(inputs, cache)

    def text_forward(self, inputs: mx.array, cache=None, embeddings: mx.array | None = None) -> mx.array:
        """Logits of text positions continuing `cache` (a batch's caches too: each row at its offset)."""
        kwargs = {}
        if self._mrope:
            offset = cache[0].offset if cache else 0
            length = inputs.shape[1]
            if isinstance(offset, mx.array) and offset.ndim > 0:
                rows = offset[:, None] + mx.arange(length)[None]
            else:
                rows = mx.broadcast_to(mx.arange(int(offset), int(offset) + length)[None], (inputs.shape[0], length))
            kwargs["position_ids"] = mx.broadcast_to(rows[None], (3, *rows.shape))
        out = self.vlm.language_model(inputs, inputs_embeds=embeddings, cache=cache, **kwargs)
        return getattr(out, "logits", out)

    def decoder(self, prompt: VisionPrompt) -> _Decoder:
        """An mlx-lm model (tokens or embeddings in, logits out) continuing `prompt`."""
        return _Decoder(self, prompt)

    def language_forward(self, inputs: mx.array, embeddings: mx.array | None, cache, offset: int, prompt: VisionPrompt):
        """The language model over `inputs` (or their `embeddings`) at positions from `offset`
        of `prompt` (past its end, text positions shifted by its delta): logits."""
        lm = self.vlm.language_model
        kwargs = {}
        if self._mrope:
            kwargs["position_ids"] = _mrope_positions(prompt, offset, inputs.shape[1])
        out = lm(inputs, inputs_embeds=embeddings, cache=cache, **kwargs)
        return getattr(out, "logits", out)


class _Tally:
    def __init__(self):
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def read(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _Decoder(nn.Module):
    """mlx-lm's model protocol over a VisionModel and one prompt (mlx_lm.generate's loop)."""

    def __init__(self, model: VisionModel, prompt: VisionPrompt):
        super().__init__()
        self._model, self._prompt = model, prompt

    @property
    def layers(self):
        return self._model.layers

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
        offset = int(cache[0].offset) if cache else 0
        return self._model.language_forward(inputs, input_embeddings, cache, offset, self._prompt)


def _holds_pixels(tensors: dict, n_images: int) -> bool:
    """Whether the processor's output holds every image's pixel tensors (not stand-ins)."""
    pixels, grid = tensors.get("pixel_values"), tensors.get("image_grid_thw")
    if pixels is None:
        return False
    if grid is not None:
        return pixels.shape[0] == int(np.prod(grid, axis=1).sum())
    return pixels.shape[0] > 0


def _picked(made: dict, needed: list[int], n_images: int) -> dict | None:
    """The tensors of images `needed` from those of every image (`made`), in its layout:
    Qwen-VL's patch rows and grids, or a tensor per image; `made` itself where it is all of
    them, None for a layout not known here."""
    if len(needed) == n_images:
        return made
    pixels, grid = made["pixel_values"], made.get("image_grid_thw")
    if grid is not None:  # Qwen-VL: each image's patches, one run of rows, as long as its grid's product
        rows = np.asarray(grid).prod(axis=1).astype(int)
        ends = np.cumsum(rows)
        picked = np.concatenate([np.arange(ends[k] - rows[k], ends[k]) for k in needed])
        return dict(made, pixel_values=pixels[picked], image_grid_thw=grid[needed])
    if pixels.shape[0] == n_images:  # one tensor per image (Gemma 3)
        return dict(made, pixel_values=pixels[needed])
    return None


def _mrope_positions(prompt: VisionPrompt, offset: int, length: int) -> mx.array:
    """Positions (3, 1, length) of tokens [offset, offset + length): the prompt's own,
    then (past the prompt) text positions shifted by the prompt's delta."""
    n = len(prompt)
    parts = []
    if offset < n:
        parts.append(prompt.positions[:, :, offset : min(offset + length, n)])
    if offset + length > n:
        lo = max(offset, n)
        text = mx.arange(lo, offset + length, dtype=mx.int32) + prompt.delta
        parts.append(mx.broadcast_to(text[None, None], (3, 1, offset + length - lo)))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _placeholder_id(config) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise UnsupportedCacheError(f"{config.model_type}: the model's config names no image token")
