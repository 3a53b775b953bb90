"""Namespaces across machines: two salts never share a hit, and nothing on the
server names a salt, a token, a span or a namespace in clear."""

import numpy as np

import promptstore
from promptstore.index import prefix_key
from promptstore.snapshots.remote import RemoteKeys

from ..conftest import prompt_tokens
from .helpers import assert_faithful, publish

SALTS = ("tenant-one-secret-salt", "tenant-two-secret-salt")
# Replicas that share salted namespaces share the deployment's secret: it keys the
# digests of salts (without it, each store keys them with a random key of its own).
SECRET = "the-deployment-secret"


def test_two_salts_never_share_a_hit(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=21)
    publish(tmp_path / "a", redis_server.url, model, tokens[:280], salt=SALTS[0], remote_secret=SECRET)
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url, remote_secret=SECRET) as b:
        other = b.bind(model, model_id="m", salt=SALTS[1])
        unsalted = b.bind(model, model_id="m")
        assert other.fetch(tokens).length == 0 and unsalted.fetch(tokens).length == 0
        assert b.remote.counts["remote_hits"] == 0
        same = b.bind(model, model_id="m", salt=SALTS[0])  # the control: the same salt hits
        hit = same.fetch(tokens)
        assert hit.remote_tokens == 280
        assert_faithful(model, hit, tokens)


def _secrets_in_clear(tokens: np.ndarray, namespace: bytes, span_end: int) -> list[bytes]:
    toks = tokens.astype("<u4")
    needles = [s.encode() for s in SALTS]
    needles += [toks[i : i + 3].tobytes() for i in range(0, 280 - 3, 7)]  # any 3 tokens in a row, packed
    needles += [" ".join(map(str, toks[i : i + 3])).encode() for i in range(0, 280 - 3, 7)]
    needles += [",".join(map(str, toks[i : i + 3])).encode() for i in range(0, 280 - 3, 7)]
    needles += [namespace, namespace.hex().encode(), prefix_key(namespace, toks[:span_end]).hex().encode()]
    needles += [b'"start"', b'"end"', b"promptstore", b"safetensors", b"__metadata__", str(span_end).encode() + b","]
    return needles


def test_scan_shows_no_salt_token_span_or_namespace(tmp_path, redis_server, model_of):
    client = redis_server.client()
    check_scan_shows_nothing(
        tmp_path, redis_server.url, lambda: [(k, client.get(k)) for k in client.scan_iter(count=1000)], model_of
    )


def check_scan_shows_nothing(tmp_path, url, stored, model_of):
    """Two salts publish one prompt to the server at `url`; stored() -> every (key, value)
    there: none names a salt, a token, a span or a namespace in clear."""
    model = model_of("llama")
    tokens = prompt_tokens(300, seed=22)
    namespaces = []
    for i, salt in enumerate(SALTS):
        publish(tmp_path / f"a{i}", url, model, tokens[:280], salt=salt, remote_secret=SECRET)
        with promptstore.PromptStore.open(tmp_path / f"a{i}", remote_secret=SECRET) as a:
            namespaces.append(a.bind(model, model_id="m", salt=salt).namespace.key)
    items = stored()
    assert len(items) == 2 * 3  # per salt: one blob, a grid record at 256, the end record at 280
    keysets = [{k for k, _ in items if k.startswith(b"ps:b:")}]
    assert len(keysets[0]) == 2, "two namespaces never share a blob"
    for ns in namespaces:
        for needle in _secrets_in_clear(np.array(tokens), ns, 280):
            hits = [k for k, v in items if needle in k or needle in v]
            assert not hits, f"{needle[:24]!r} is in clear in {hits[:2]}"
    # And the keys are the namespaces' own: each derives from its own secret.
    assert RemoteKeys.of(namespaces[0]) != RemoteKeys.of(namespaces[1])
