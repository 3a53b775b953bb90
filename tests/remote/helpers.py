"""Two stores (two machines) on one server: publish from A, restore on B, compare."""

from __future__ import annotations

import mlx.core as mx

import promptstore

from ..conftest import forward, fresh_cache, greedy


def publish(path, url, model, tokens, salt=None, **settings):
    """Store A: prefill `tokens`, insert them, close (which waits for the publish)."""
    with promptstore.PromptStore.open(path, remote_url=url, **settings) as store:
        space = store.bind(model, model_id="m", salt=salt)
        cache = space.new_cache()
        forward(model, cache, tokens)
        space.insert(tokens, cache)
        remote = store.remote
    return dict(remote.counts)  # after close, which waited for the publish


def assert_faithful(model, hit, tokens, n_greedy=6):
    """Generation from the hit equals generation from a full prefill."""
    want_cache = fresh_cache(model)
    want = forward(model, want_cache, tokens)
    got = forward(model, hit.cache, tokens[hit.length :])
    assert mx.allclose(got, want, atol=1e-4, rtol=0).item(), float(mx.abs(got - want).max())
    assert greedy(model, hit.cache, got, n_greedy) == greedy(model, want_cache, want, n_greedy)


def commands(client) -> int:
    """Commands the server has processed (each is one round trip: nothing here pipelines a fetch)."""
    return int(client.info("stats")["total_commands_processed"])
