"""PromptStore.metrics() with a remote tier: what A published, in values and bytes,
and B's hit counted under the remote tier, with the bytes it fetched."""

import promptstore
from promptstore.snapshots.remote import CHUNK

from ..conftest import forward, prompt_tokens


def test_published_bytes_and_a_remote_hit_are_counted(tmp_path, redis_server, model_of):
    model = model_of("llama")
    tokens = prompt_tokens(CHUNK + 60, seed=41)
    prefix = CHUNK + 40
    with promptstore.PromptStore.open(tmp_path / "a", remote_url=redis_server.url) as a:
        space = a.bind(model, model_id="m")
        cache = space.new_cache()
        forward(model, cache, tokens[:prefix])
        space.insert(tokens[:prefix], cache)
        a.flush()  # the file is written, then published
        m = a.metrics()
    assert m.remote_written == 1 and m.remote_written_bytes >= m.disk_written_bytes > 0
    with promptstore.PromptStore.open(tmp_path / "b", remote_url=redis_server.url) as b:
        hit = b.bind(model, model_id="m").fetch(tokens)
        got = b.metrics().models["m"]
    assert hit.length == hit.remote_tokens == prefix
    assert got.restored_tokens == {"hot": 0, "cold": 0, "remote": prefix, "computed": 0}
    assert got.restores["remote"] == 1 and got.restore_bytes["remote"] == hit.nbytes > 0
