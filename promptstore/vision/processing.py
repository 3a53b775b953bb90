"""An image processor that does each image once.

A chat resends every earlier image with each turn, and a processor resizes,
normalizes and cuts each into patches again (65 ms of a CPU core for three
1024x768 images). `CachedImages` wraps the model's image processor: each image
is processed alone and kept by its content digest (promptstore.vision.keys),
and a prompt's images are put together as the processor would have made them.
Two layouts are known: Qwen-VL's (every image's patch rows, one after another,
and a grid per image) and one tensor per image (Gemma 3); any other output, or
a call with options, goes to the processor itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .keys import image_digest


class CachedImages:
    """The image processor `inner`, with each image's output kept by its digest."""

    def __init__(self, inner, processor_key: bytes, entries: int = 64):
        self.inner, self.key, self.entries = inner, processor_key, entries
        self._done: OrderedDict[bytes, dict] = OrderedDict()
        self._lock = threading.Lock()

    def __getattr__(self, name):  # merge_size, fetch_images, to_dict, ...: the processor's own
        return getattr(self.inner, name)

    def __call__(self, images=None, *args, **kwargs):
        if args or kwargs or not isinstance(images, list | tuple) or not images:
            return self.inner(images, *args, **kwargs) if args else self.inner(images=images, **kwargs)
        parts = [self._one(image) for image in images]
        if any(p is None for p in parts):
            return self.inner(images=list(images))
        return _joined(parts)

    def _one(self, image) -> dict | None:
        digest = image_digest(image, self.key)
        with self._lock:
            done = self._done.get(digest)
            if done is not None:
                self._done.move_to_end(digest)
                return done
        out = self.inner(images=[image])
        data = {k: np.asarray(v) for k, v in dict(out).items()}
        if not _one_image(data):
            return None
        with self._lock:
            self._done[digest] = data
            while len(self._done) > self.entries:
                self._done.popitem(last=False)
        return data


def _one_image(data: dict) -> bool:
    """Whether the output of one image has a layout `_joined` knows."""
    if "image_grid_thw" in data:
        return data["image_grid_thw"].shape[0] == 1 and "pixel_values" in data
    return "pixel_values" in data and all(v.ndim >= 1 and v.shape[0] == 1 for v in data.values())


def _joined(parts: list[dict]) -> dict:
    """Images processed one by one, as the processor makes them together: every key's
    arrays one after another (Qwen-VL's patch rows and grids; a tensor per image)."""
    return {key: np.concatenate([p[key] for p in parts], axis=0) for key in parts[0]}
