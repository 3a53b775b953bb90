"""tools/gpu/batch_round.py at a test's size: a round of returning chats through
mlx-lm's BatchGenerator gives every user the same first token whichever way
its cache came (kept, or restored from a store; all at once, or one joining
per step), and that token is a full prefill's."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))

import batch_round  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.serve.cache import StoreCache  # noqa: E402
from promptstore.serve.tenants import PUBLIC  # noqa: E402
from promptstore.testing.model_dir import write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402


def test_every_way_gives_each_user_a_full_prefills_first_token(tmp_path):
    model, tokenizer = load(
        str(write_model_dir(tmp_path / "model", "llama", vocab_size=batch_round.VOCAB, **DEMO_LLAMA))
    )
    contexts = [batch_round.tokens(u, 40 + 16 * u) for u in range(3)]
    new = [batch_round.tokens(1000 + u, 9 + 2 * u) for u in range(3)]
    caches = [batch_round.prefilled(model, ids) for ids in contexts]
    expected = []
    for ids, more in zip(contexts, new):
        logits = model(mx.array(ids + more)[None])
        expected.append(int(mx.argmax(logits[0, -1]).item()))
    with PromptStore.open(tmp_path / "store") as kept_in:
        store = StoreCache(kept_in, model_id="probe")
        store.attach(model, tokenizer, None, ("m", None, None), prefill_step=2048)
        for ids, cache in zip(contexts, caches):
            held, _ = store.begin(PUBLIC, ids, None, ())
            store.insert_cache(store.model_key, ids, batch_round.copied(model, cache, len(ids)))
            store.inserts.run_deferred()
            del held
        for restored in (False, True):
            for staggered in (False, True):
                got = batch_round.one_round(model, contexts, caches, store if restored else None, new, staggered)
                assert got["first_tokens"] == expected, (restored, staggered)
                assert got["steps"] and all(s["ms"] >= 0 for s in got["steps"])
    assert store.counts["restored_tokens"] == 2 * sum(len(ids) for ids in contexts)
