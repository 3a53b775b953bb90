"""Image keys: what the store sees where a prompt holds an image.

A vision-language prompt reaches the model as token ids in which every image
is a run of placeholder ids (one per vision embedding). The store must not key
those runs by the placeholder id, which every image shares: it would restore
one image's state for another. So each run is replaced, in the tokens the
store sees, by a key of the image's content:

- `image_digest`: SHA-256 over the image as the processor will see it (its
  RGB pixels, width and height) and the processor's settings. Two images share
  a digest only where the model receives the same pixels: a PNG and a
  lossless WebP of one picture do, two JPEG encodings of it do not.
- `span_key`: the digest stretched (SHAKE-256) over the run, one 31-bit word
  per placeholder with the top bit set, so a key can never equal a text token
  (ids from IMAGE_KEYS up are image keys: promptstore.store.tokens). A run of
  n placeholders carries 31*n bits of the digest: 124 for the shortest run a
  Qwen-VL processor makes (4), 7,936 for Gemma 3's 256.

The store's trie stores and compares edge tokens, so everything before the
first image is shared by prompts with different images, nothing after an
image that differs is, and the keys persist in the index like tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..store.tokens import IMAGE_KEYS

_DOMAIN = b"promptstore image key 1\0"


@dataclass(frozen=True)
class ImageSpan:
    """One image's placeholder run, tokens [start, end) of the prompt, and its content digest."""

    start: int
    end: int
    digest: bytes


def processor_digest(settings: dict) -> bytes:
    """A digest of an image processor's settings (sizes, means, patching): another
    setting makes other embeddings of the same pixels, so other keys."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def image_digest(image, processor: bytes = b"") -> bytes:
    """SHA-256 of a PIL image's RGB pixels and size, under `processor`'s digest. An image
    promptstore decoded itself (and keeps, unchanged: vision/images.py) is hashed once;
    a caller's image, which its owner may draw on, every time."""
    ours = image.info.get("promptstore_decoded", False)
    known = image.info.get("promptstore_digest") if ours else None
    if known is not None and known[0] == processor:
        return known[1]
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    h = hashlib.sha256(_DOMAIN)
    h.update(processor)
    h.update(np.array([rgb.width, rgb.height], dtype="<u4").tobytes())
    h.update(rgb.tobytes())
    if ours:
        image.info["promptstore_digest"] = (processor, h.digest())
    return h.digest()


def span_key(digest: bytes, length: int) -> np.ndarray:
    """`length` uint32 words from `digest`, each with the top bit set (never a text token id)."""
    words = np.frombuffer(hashlib.shake_256(digest).digest(4 * length), dtype="<u4")
    return (words | np.uint32(IMAGE_KEYS)).astype("<u4")


def placeholder_spans(ids: np.ndarray, placeholder: int, lengths: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, end) of each image's placeholder run, in order, given each image's run length.

    Runs are read in order from the placeholder positions; an image's run must be
    contiguous and the count must match (ValueError otherwise: a prompt whose text
    holds placeholder tokens of its own)."""
    where = np.flatnonzero(ids == placeholder)
    if len(where) != sum(lengths):
        raise ValueError(
            f"the prompt holds {len(where)} image placeholder tokens where its {len(lengths)} images need {sum(lengths)}"
        )
    spans, at = [], 0
    for n in lengths:
        run = where[at : at + n]
        if n == 0 or run[-1] - run[0] != n - 1:
            raise ValueError("an image's placeholder tokens are not one run: the text holds placeholder tokens")
        spans.append((int(run[0]), int(run[-1]) + 1))
        at += n
    return spans


def keyed_tokens(ids: np.ndarray, spans: Sequence[ImageSpan]) -> np.ndarray:
    """`ids` (uint32) with each span's placeholders replaced by its image's key."""
    keys = np.asarray(ids, dtype="<u4").copy()
    for span in spans:
        keys[span.start : span.end] = span_key(span.digest, span.end - span.start)
    return keys
