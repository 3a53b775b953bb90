"""No image's state is ever restored for another: prompts share what lies before
their first differing image and nothing after it; the same picture hits only where
its pixels are the same. And promptstore's prefill is mlx-vlm's own."""

import io

import mlx.core as mx
import pytest
from mlx_vlm import stream_generate as vlm_stream_generate
from PIL import Image

import promptstore
from promptstore.testing.vision_models import VISION_FAMILIES

from .conftest import chat, encoded, picture, prefilled, user

QUESTION = "What does this picture show?"


def test_a_hundred_pairs_of_images_share_nothing_past_the_image(tmp_path, vision_model):
    """100 pairs of different images with the same text: every fetch stops at or
    before the image, and the text before it is shared by all of them."""
    model = vision_model("qwen2_vl")
    restored_past = 0
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        for pair in range(100):
            a = model.prompt(chat(user("Look:", picture(1000 + pair), QUESTION)))
            b = model.prompt(chat(user("Look:", picture(2000 + pair), QUESTION)))
            prefilled(model, space, a)
            hit = space.fetch(b.keys)
            restored_past += hit.length > b.spans[0].start
            assert hit.length <= b.spans[0].start
            if pair:  # the system prompt and the words before the image are shared with every earlier pair
                assert hit.length >= b.spans[0].start - 1
    assert restored_past == 0


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_same_image_at_another_position_and_two_images_swapped(tmp_path, vision_model, family):
    model = vision_model(family)
    one, two = picture(11), picture(12)
    first = model.prompt(chat(user("First", one, "then", two, QUESTION)))
    swapped = model.prompt(chat(user("First", two, "then", one, QUESTION)))
    moved = model.prompt(chat(user("Before the picture, a few more words:", one, QUESTION)))
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        prefilled(model, space, first)
        assert space.fetch(swapped.keys).length <= swapped.spans[0].start
        assert space.fetch(moved.keys).length <= moved.spans[0].start
        # The same two images in the same order hit past both.
        again = model.prompt(chat(user("First", one, "then", two, QUESTION)))
        assert space.fetch(again.keys).length > again.spans[1].end


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_same_pixels_in_two_encodings_hit_and_two_jpeg_qualities_do_not(tmp_path, vision_model, family):
    model = vision_model(family)
    image = picture(21)
    png = encoded(image, "PNG")
    webp = encoded(image, "WEBP", lossless=True)
    jpeg_high, jpeg_low = encoded(image, "JPEG", quality=95), encoded(image, "JPEG", quality=50)
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        a = model.prompt(chat(user("Look:", png, QUESTION)))
        prefilled(model, space, a)
        b = model.prompt(chat(user("Look:", webp, QUESTION)))
        assert space.fetch(b.keys).length > b.spans[0].end
        high = model.prompt(chat(user("Look:", jpeg_high, QUESTION)))
        prefilled(model, space, high)
        low = model.prompt(chat(user("Look:", jpeg_low, QUESTION)))
        assert space.fetch(low.keys).length <= low.spans[0].start
        assert Image.open(io.BytesIO(jpeg_low)).tobytes() != Image.open(io.BytesIO(jpeg_high)).tobytes()


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_generation_through_the_store_is_mlx_vlms_own(tmp_path, vision_model, family):
    """Greedy tokens from promptstore's generate, cold then restored, equal mlx-vlm's
    own stream_generate on the same prompt and images."""
    model = vision_model(family)
    messages = chat(user("Look:", picture(31), QUESTION))
    text, images = model.render(messages)
    theirs = [r.token for r in vlm_stream_generate(model.vlm, model.processor, text, image=images, max_tokens=10)]
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        first = [r.token for r in promptstore.vision.stream_generate(model, messages, space=space, max_tokens=10)]
        restored = [r.token for r in promptstore.vision.stream_generate(model, messages, space=space, max_tokens=10)]
    # mlx-vlm yields one token past max_tokens; the first ten are what is compared.
    assert first == restored == theirs[:10]
    assert model.counts().get("vision_skipped", 0) >= 1
    mx.clear_cache()
