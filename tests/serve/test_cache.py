"""The store-backed prompt cache in this process: which namespace an insert
lands in when several tenants' requests are in flight, and segment cuts."""

import gc
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from promptstore import PromptStore
from promptstore import caches as C
from promptstore.index import namespace
from promptstore.serve.cache import StoreCache, split_segments
from promptstore.serve.insert_scheduler import _goes_on_with
from promptstore.serve.replies import ChatTurn, rendered_turn
from promptstore.serve.tenants import Tenant

from .conftest import loaded

ALICE, BOB = Tenant("salt-of-alice-7f3a", "tenant-1"), Tenant("salt-of-bob-91c2", "tenant-2")


@pytest.fixture
def cache(tmp_path, model_dir):
    model, tokenizer = loaded(model_dir("llama"))
    with PromptStore.open(tmp_path / "store") as store:
        cache = StoreCache(store, model_id="tiny-llama")
        cache.attach(model, tokenizer, None, ("m", None, None), prefill_step=64)
        yield cache


def filled(cache, tokens):
    """A plain mlx-lm cache (as mlx_lm.server extracts it) holding `tokens`."""
    kv = make_prompt_cache(cache.model)
    cache.model(mx.array(tokens)[None], cache=kv)
    return kv


def tuned(cache, **settings) -> None:
    """The cache's insert scheduler with these settings (InsertSettings's fields)."""
    cache.inserts.settings = replace(cache.inserts.settings, **settings)


def stored(cache, tenant, tokens) -> int:
    cache.inserts.run_background()  # as the generation thread does once idle (parts of prompts first)
    return cache.spaces(tenant)[0].fetch(tokens + [0]).length


def test_an_insert_that_two_tenants_requests_agree_with_is_skipped(cache):
    prompt = list(range(10, 40))
    alice, _ = cache.begin(ALICE, prompt, None, ())
    bob, _ = cache.begin(BOB, prompt, None, ())
    cache.insert_cache(cache.model_key, prompt[:20], filled(cache, prompt[:20]), cache_type="system")
    assert cache.counts["inserts_skipped_ambiguous"] == 1
    assert stored(cache, ALICE, prompt) == stored(cache, BOB, prompt) == 0
    del bob  # mlx_lm.server is done with bob's request
    gc.collect()
    cache.insert_cache(cache.model_key, prompt[:20], filled(cache, prompt[:20]), cache_type="system")
    assert stored(cache, ALICE, prompt) == 20 and stored(cache, BOB, prompt) == 0
    del alice
    gc.collect()
    # No request in flight owns the tokens: nothing is stored anywhere.
    cache.insert_cache(cache.model_key, prompt, filled(cache, prompt))
    assert cache.counts["inserts_skipped_unowned"] == 1
    assert stored(cache, ALICE, prompt) == 20 and len(cache.inflight) == 0


def test_a_reply_insert_goes_to_the_tenant_whose_prompt_it_extends(cache):
    alice_prompt, bob_prompt = list(range(10, 30)), list(range(10, 25)) + [99, 98]
    alice, _ = cache.begin(ALICE, alice_prompt, None, ())
    bob, _ = cache.begin(BOB, bob_prompt, None, ())
    reply = alice_prompt + [7, 8, 9]
    kv = filled(cache, reply)
    cache.insert_cache(cache.model_key, reply, kv)
    assert stored(cache, ALICE, reply) == len(reply) and stored(cache, BOB, reply) == 0
    assert C.prompt_position(C.adopt_prompt_cache(kv)) == len(reply)
    assert alice and bob  # both still in flight throughout


def test_a_cache_holding_one_token_less_is_stored_as_it_is(cache):
    tokens = list(range(50, 70))
    request, _ = cache.begin(ALICE, tokens[:10], None, ())
    cache.insert_cache(cache.model_key, tokens, filled(cache, tokens[:-1]))
    assert stored(cache, ALICE, tokens[:-1]) == len(tokens) - 1
    assert request


@pytest.mark.xfail(
    not hasattr(namespace, "tenant_digest"),
    reason="this store writes a namespace's salt into its index (a keyed digest replaces it elsewhere)",
    strict=True,
)
def test_salts_are_never_written_to_the_store(cache):
    prompt = list(range(10, 40))
    for tenant in (ALICE, BOB):
        request, _ = cache.begin(tenant, prompt, None, ())
        cache.insert_cache(cache.model_key, prompt, filled(cache, prompt))
        del request
    cache.store.close()
    files = [p.read_bytes() for p in cache.store.path.rglob("*") if p.is_file()]
    assert files and not any(t.salt.encode() in f for t in (ALICE, BOB) for f in files)


def test_prompt_inserts_wait_for_the_next_step_or_fetch_and_keep_their_owner(cache):
    """insert_cache settles whose tokens they are at once; parts of a prompt are
    stored later: nothing is in the store until run_deferred (before a batch step,
    a wait for a request, or a fetch), which stores them in order in their owner's
    namespace, also when the owner's request ended meanwhile. At most one part of
    each request waits: with caches that restore any prefix, its next part
    replaces it (and stores its tokens). A finished request's tokens (its prompt
    and reply) wait for run_background: neither a step nor a fetch runs them."""
    prompt, longer = list(range(10, 40)), list(range(10, 40)) + [5, 6, 7, 8]
    alice, _ = cache.begin(ALICE, prompt, None, ())
    carol, _ = cache.begin(ALICE, [3, 3] + prompt, None, ())  # another request of the same tenant
    cache.insert_cache(cache.model_key, prompt[:20], filled(cache, prompt[:20]), cache_type="system")
    theirs = ([3, 3] + prompt)[:7]
    cache.insert_cache(cache.model_key, theirs, filled(cache, theirs), cache_type="system")
    space = cache.spaces(ALICE)[0]
    assert space.fetch(prompt + [0]).length == 0 and len(cache.inserts._deferred) == 2  # one of each request
    cache.insert_cache(cache.model_key, prompt, filled(cache, prompt))  # Alice's next part
    assert cache.counts["prompt_parts_superseded"] == 1 and len(cache.inserts._deferred) == 2
    assert space.fetch(prompt + [0]).length == 0  # nothing ran in front of the request's first token
    del alice, carol  # the requests ended before the last insert ran
    gc.collect()
    bob, _ = cache.begin(BOB, longer, None, ())  # a fetch: the inserts run first
    assert not cache.inserts._deferred and cache.counts["inserts_skipped_unowned"] == 0
    assert space.fetch(prompt + [0]).length == len(prompt)
    assert cache.spaces(BOB)[0].fetch(longer).length == 0  # Alice's, not Bob's
    reply = longer + [9, 9, 9]
    cache.insert_cache(cache.model_key, reply, filled(cache, reply))
    cache.inserts.run_deferred()
    tuned(cache, replies_before_fetch=False)
    cache.begin(BOB, reply + [1], None, ())  # a fetch does not wait for it
    assert cache.inserts.has_background and cache.spaces(BOB)[0].fetch(reply + [0]).length == 0
    cache.inserts.run_background(1)
    assert not cache.inserts.has_background and cache.spaces(BOB)[0].fetch(reply + [0]).length == len(reply)
    assert bob


def test_a_finished_requests_insert_waits_its_grace_unless_its_next_turn_comes(cache):
    """With a grace (CPU), a finished request's insert may not begin at once
    (background_wait); its conversation's next turn runs it before its fetch all
    the same, and the grace does not hold one already begun."""
    tuned(cache, reply_grace=5.0)
    prompt = list(range(10, 40))
    reply = prompt + [9, 9, 9]
    request, _ = cache.begin(ALICE, prompt, None, ())
    cache.insert_cache(cache.model_key, reply, filled(cache, reply))
    assert cache.inserts.has_background and 4.0 < cache.inserts.background_wait() <= 5.0
    space = cache.spaces(ALICE)[0]
    assert space.fetch(reply + [0]).length < len(reply)
    cache.begin(ALICE, reply + [1], None, ())  # its next turn
    assert not cache.inserts.has_background and space.fetch(reply + [0]).length == len(reply)
    other = list(range(50, 80))
    second, _ = cache.begin(ALICE, other, None, ())
    cache.insert_cache(cache.model_key, other + [7], filled(cache, other + [7]))
    cache.inserts._background[0].steps = iter(())  # begun, then paused
    assert cache.inserts.background_wait() == 0.0
    tuned(cache, reply_grace=0.0)
    assert request and second


def test_a_recurrent_models_earlier_part_is_stored_before_its_next_part_waits(tmp_path, model_dir):
    """A recurrent layer's state at a segment's end exists only then: the next
    part of the request runs the earlier one (it is not replaced), and both
    points restore, equal to a prefill to each."""
    model, tokenizer = loaded(model_dir("qwen3_next"))
    with PromptStore.open(tmp_path / "store") as store:
        cache = StoreCache(store, model_id="tiny-hybrid")
        cache.attach(model, tokenizer, None, ("m", None, None), prefill_step=64)
        prompt = list(range(10, 40))
        alice, _ = cache.begin(ALICE, prompt, None, ())
        cache.insert_cache(cache.model_key, prompt[:20], filled(cache, prompt[:20]), cache_type="system")
        cache.insert_cache(cache.model_key, prompt, filled(cache, prompt))
        assert cache.counts["prompt_parts_superseded"] == 0 and len(cache.inserts._deferred) == 1
        space = cache.spaces(ALICE)[0]
        assert space.fetch(prompt[:20] + [0]).length == 20  # the earlier part ran
        cache.inserts.run_deferred()
        assert space.fetch(prompt + [0]).length == len(prompt)
        for n in (20, len(prompt)):
            asked = prompt[:n] + [0]
            hit = space.fetch(asked)
            assert hit.length == n
            got = model(mx.array(asked[n:])[None], cache=hit.cache)[0, -1]
            want = model(mx.array(asked)[None], cache=make_prompt_cache(model))[0, -1]
            assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=1e-4).item()
        assert alice


def test_with_replies_before_fetch_a_next_turn_runs_its_own_conversations_reply_first(cache):
    """A batch's padding makes a reply prefilled in the next turn's batch dear
    (every prompt of the batch grows to its length): the next turn's fetch runs
    its own conversation's waiting insert first (the default); another
    conversation's still waits."""
    assert cache.inserts.settings.replies_before_fetch
    mine, other = list(range(10, 40)), list(range(50, 80))
    tracked = [cache.begin(ALICE, p, None, ())[0] for p in (mine, other)]
    for p in (mine, other):
        cache.insert_cache(cache.model_key, p + [7, 7], filled(cache, p + [7, 7]))
    assert len(cache.inserts._background) == 2
    nxt = mine + [7, 7, 5, 6]
    cache.begin(ALICE, nxt, None, ())
    assert cache.last_hit.length == len(mine) + 2  # the reply was stored before the fetch
    assert len(cache.inserts._background) == 1 and cache.spaces(ALICE)[0].fetch(other + [7, 7, 0]).length == 0
    assert tracked


def test_a_prompt_goes_on_with_an_earlier_prompt_only_when_that_is_its_prefix():
    prompt = [1, 2, 3, 4, 5]
    assert _goes_on_with(prompt, [1, 2, 3]) and _goes_on_with(prompt, prompt)
    assert not _goes_on_with(prompt, [1, 9, 3])  # the same last token, another middle
    assert not _goes_on_with(prompt, [1, 2, 4])
    assert not _goes_on_with(prompt, [*prompt, 6]) and not _goes_on_with(prompt, [])


def test_finished_requests_inserts_wait_at_most_the_limit_and_the_oldest_goes(cache):
    """Each waiting insert holds its request's cache: past finished_limit the
    oldest is dropped (counted), the others are stored oldest first, one per call."""
    tuned(cache, finished_limit=2)
    prompts = [[10 + i] + list(range(20, 40)) for i in range(3)]
    tracked = [cache.begin(ALICE, p, None, ())[0] for p in prompts]
    for p in prompts:
        cache.insert_cache(cache.model_key, p + [7, 7], filled(cache, p + [7, 7]))
    assert cache.counts["reply_inserts_dropped"] == 1 and len(cache.inserts._background) == 2
    space, n = cache.spaces(ALICE)[0], len(prompts[0]) + 2
    cache.inserts.run_background(1)
    assert len(cache.inserts._background) == 1
    assert [space.fetch(p + [7, 7, 0]).length for p in prompts] == [0, n, 0]
    assert [stored(cache, ALICE, p + [7, 7]) for p in prompts] == [0, n, n]
    assert tracked


def test_a_reply_the_next_turn_stored_first_is_not_prefilled_again(cache):
    """The next turn's prompt holds the rendered reply; stored before the reply's
    own insert runs, that insert finds it and prefills nothing."""
    tok = cache.tokenizer
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello there"}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    turn = ChatTurn(messages, None, {})
    request, _ = cache.begin(ALICE, prompt, turn, ())
    generated = [*tok.encode("a short reply", add_special_tokens=False), tok.eos_token_id]
    named = prompt + generated
    cache.insert_cache(cache.model_key, named, filled(cache, named[:-1]))
    rendered = rendered_turn(tok, turn, generated, prompt)
    next_prompt = rendered + tok.encode(" and then", add_special_tokens=False)
    cache.spaces(ALICE)[0].insert(next_prompt, C.adopt_prompt_cache(filled(cache, next_prompt)))  # stored first
    cache.inserts.run_background()
    assert cache.counts["reply_inserts_already_stored"] == 1 and cache.counts["reply_tokens_prefilled"] == 0
    # Without the next turn first, a reply that renders otherwise (one token a
    # letter) is prefilled as rendered and stored.
    other = [{"role": "user", "content": "Something else"}]
    prompt = list(tok.apply_chat_template(other, add_generation_prompt=True, tokenize=True))
    turn = ChatTurn(other, None, {})
    request, _ = cache.begin(ALICE, prompt, turn, ())
    generated = [t for ch in "a short reply" for t in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
    cache.insert_cache(cache.model_key, prompt + generated, filled(cache, prompt + generated[:-1]))
    cache.inserts.run_background()
    rendered = rendered_turn(tok, turn, generated, prompt)
    assert cache.counts["reply_tokens_prefilled"] > 0
    assert cache.spaces(ALICE)[0].restorable_length(rendered) == len(rendered)
    assert request


def test_requests_await_their_first_token_until_marked_or_gone(cache):
    assert not cache.awaiting_first_token()
    tracked, _ = cache.begin(ALICE, list(range(10, 30)), None, ())
    other, _ = cache.begin(BOB, list(range(40, 60)), None, ())
    assert cache.awaiting_first_token()
    tracked.request.first_out = True
    assert cache.awaiting_first_token()  # Bob's has not
    del other
    gc.collect()
    assert not cache.awaiting_first_token()
    assert tracked


def test_segments_are_cut_at_checkpoints_inside_them():
    segments, kinds = split_segments([[1, 2, 3, 4], [5, 6, 7, 8, 9]], ["system", "user"], [2, 4, 6, 9, 12])
    assert segments == [[1, 2], [3, 4], [5, 6], [7, 8, 9]]
    assert kinds == ["system", "system", "user", "user"]


def test_with_kv_bits_a_fetch_restores_in_one_namespace_only(tmp_path, model_dir):
    """--kv-bits keeps plain and quantized caches in two namespaces; the index says
    which holds the longer prefix, and only that one restores (and counts a fetch)."""
    model, tokenizer = loaded(model_dir("llama"))
    with PromptStore.open(tmp_path / "store") as store:
        cache = StoreCache(store, model_id="tiny-llama", kv_bits=8, kv_group_size=32)
        cache.attach(model, tokenizer, None, ("m", None, None), prefill_step=64)
        plain, quantized = cache.spaces(ALICE)
        prompt = list(range(10, 50))
        request, _ = cache.begin(ALICE, prompt, None, ())
        assert plain.last_hit is not None and quantized.last_hit is None  # a miss in both: one fetch
        cache.insert_cache(cache.model_key, prompt, filled(cache, prompt))
        cache.inserts.run_background()
        plain.last_hit = None
        request, _ = cache.begin(ALICE, prompt + [5, 6], None, ())
        assert cache.last_hit is not None and cache.last_hit.length == len(prompt)
        assert plain.last_hit is not None and quantized.last_hit is None
        assert request


def test_a_reply_prefill_gives_way_between_chunks_and_goes_on_later(cache):
    """On CPU a waiting reply's prefill runs in chunks (reply_chunk) and pauses
    when a request waits; it keeps its place and state, and what it stores once
    done is what one whole prefill computes."""
    tuned(cache, reply_chunk=8)
    tok = cache.tokenizer
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello there"}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    turn = ChatTurn(messages, None, {})
    request, _ = cache.begin(ALICE, prompt, turn, ())
    text = "a reply the template renders in far fewer tokens than were generated, one a letter"
    generated = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
    named = prompt + generated
    cache.insert_cache(cache.model_key, named, filled(cache, named[:-1]))
    rendered = rendered_turn(tok, turn, generated, prompt)
    space = cache.spaces(ALICE)[0]
    asked = []
    cache.inserts.run_background(until=lambda: asked.append(1) or True)  # a request waits at once
    assert asked == [1] and cache.counts["reply_inserts_paused"] == 1 and len(cache.inserts._background) == 1
    assert space.restorable_length(rendered) < len(rendered)  # paused after its first chunk: nothing stored
    cache.inserts.run_background()  # on from where it paused
    assert not cache.inserts._background and space.restorable_length(rendered) == len(rendered)
    assert cache.counts["reply_tokens_prefilled"] > 2 * cache.inserts.settings.reply_chunk
    hit = space.fetch([*rendered, 5])
    assert hit.length == len(rendered)
    restored = cache.model(mx.array([[5]]), cache=hit.cache)[0, -1]
    whole = cache.model(mx.array([[*rendered, 5]]), cache=make_prompt_cache(cache.model))[0, -1]
    assert mx.abs(restored - whole).max().item() < 1e-4
    assert request
