"""Remote keys name a prefix, and only that prefix, under one namespace's secret."""

import numpy as np
import pytest

from promptstore.errors import RemoteError
from promptstore.snapshots.remote import CHUNK, RemoteKeys
from promptstore.snapshots.remote.seal import Chain, Link, seal_chain, unseal, unseal_chain

TOKENS = np.arange(3 * CHUNK + 40, dtype="<u4") % 1000


def test_every_position_has_one_key_however_it_is_computed():
    keys = RemoteKeys.of(bytes(16))
    grid = keys.grid(TOKENS, len(TOKENS))
    for lo in (0, 1, CHUNK, CHUNK + 7, 3 * CHUNK):
        hi = min(len(TOKENS), (lo // CHUNK + 1) * CHUNK)
        for p, key in keys.positions(grid, TOKENS, lo, hi).items():
            assert key == keys.position(TOKENS, p) == keys.position(TOKENS[: p + 5], p)
    every = [keys.position(TOKENS, p) for p in range(1, len(TOKENS) + 1)]
    assert len(set(every)) == len(every)


def test_keys_depend_on_every_token_the_namespace_and_the_secret():
    keys = RemoteKeys.of(bytes(16))
    p = 2 * CHUNK + 3
    changed = TOKENS.copy()
    changed[5] += 1
    assert keys.position(TOKENS, p) != keys.position(changed, p)
    assert keys.position(TOKENS, p) != RemoteKeys.of(bytes(15) + b"\1").position(TOKENS, p)
    assert keys.position(TOKENS, p) != RemoteKeys.of(bytes(16), "deployment secret").position(TOKENS, p)
    assert keys.blob(keys.position(TOKENS, p), 0) != keys.blob(keys.position(TOKENS, p), CHUNK)


def test_a_sealed_record_opens_only_at_its_own_key():
    keys = RemoteKeys.of(bytes(16))
    chain = Chain(links=[Link(start=0, end=10, blob="ab" * 16, nbytes=1, seconds=0.1)])
    sealed = seal_chain(keys.seal, chain, "ps:i:one")
    assert unseal_chain(keys.seal, sealed, "ps:i:one") == chain
    for value, where in ((sealed, "ps:i:two"), (sealed[:-1], "ps:i:one"), (b"junk", "ps:i:one"), (None, "x")):
        with pytest.raises(RemoteError) as e:
            unseal(keys.seal, value, where)
        assert e.value.reason == "garbage"
    with pytest.raises(ValueError):
        Chain(links=[Link(start=5, end=10, blob="ab" * 16, nbytes=1, seconds=0.0)])  # does not start at 0
