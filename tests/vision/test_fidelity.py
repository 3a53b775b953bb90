"""A restore with images equals a full prefill (logits within 1e-4 in float32, greedy
tokens identical) for every vision family, on every path: hot, cold, after a
restart, a split in the text after an image, a fork, after compact, and from the
shared tier; and a hit past every image never runs the vision tower."""

import mlx.core as mx
import pytest

import promptstore
from promptstore.store.compact import compact
from promptstore.testing.vision_models import VISION_FAMILIES

from ..remote.conftest import redis_server  # noqa: F401 - the fixture
from .conftest import chat, continued_logits, full_logits, greedy, picture, prefilled, user

QUESTION = "What is in this picture, and what colours does it use? Answer in one line."


def assert_faithful(model, space, hit, prompt, n_greedy=8):
    want = full_logits(model, space, prompt)
    got = continued_logits(model, hit, prompt)
    assert mx.allclose(got, want, atol=1e-4, rtol=0).item(), float(mx.abs(got - want).max())
    want_cache = space.new_cache()
    fresh = greedy(model, want_cache, prompt, 0, n_greedy)
    hit_again = space.fetch(prompt.keys)  # the hit's cache above has moved on: fetch it again
    assert greedy(model, hit_again.cache, prompt, hit_again.length, n_greedy) == fresh


def image_chat(model, seed=1, question=QUESTION):
    return model.prompt(chat(user("Please look at this:", picture(seed), question)))


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_hot_hit_past_the_image_skips_the_vision_tower(tmp_path, vision_model, family):
    model = vision_model(family)
    prompt = image_chat(model)
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        prefilled(model, space, prompt)
        before = model.counts()
        hit = space.fetch(prompt.keys)
        assert hit.length == len(prompt) - 1 > prompt.spans[-1].end
        assert_faithful(model, space, hit, prompt)
        after = model.counts()
        # The hit's continuation skipped the tower (the full prefills beside it ran it).
        assert after.get("vision_skipped", 0) >= before.get("vision_skipped", 0) + 2


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_next_turn_of_an_image_chat(tmp_path, vision_model, family):
    """Turn 2 (the image, the reply, a new question) restores turn 1 whole."""
    model = vision_model(family)
    first = chat(user("Please look at this:", picture(7), QUESTION))
    with promptstore.PromptStore.open(tmp_path, checkpoint_interval=16) as store:
        space = store.bind(model)
        reply = promptstore.vision.generate(model, first, space=space, max_tokens=10)
        second = model.prompt([*first, {"role": "assistant", "content": reply}, user("And the corners?")])
        hit = space.fetch(second.keys)
        assert hit.length > second.spans[-1].end
        assert_faithful(model, space, hit, second)


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("path", ["cold", "restart", "compact"])
def test_cold_restart_and_compact(tmp_path, vision_model, family, path):
    model = vision_model(family)
    prompt = image_chat(model, seed=3)
    settings = {"hot_bytes": 0, "durability": "sync"} if path == "cold" else {}
    with promptstore.PromptStore.open(tmp_path, **settings) as store:
        space = store.bind(model)
        prefilled(model, space, prompt)
        if path == "cold":
            hit = space.fetch(prompt.keys)
            assert hit.cold_nodes > 0
            assert_faithful(model, space, hit, prompt)
            return
    if path == "compact":
        report = compact(tmp_path, verify=True)
        assert not report.errors
    with promptstore.PromptStore.open(tmp_path, warm_start=False) as store:
        space = store.bind(model)
        hit = space.fetch(prompt.keys)
        assert hit.length > prompt.spans[-1].end and hit.cold_nodes > 0
        assert_faithful(model, space, hit, prompt)


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_a_split_in_the_text_after_an_image(tmp_path, vision_model, family):
    """Two questions about one image share the image and the words before they differ."""
    model = vision_model(family)
    a = image_chat(model, seed=4, question="Describe the picture in one line, then list its colours.")
    b = image_chat(model, seed=4, question="Describe the picture in one line, then count its shapes.")
    common = next(i for i, (x, y) in enumerate(zip(a.keys, b.keys)) if x != y)
    assert common > a.spans[-1].end + 4
    with promptstore.PromptStore.open(tmp_path, checkpoint_interval=8) as store:
        space = store.bind(model)
        prefilled(model, space, a)
        hit = space.fetch(b.keys, checkpoints=[common])
        assert a.spans[-1].end <= hit.length <= common
        assert_faithful(model, space, hit, b)


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_forks_from_one_image_are_independent(tmp_path, vision_model, family):
    model = vision_model(family)
    base = image_chat(model, seed=5)
    with promptstore.PromptStore.open(tmp_path) as store:
        space = store.bind(model)
        prefilled(model, space, base)
        one, two = space.fetch(base.keys), space.fetch(base.keys)
        # Fork one goes on with other tokens; fork two must still equal a full prefill.
        model.decoder(base)(mx.array([[11, 12, 13, 14, 15]]), cache=one.cache)
        mx.eval([c.state for c in one.cache])
        assert_faithful(model, space, two, base)


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_shared_tier_restores_an_image_prompt_on_another_machine(tmp_path, vision_model, family, redis_server):  # noqa: F811
    model = vision_model(family)
    prompt = image_chat(model, seed=6)
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=redis_server.url) as store:
        prefilled(model, store.bind(model), prompt)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as store:
        space = store.bind(model)
        hit = space.fetch(prompt.keys)
        assert hit.remote_tokens > prompt.spans[-1].end
        assert_faithful(model, space, hit, prompt)


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_images_before_the_hit_are_left_out_of_the_vision_tower(vision_model, family):
    """Past a hit between two images, the embeddings made from the second image alone
    equal those of both: the first never goes through the tower again."""
    model = vision_model(family)
    prompt = model.prompt(chat(user("First", picture(41), "then", picture(42), QUESTION)))
    first, second = prompt.spans
    start = first.end + 1
    ids = mx.array(prompt.ids[None])
    every = model.inputs(prompt)
    kwargs = {k: v for k, v in every.items() if k != "pixel_values"}
    whole = model.vlm.get_input_embeddings(ids, every["pixel_values"], **kwargs).inputs_embeds[:, start:]
    masked, inputs = model._only_images(prompt, [1])
    assert inputs["pixel_values"].shape[0] < every["pixel_values"].shape[0]
    assert (masked[0, first.start : first.end] != model._placeholder).all().item()
    got = model.embed(prompt, start)
    assert got.shape == whole.shape and mx.allclose(got, whole, atol=1e-5, rtol=0).item()
