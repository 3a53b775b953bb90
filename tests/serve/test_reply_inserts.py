"""Finished chat replies stored as the next turn renders them (serve/reply_inserts.py):
replies that round-trip need no forward; the others waiting are prefilled
together, in one batched forward, and what each stores equals a full prefill."""

import gc
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from promptstore import PromptStore
from promptstore import caches as C
from promptstore.serve.cache import StoreCache
from promptstore.serve.replies import ChatTurn, rendered_turn
from promptstore.serve.tenants import Tenant
from promptstore.testing.models import tiny_model

from .conftest import loaded

ALICE = Tenant("salt-of-alice-7f3a", "tenant-1")
QUESTIONS = ["Hello there", "What is the weather like on the coast today?", "Tell me a story", "Why?"]
# One token a letter: the template renders it back in far fewer tokens.
SPELLED = "a reply the template renders otherwise, one token a letter"


@pytest.fixture
def make_cache(tmp_path, model_dir):
    made = []

    def make(family: str = "llama", **settings) -> StoreCache:
        if family == "llama4":  # its folder's config does not load through transformers: built here
            model, tokenizer = tiny_model(family, vocab_size=512), loaded(model_dir("llama"))[1]
        else:
            model, tokenizer = loaded(model_dir(family))
        store = PromptStore.open(tmp_path / f"store-{len(made)}")
        made.append(store)
        cache = StoreCache(store, model_id=f"tiny-{family}")
        cache.attach(model, tokenizer, None, ("m", None, None), prefill_step=64)
        cache.inserts.settings = replace(cache.inserts.settings, **settings)
        return cache

    yield make
    for store in made:
        store.close()


def filled(cache, tokens):
    """A plain mlx-lm cache (as mlx_lm.server extracts it) holding `tokens`."""
    kv = make_prompt_cache(cache.model)
    cache.model(mx.array(tokens)[None], cache=kv)
    return kv


def spelled(tok, text: str) -> list[int]:
    return [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]


def finish(cache, question: str, reply: list[int], system: str = "You answer briefly.", prompt_stored=False):
    """A chat request in flight whose reply `reply` (ending in the stop token) is
    handed over as mlx_lm.server hands it; returns (request, what the next turn renders).
    prompt_stored: its prompt is in the store (where a cache that cannot rewind restarts)."""
    tok = cache.tokenizer
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    if prompt_stored:
        cache.spaces(ALICE)[0].insert(prompt, C.adopt_prompt_cache(filled(cache, prompt)))
    turn = ChatTurn(messages, None, {})
    request, _ = cache.begin(ALICE, prompt, turn, ())
    named = prompt + reply
    cache.insert_cache(cache.model_key, named, filled(cache, named[:-1]))
    return request, rendered_turn(tok, turn, reply, prompt)


def assert_restores_like_a_prefill(cache, rendered: list[int], steps: int = 4) -> None:
    """The stored conversation, restored, gives the logits and greedy tokens of a full prefill."""
    space = cache.spaces(ALICE)[0]
    hit = space.fetch([*rendered, 5])
    assert hit.length == len(rendered)
    whole = make_prompt_cache(cache.model)
    a = cache.model(mx.array([[5]]), cache=hit.cache)[0, -1]
    b = cache.model(mx.array([[*rendered, 5]]), cache=whole)[0, -1]
    for _ in range(steps):
        assert mx.abs(a - b).max().item() < 1e-4
        ta, tb = int(a.argmax()), int(b.argmax())
        assert ta == tb
        a = cache.model(mx.array([[ta]]), cache=hit.cache)[0, -1]
        b = cache.model(mx.array([[tb]]), cache=whole)[0, -1]


@pytest.mark.parametrize("prompt_stored", [False, True], ids=["from-empty", "from-a-hit"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next", "falcon_h1"])
def test_replies_waiting_are_prefilled_in_one_batched_forward_and_restore_exactly(make_cache, family, prompt_stored):
    """Windows and recurrent layers cannot rewind to where the rendering differs:
    they restart from the store's hit (their prompt, or nothing) and batch from there."""
    cache = make_cache(family, reply_batch=8)
    tok = cache.tokenizer
    eos = tok.eos_token_id
    finished = []
    for k, question in enumerate(QUESTIONS):  # prompts and replies of different lengths
        reply = [*spelled(tok, SPELLED[: 20 + 9 * k]), eos]
        finished.append(finish(cache, question, reply, prompt_stored=prompt_stored))
    assert len(cache.inserts._background) == len(QUESTIONS)
    cache.inserts.run_background(1)  # the generation thread's one call: all of them, as one group
    assert not cache.inserts._background
    assert cache.counts["reply_batches"] == 1 and cache.counts["reply_batched"] == len(QUESTIONS)
    assert cache.counts["reply_forwards"] == 1  # every tail fits one prefill step
    # Layers that rewind make the tails even (no right padding, no roll); recurrent
    # layers cannot, and the batch is padded instead.
    rewinds = cache.counts["reply_tails_rewound"]
    assert rewinds == {"llama": len(QUESTIONS) - 1, "qwen3_next": 0}.get(family, rewinds), rewinds
    for _, rendered in finished:
        assert_restores_like_a_prefill(cache, rendered)


def test_caches_mlx_lm_cannot_batch_are_prefilled_one_at_a_time(make_cache):
    """llama4's chunked layers have no batch kind in mlx-lm: each reply alone, exact."""
    cache = make_cache("llama4", reply_batch=8)
    tok = cache.tokenizer
    finished = [finish(cache, q, [*spelled(tok, SPELLED), tok.eos_token_id], prompt_stored=True) for q in QUESTIONS]
    cache.inserts.run_background(1)
    assert not cache.inserts._background and cache.counts["reply_batches"] == 0
    assert cache.counts["reply_inserts_prefilled"] == len(QUESTIONS)
    for _, rendered in finished:
        assert_restores_like_a_prefill(cache, rendered, steps=2)


def test_one_at_a_time_costs_a_forward_a_reply(make_cache):
    cache = make_cache("llama", reply_batch=1)
    tok = cache.tokenizer
    finished = [finish(cache, q, [*spelled(tok, SPELLED), tok.eos_token_id]) for q in QUESTIONS]
    cache.inserts.run_background()
    assert cache.counts["reply_batches"] == 0 and cache.counts["reply_forwards"] == len(QUESTIONS)
    for _, rendered in finished:
        assert_restores_like_a_prefill(cache, rendered, steps=1)


def test_a_reply_that_round_trips_is_stored_with_no_forward(make_cache):
    cache = make_cache("llama", reply_batch=8)
    tok = cache.tokenizer
    reply = [*tok.encode("a short reply", add_special_tokens=False), tok.eos_token_id]
    request, rendered = finish(cache, QUESTIONS[0], reply)
    held = len(request.request.prompt) + len(reply) - 1  # the cache holds all but the stop token
    assert rendered[:held] == (request.request.prompt + reply)[:held] and len(rendered) > held
    cache.inserts.run_background()
    assert cache.counts["reply_inserts_no_forward"] == 1 and cache.counts["reply_forwards"] == 0
    space = cache.spaces(ALICE)[0]
    assert space.restorable_length(rendered) == held  # the next turn prefills the end-of-turn tokens only
    hit = space.fetch(rendered)
    assert hit.length == held
    restored = cache.model(mx.array([rendered[held:]]), cache=hit.cache)[0, -1]
    whole = cache.model(mx.array([rendered]), cache=make_prompt_cache(cache.model))[0, -1]
    assert mx.abs(restored - whole).max().item() < 1e-4


def test_a_batch_gives_way_between_chunks_and_a_next_turn_finishes_it(make_cache):
    """On CPU the batched prefill runs in chunks and pauses when a request waits;
    the next turn of one of its conversations runs the whole group to its end
    before its fetch, and every reply is exact."""
    cache = make_cache("llama", reply_batch=8, reply_chunk=8)
    tok = cache.tokenizer
    finished = [finish(cache, q, [*spelled(tok, SPELLED), tok.eos_token_id]) for q in QUESTIONS[:3]]
    asked = []
    cache.inserts.run_background(until=lambda: asked.append(1) or True)
    assert asked == [1] and cache.counts["reply_inserts_paused"] == 1 and len(cache.inserts._background) == 1
    assert len(cache.inserts.waiting()) == 3  # a close names (and counts) each reply of the paused group
    space = cache.spaces(ALICE)[0]
    assert all(space.restorable_length(r) < len(r) for _, r in finished)  # nothing stored mid-way
    _, rendered = finished[1]
    cache.begin(ALICE, rendered + tok.encode(" and then", add_special_tokens=False), None, ())  # its next turn
    assert not cache.inserts._background and cache.counts["reply_batches"] == 1
    assert cache.counts["reply_forwards"] > 2
    for _, rendered in finished:
        assert_restores_like_a_prefill(cache, rendered, steps=1)


def test_a_next_turn_runs_its_reply_with_the_others_waiting(make_cache):
    cache = make_cache("llama", reply_batch=8)
    tok = cache.tokenizer
    finished = [finish(cache, q, [*spelled(tok, SPELLED), tok.eos_token_id]) for q in QUESTIONS[:3]]
    _, rendered = finished[2]  # the newest: the group is led by it
    tracked, _ = cache.begin(ALICE, rendered + tok.encode(" and then", add_special_tokens=False), None, ())
    assert not cache.inserts._background and cache.counts["reply_batched"] == 3
    assert cache.last_hit is not None and cache.last_hit.length == len(rendered)
    del tracked
    gc.collect()


def test_a_group_over_its_size_leaves_the_rest_for_the_next_call(make_cache):
    cache = make_cache("llama", reply_batch=2)
    tok = cache.tokenizer
    for q in QUESTIONS[:3]:
        finish(cache, q, [*spelled(tok, SPELLED), tok.eos_token_id])
    cache.inserts.run_background(1)
    assert cache.counts["reply_batched"] == 2 and len(cache.inserts._background) == 1
    assert cache.inserts.flush() == (1, [])
    assert cache.counts["reply_inserts_prefilled"] == 3
