"""Images processed once, only when their embeddings are wanted, and the Qwen2.5-VL
vision tower batched by window length with the same output as mlx-vlm's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from promptstore.errors import ImageInputError
from promptstore.vision import towers
from promptstore.vision.towers import batch_windows

from .conftest import chat, picture, user

QUESTION = "Which is brighter?"


def processed(model) -> int:
    return model.counts().get("images_processed", 0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_images_a_hit_covers_are_never_processed(vision_model, family):
    model = vision_model(family)
    before = processed(model)
    prompt = model.prompt(chat(user("First", picture(501), "then", picture(502), QUESTION)))
    assert processed(model) == before  # laid out and keyed from their sizes alone
    first, second = prompt.spans
    model.prepare(prompt, first.end + 1)  # a hit past the first image
    assert processed(model) == before + 1
    embeddings = model.embed(prompt, first.end + 1)
    assert processed(model) == before + 1  # the second, done by prepare; the first never
    every = model.inputs(prompt)  # all of them: the first is processed now
    assert processed(model) == before + 2
    kwargs = {k: v for k, v in every.items() if k != "pixel_values"}
    whole = model.vlm.get_input_embeddings(mx.array(prompt.ids[None]), every["pixel_values"], **kwargs)
    assert mx.allclose(embeddings, whole.inputs_embeds[:, first.end + 1 :], atol=1e-5, rtol=0).item()


@pytest.mark.parametrize("size", [(100, 80), (29, 31), (640, 20), (1000, 700), (56, 56)])
def test_a_layout_from_the_size_alone_equals_the_processors(vision_model, size):
    """Stand-ins (the processor's own size rule) lay the prompt out as processing it would."""
    model = vision_model("qwen2_5_vl")
    image = Image.fromarray(np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    messages = chat(user("See", image, QUESTION))
    deferred = model.prompt(messages)
    inner = model.processor.image_processor.inner
    text = model.tokenizer.apply_chat_template(
        [
            {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    cached, model.processor.image_processor = model.processor.image_processor, inner
    try:
        direct = model.processor(images=[image], text=[text], return_tensors="np")
    finally:
        model.processor.image_processor = cached
    assert np.array_equal(np.asarray(direct["input_ids"]).reshape(-1), deferred.ids)
    got = model.inputs(deferred)
    assert np.array_equal(np.asarray(got["image_grid_thw"]), np.asarray(direct["image_grid_thw"]))
    assert np.array_equal(np.asarray(got["pixel_values"]), np.asarray(direct["pixel_values"]))


def test_prepare_processes_several_images_as_each_alone(vision_model):
    model = vision_model("qwen2_5_vl")
    images = [picture(510 + k, 90 + 7 * k, 70) for k in range(3)]
    prompt = model.prompt(chat(user("All of these", *images, QUESTION)))
    before = processed(model)
    model.prepare(prompt, 0)
    assert processed(model) == before + 3
    inner = model.processor.image_processor.inner
    got = model.inputs(prompt)
    alone = [inner(images=[im]) for im in images]
    assert np.array_equal(
        np.asarray(got["pixel_values"]), np.concatenate([np.asarray(a["pixel_values"]) for a in alone])
    )


def test_an_image_the_processor_refuses_is_an_input_error_before_anything_runs(vision_model):
    model = vision_model("qwen2_5_vl")
    thin = Image.new("RGB", (4000, 10))  # an aspect ratio over 200: Qwen-VL's processor refuses it
    with pytest.raises(ImageInputError, match="refused"):
        model.prompt(chat(user("See", thin, QUESTION)))


def test_gemma3_images_are_processed_with_the_text(vision_model):
    """A processor that cannot say an image's layout from its size processes it at once."""
    model = vision_model("gemma3")
    before = processed(model)
    prompt = model.prompt(chat(user("See", picture(520), QUESTION)))
    assert prompt.made is not None and prompt.made["pixel_values"].shape[0] == 1
    assert processed(model) == before + 1


def test_batched_window_attention_equals_mlx_vlms(vision_model):
    """Qwen2.5-VL's tower, every window of a length in one attention call, gives mlx-vlm's output bitwise."""
    model = vision_model("qwen2_5_vl")
    assert model.windows_batched
    prompt = model.prompt(chat(user("See", picture(530, 150, 110), "and", picture(531, 60, 90), QUESTION)))
    every = model.inputs(prompt)
    tower = model.vlm.vision_tower
    ours = tower(every["pixel_values"], every["image_grid_thw"], output_hidden_states=False)
    # Its window blocks and its full-attention block each read their bounds once, and keep them.
    assert len({id(array) for array, _ in towers._BOUNDS.seen}) == 2
    batched = type(tower.blocks[0].attn)
    for block in tower.blocks:
        block.attn.__class__ = batched.__mro__[1]  # mlx-vlm's own Attention
    try:
        theirs = tower(every["pixel_values"], every["image_grid_thw"], output_hidden_states=False)
    finally:
        assert batch_windows(model.vlm)
    assert type(tower.blocks[0].attn) is batched
    assert mx.array_equal(ours, theirs).item()
