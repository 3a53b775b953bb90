"""An image processor that does each image once, and only when it is needed.

A chat resends every earlier image with each turn, and a processor resizes,
normalizes and cuts each into patches again (41-67 ms of a CPU core per
1024x768 image on an H200's host). `CachedImages` wraps the model's image
processor:
- each image is processed alone and kept by its content digest
  (promptstore.vision.keys); a prompt's images are put together as the
  processor would have made them. Two layouts are known: Qwen-VL's (every
  image's patch rows, one after another, and a grid per image) and one tensor
  per image (Gemma 3); any other output, or a call with options, goes to the
  processor itself;
- inside `deferred()`, an image not processed yet is not processed at all
  where its processor can say its size without its pixels (Qwen-VL's: the
  processor's own `_resolved_size`): the prompt's text is laid out from that
  stand-in, and the image is processed when its embeddings are wanted, if ever
  (`one`), which a store hit past it makes never;
- `prepare` processes several images at once, on a few threads (resizing and
  numpy's array work release the GIL).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from .keys import image_digest

THREADS = 4  # images processed at once by `prepare`


class CachedImages:
    """The image processor `inner`, with each image's output kept by its digest."""

    def __init__(self, inner, processor_key: bytes, entries: int = 64):
        self.inner, self.key, self.entries = inner, processor_key, entries
        self._done: OrderedDict[bytes, dict] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self.processed = 0  # images processed (each new image once, while it stays kept)

    def __getattr__(self, name):  # merge_size, fetch_images, to_dict, ...: the processor's own
        return getattr(self.inner, name)

    def __call__(self, images=None, *args, **kwargs):
        if args or kwargs or not isinstance(images, list | tuple) or not images:
            self._count(images)
            return self.inner(images, *args, **kwargs) if args else self.inner(images=images, **kwargs)
        defer = getattr(self._local, "deferred", False)
        parts = [(self._stand_in(image) if defer else None) or self.one(image) for image in images]
        if any(p is None for p in parts):
            self._count(images)
            return self.inner(images=list(images))
        return joined(parts)

    def _count(self, images) -> None:
        """Images the processor itself is handed (a call with options, a layout not known)."""
        n = _flat_count(images)
        with self._lock:
            self.processed += n

    @contextmanager
    def deferred(self):
        """Calls on this thread lay images out without processing those not processed yet, where they can."""
        self._local.deferred = True
        try:
            yield
        finally:
            self._local.deferred = False

    @property
    def defers(self) -> bool:
        """Whether images can be laid out before they are processed (the processor says their size)."""
        return callable(getattr(self.inner, "_resolved_size", None)) and hasattr(self.inner, "patch_size")

    def one(self, image) -> dict | None:
        """The processor's output for `image` alone (numpy arrays), processed now if not
        yet; None if its layout is not one `_joined` knows."""
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
            self.processed += 1
            self._done[digest] = data
            while len(self._done) > self.entries:
                self._done.popitem(last=False)
        return data

    def prepare(self, images) -> None:
        """Process `images` (those not done yet), several at once."""
        todo = [im for im in images if not self.has(im)]
        if len(todo) <= 1:
            for image in todo:
                self.one(image)
            return
        if self._pool is None:
            with self._lock:
                self._pool = self._pool or ThreadPoolExecutor(THREADS, thread_name_prefix="promptstore-images")
        for future in [self._pool.submit(self.one, image) for image in todo]:
            future.result()

    def has(self, image) -> bool:
        with self._lock:
            return image_digest(image, self.key) in self._done

    def _stand_in(self, image) -> dict | None:
        """What the processor's output says of `image`'s layout, without its pixels: a
        grid and no patch rows (Qwen-VL). None where it is processed already, or where
        its processor cannot say (it is processed now)."""
        if not self.defers or self.has(image):
            return None
        inner = self.inner
        height, width = image.height, image.width
        resized_h, resized_w = inner._resolved_size(height, width)  # ValueError: the processor refuses it
        patch = int(inner.patch_size)
        temporal = int(getattr(inner, "temporal_patch_size", 1) or 1)
        grid = np.array([[1, resized_h // patch, resized_w // patch]], dtype=np.int64)
        return {"pixel_values": np.zeros((0, 3 * temporal * patch * patch), np.float32), "image_grid_thw": grid}


def _flat_count(images) -> int:
    """Images in `images`: one, or a list of them, or of lists (a batch's)."""
    if images is None:
        return 0
    if isinstance(images, list | tuple):
        return sum(_flat_count(im) for im in images)
    return 1


def _one_image(data: dict) -> bool:
    """Whether the output of one image has a layout `joined` knows."""
    if "image_grid_thw" in data:
        return data["image_grid_thw"].shape[0] == 1 and "pixel_values" in data
    return "pixel_values" in data and all(v.ndim >= 1 and v.shape[0] == 1 for v in data.values())


def joined(parts: list[dict]) -> dict:
    """Images processed one by one, as the processor makes them together: every key's
    arrays one after another (Qwen-VL's patch rows and grids; a tensor per image)."""
    if len(parts) == 1:
        return parts[0]  # one image: its arrays as they are (never written to)
    return {key: np.concatenate([p[key] for p in parts], axis=0) for key in parts[0]}
