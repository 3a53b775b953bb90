"""Probe: a restarted process's first batch over caches from the store's warm start.

python3 tools/bench/probe_warm_start.py fill DIR; then, each in a fresh process:
python3 tools/bench/probe_warm_start.py restart DIR [--copy] [--no-warm-start] [--prebuild] [--serial]

fill stores four 5.1k-token conversations (a shared 1,900-token system prompt) of Llama-3.1-8B's shape
with random bfloat16 weights. restart opens the store and starts its warm start, makes the model, runs
the server's kernel warm-up, then steps three batches of 4 x 19 new tokens over hits from memory, each
timed to its first tokens. --serial: the warm start finishes before the model is made; --copy: every
hit's arrays are copied before its batch; --no-warm-start: the hits are read at fetch; --prebuild: the
reading threads' address kernel is built before the warm start. It times; it asserts nothing.
"""

import json
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(__file__))
from probe_first_batch import MODEL, VOCAB, step_batch  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.caches import make_prompt_cache  # noqa: E402
from promptstore.serve import warmup  # noqa: E402
from promptstore.testing import tiny_model  # noqa: E402

out = {"argv": sys.argv[1:]}
SYSTEM = [1 + (i * 7) % (VOCAB - 1) for i in range(1900)]


def conv(b, extra=0):
    return SYSTEM + [1 + (i * 13 + b * 101) % (VOCAB - 1) for i in range(3200 + extra)]


def model_():
    m = tiny_model("llama", seed=0, dtype=mx.bfloat16, vocab_size=VOCAB, **MODEL)
    mx.eval(m.parameters())
    return m


def fill(root):
    model = model_()
    with PromptStore.open(root) as store:
        space = store.bind(model, model_id="probe")
        for b in range(4):
            tokens = conv(b)
            cache = make_prompt_cache(model)
            for lo in range(0, len(tokens), 2048):
                model(mx.array(tokens[lo : lo + 2048])[None], cache=cache)
                mx.eval([c.state for c in cache])
            space.insert(tokens, cache)


def batch(model, space, i, copy):
    mx.synchronize()
    t0 = time.perf_counter()
    caches, prefixes, segments = [], [], []
    for b in range(4):
        tokens = conv(b, 19 * (i + 1))
        hit = space.fetch(tokens)
        assert hit.length > 5000, hit.length
        mx.eval([c.state for c in hit.cache])
        if copy:
            for c in hit.cache:
                c.keys, c.values = mx.array(c.keys) * 1, mx.array(c.values) * 1
            mx.eval([c.state for c in hit.cache])
        caches.append(hit.cache)
        prefixes.append(tokens[: hit.length])
        segments.append([tokens[hit.length :]])
    mx.synchronize()
    fetched = round((time.perf_counter() - t0) * 1000, 1)
    lengths = [len(p) for p in prefixes]
    return {"fetch_ms": fetched, "lengths": lengths, **step_batch(model, caches, prefixes, segments)}


def restart(root):
    import logging

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(threadName)s %(name)s %(message)s")
    if "--prebuild" in sys.argv:
        from promptstore.snapshots import reader

        out["prebuilt"] = reader._address_kernel() is not None
    store = PromptStore.open(root, hot_bytes=20 << 30)
    warming = None if "--no-warm-start" in sys.argv else store.warm()
    if warming is not None and "--serial" in sys.argv:
        warming.wait()
    model = model_()
    space = store.bind(model, model_id="probe")
    out["warm_up_s"] = round(warmup.warm_up(model, VOCAB, 4, prefill_batch_size=4, prefill_step_size=2048), 3)
    if warming is not None:
        warming.wait()
    out["cache_gb"] = round(mx.get_cache_memory() / 1e9, 2)
    out["active_gb"] = round(mx.get_active_memory() / 1e9, 2)
    out["batches"] = []
    for i in range(3):
        r = batch(model, space, i, "--copy" in sys.argv)
        print(i, r, flush=True)
        out["batches"].append(r)
    store.close()


if sys.argv[1] == "fill":
    fill(sys.argv[2])
else:
    restart(sys.argv[2])
print("RESULT " + json.dumps(out), flush=True)
