"""Image keys: content digests, the words placeholders become, and what the store accepts."""

import io

import numpy as np
import pytest
from PIL import Image

import promptstore
from promptstore.errors import TokenRangeError
from promptstore.store.tokens import IMAGE_KEYS
from promptstore.testing.models import tiny_model
from promptstore.vision.keys import (
    ImageSpan,
    image_digest,
    keyed_tokens,
    placeholder_spans,
    processor_digest,
    span_key,
)

from .conftest import encoded, picture


def decoded(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def test_equal_pixels_in_two_lossless_encodings_share_a_digest():
    image = picture(1)
    png, bmp = decoded(encoded(image, "PNG")), decoded(encoded(image, "BMP"))
    webp = decoded(encoded(image, "WEBP", lossless=True))
    assert image_digest(png) == image_digest(bmp) == image_digest(webp) == image_digest(image)


def test_two_jpeg_encodings_differ_where_their_pixels_do():
    image = picture(2)
    high, low = decoded(encoded(image, "JPEG", quality=95)), decoded(encoded(image, "JPEG", quality=60))
    assert np.asarray(high).tobytes() != np.asarray(low).tobytes()
    assert image_digest(high) != image_digest(low)
    again = decoded(encoded(image, "JPEG", quality=95))
    assert image_digest(again) == image_digest(high)  # one encoding decodes to one set of pixels


def test_size_mode_and_processor_are_part_of_the_digest():
    image = picture(3, 40, 30)
    flat = Image.frombytes("RGB", (30, 40), image.tobytes())  # the same bytes, another shape
    assert image_digest(flat) != image_digest(image)
    # The model sees RGB: an opaque RGBA image is the same picture.
    assert image_digest(image.convert("RGBA")) == image_digest(image)
    a, b = processor_digest({"max_pixels": 100}), processor_digest({"max_pixels": 200})
    assert image_digest(image, a) != image_digest(image, b)


def test_span_words_carry_the_top_bit_and_differ_per_image():
    a, b = span_key(image_digest(picture(4)), 64), span_key(image_digest(picture(5)), 64)
    assert a.dtype == np.dtype("<u4") and len(a) == 64
    assert (a >= IMAGE_KEYS).all() and (b >= IMAGE_KEYS).all()
    assert a[0] != b[0] and len(set(a.tolist())) == 64  # every placeholder carries its own bits
    assert np.array_equal(span_key(image_digest(picture(4)), 64), a)


def test_keyed_tokens_replace_only_the_runs():
    ids = np.array([1, 2, 7, 7, 7, 3, 7, 7, 4])
    runs = placeholder_spans(ids, 7, [3, 2])
    assert runs == [(2, 5), (6, 8)]
    spans = [ImageSpan(s, e, image_digest(picture(i))) for i, (s, e) in enumerate(runs)]
    keys = keyed_tokens(ids, spans)
    assert keys[[0, 1, 5, 8]].tolist() == [1, 2, 3, 4]
    assert (keys[2:5] >= IMAGE_KEYS).all() and (keys[6:8] >= IMAGE_KEYS).all()


@pytest.mark.parametrize(
    "ids, lengths",
    [
        ([1, 7, 7, 7, 2], [2]),  # more placeholders than the images need: text holding one
        ([1, 7, 2, 7, 2], [2]),  # one image's run broken by text
        ([1, 7, 2], [1, 1]),
    ],
)
def test_placeholders_that_do_not_fit_the_images_are_refused(ids, lengths):
    with pytest.raises(ValueError):
        placeholder_spans(np.array(ids), 7, lengths)


def test_a_text_model_refuses_image_keys(tmp_path):
    model = tiny_model("llama", vocab_size=512)
    key = int(span_key(b"x" * 32, 1)[0])
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model, model_id="text")
        with pytest.raises(TokenRangeError):
            space.fetch([1, 2, key, 3])


def test_a_vision_model_takes_keys_but_not_other_ids_past_its_vocabulary(tmp_path, vision_model):
    model = vision_model("qwen2_vl")
    key = int(span_key(b"x" * 32, 1)[0])
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        assert space.fetch([1, 2, key, 3, 4]).length == 0
        with pytest.raises(TokenRangeError):
            space.fetch([1, 2, 600, 3])
