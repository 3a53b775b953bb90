"""Images from what a caller sends: a PIL image, bytes, a data URL, base64, or a
local file under a folder the operator allows. Nothing is ever fetched from a
network: an http(s) URL is refused. Every refusal is an ImageInputError naming
the part at fault, raised before any model work."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ImageInputError


@dataclass(frozen=True)
class ImageLimits:
    """What one prompt may carry.

    max_images: images per prompt; max_bytes: encoded bytes per image;
    max_pixels: decoded pixels per image (a decompression bomb stops here, before
    decoding); allowed_folders: folders local files may be read from (none: no
    file is read)."""

    max_images: int = 16
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    allowed_folders: Sequence[Path] = field(default_factory=tuple)


DEFAULT_LIMITS = ImageLimits()


class _Decoded:
    """Images decoded lately, by a SHA-256 of what was sent: a chat resends every earlier
    image with each turn, and decoding a 1024x768 PNG takes 30 ms of a CPU core. The key is
    a cryptographic hash of the encoded bytes, so one source never gets another's image."""

    def __init__(self, entries: int = 64):
        self._entries, self._lock = entries, threading.Lock()
        self._images: OrderedDict[bytes, object] = OrderedDict()

    def get(self, key: bytes):
        with self._lock:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
            return image

    def put(self, key: bytes, image) -> None:
        with self._lock:
            self._images[key] = image
            while len(self._images) > self._entries:
                self._images.popitem(last=False)


_DECODED = _Decoded()


def load_image(source, part: str, limits: ImageLimits = DEFAULT_LIMITS):
    """`source` as a decoded RGB PIL image: a PIL image, bytes, a `data:image/...;base64,`
    URL, a `file://` URL or path under `limits.allowed_folders`, or bare base64. Sent again
    (the same bytes or text), an image is not decoded again."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _checked(source, part, limits)
    if isinstance(source, (str, bytes, bytearray, memoryview)) and not _is_file(source):
        if len(source) > limits.max_bytes * 4 // 3 + 1024:  # more than base64 of max_bytes, or more bytes
            raise ImageInputError(f"the image is over {limits.max_bytes} bytes", part)
        key = hashlib.sha256(source.encode() if isinstance(source, str) else bytes(source)).digest()
        image = _DECODED.get(key)
        if image is None:
            image = _load(source, part, limits)
            image.info["promptstore_decoded"] = True  # ours, never changed: its digest may be kept
            _DECODED.put(key, image)
        return _checked(image, part, limits)
    return _load(source, part, limits)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
THREADS = 4  # images decoded at once by load_images


def load_images(sources: Sequence[tuple[object, str]], limits: ImageLimits = DEFAULT_LIMITS) -> list:
    """`load_image` of each (source, part), several decoded at once (PIL's decoders release
    the GIL); the first refusal, in order, is raised."""
    global _POOL
    if len(sources) <= 1:
        return [load_image(source, part, limits) for source, part in sources]
    with _POOL_LOCK:
        _POOL = _POOL or ThreadPoolExecutor(THREADS, thread_name_prefix="promptstore-decode")
    futures = [_POOL.submit(load_image, source, part, limits) for source, part in sources]
    return [f.result() for f in futures]


def _is_file(source) -> bool:
    if not isinstance(source, str):
        return False
    text = source.strip()
    return text[:7].lower() == "file://" or text.startswith(("/", "./", "../", "~"))


def _load(source, part: str, limits: ImageLimits):
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), part, limits)
    if isinstance(source, os.PathLike):
        return _decode(_read_file(Path(source), part, limits), part, limits)
    if not isinstance(source, str):
        raise ImageInputError(f"an image is a URL or base64 text, not {type(source).__name__}", part)
    text = source.strip()
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise ImageInputError("remote image URLs are refused: this server fetches nothing; send a data URL", part)
    if lowered.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or ";base64" not in header.lower():
            raise ImageInputError("a data URL must be `data:image/...;base64,<data>`", part)
        if not header[5:].lower().startswith("image/"):
            raise ImageInputError(f"a data URL of {header[5:].split(';')[0] or 'no type'}, not an image", part)
        return _decode(_base64(payload, part, limits), part, limits)
    if lowered.startswith("file://"):
        return _decode(_read_file(Path(text[7:]), part, limits), part, limits)
    if text.startswith(("/", "./", "../", "~")):
        return _decode(_read_file(Path(text), part, limits), part, limits)
    return _decode(_base64(text, part, limits), part, limits)


def _base64(payload: str, part: str, limits: ImageLimits) -> bytes:
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ImageInputError(f"the image is over {limits.max_bytes} bytes", part)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(f"the image's base64 does not decode: {e}", part) from None


def _read_file(path: Path, part: str, limits: ImageLimits) -> bytes:
    if not limits.allowed_folders:
        raise ImageInputError("local image files are refused: no folder is allowed (--allowed-image-folder)", part)
    try:
        real = path.expanduser().resolve(strict=True)
    except OSError:
        raise ImageInputError(f"no such image file: {path}", part) from None
    if not any(real.is_relative_to(Path(folder).resolve()) for folder in limits.allowed_folders):
        raise ImageInputError(f"{path} is outside the folders images may be read from", part)
    try:
        if real.stat().st_size > limits.max_bytes:
            raise ImageInputError(f"the image is over {limits.max_bytes} bytes", part)
        return real.read_bytes()
    except OSError as e:
        raise ImageInputError(f"{path}: {e.strerror or e}", part) from None


def _decode(data: bytes, part: str, limits: ImageLimits):
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageInputError(f"the image is over {limits.max_bytes} bytes", part)
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_pixels:
            raise ImageInputError(f"the image is {image.width}x{image.height}, over {limits.max_pixels} pixels", part)
        image.load()
    except ImageInputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise ImageInputError(f"not an image this server decodes ({type(e).__name__}: {e})", part) from None
    return _checked(image, part, limits)


def _checked(image, part: str, limits: ImageLimits):
    if image.width < 1 or image.height < 1:
        raise ImageInputError("the image is empty", part)
    if image.width * image.height > limits.max_pixels:
        raise ImageInputError(f"the image is {image.width}x{image.height}, over {limits.max_pixels} pixels", part)
    # The processors see RGB: so do the keys (promptstore.vision.keys).
    return image if image.mode == "RGB" else image.convert("RGB")
