"""Probe: why is a fresh process's first batch over 5k-token caches slow?

python3 tools/bench/probe_first_batch.py MODE [--warm-prefix N]   (one fresh process per call)
MODE sdpa: time SDPA calls of the shapes the first round meets, first vs repeat vs a new length.
MODE batch: 4 caches of L tokens (filled without attention), optional warm-up, then three
            BatchGenerator batches of 19 new tokens, each timed to its first tokens.
MODE prefill: one request's prefill of 4.8k, 8k and 32k tokens in 2,048-token steps, twice each (the
            first run meets new shapes); then eight chat turns of 50-57 tokens over a 5k-token cache,
            each a new key length. Run it with and without MLX_CUDA_USE_CUDNN_SDPA=0.
MODE spill [--beside]: batches as in `batch` (kernels warmed by a first one), each after a
            spill-sized host read of 4 caches' arrays (ColdTier.write's device.host_readable and
            checksums) on another thread: none, the copies dropped as they were, or dropped
            through device.release_host_copies. --beside: the read runs beside the batch (as the
            server's spill thread runs beside requests), and one more batch follows it.
            --staged: the variants none, released and staged (the arrays copied by the copy
            engine into pinned host buffers and hashed there, as ColdTier.write does on CUDA).
MODE keep: batches as in `batch` (kernels warmed by a first one), alternating mlx-lm as it is
            (MLX's buffer cache emptied after each prompt step) with mx.clear_cache a no-op.
Options of batch: --warm-prefix N (the server's kernel warm-up first, with N-token prefixes),
--digest (the weights digest the server makes without --model-id), --clear (mx.clear_cache() after it).
Llama-3.1-8B's shape with random bfloat16 weights; PROBE_SMALL=1 makes it 2 small layers (a smoke run).
Figures from it are in bench-results/archive/2026-11/probe-*.log; it times, it asserts nothing.
"""

import json
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import PROFILES  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from promptstore.serve import warmup  # noqa: E402
from promptstore.testing import tiny_model  # noqa: E402

MODEL = dict(PROFILES["cuda"]["model"])  # what bench_serve.py --profile cuda serves
VOCAB = 1024
if os.environ.get("PROBE_SMALL"):
    MODEL.update(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, intermediate_size=512, head_dim=128)
out = {"mode": sys.argv[1], "argv": sys.argv[1:], "env_cudnn": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA")}


def t(fn):
    mx.synchronize()
    a = time.perf_counter()
    r = fn()
    mx.eval(r)
    mx.synchronize()
    return round((time.perf_counter() - a) * 1000, 2)


def sdpa():
    B, H, KH, D = 4, 32, 8, 128
    res = {}
    for name, q_len, kv_len, cap in [
        ("prefill19_kv5120_mask", 19, 5120, None),
        ("prefill19_kv5120_mask_again", 19, 5120, None),
        ("prefill19_kv5157_mask", 19, 5157, None),
        ("prefill19_kv5200_causal", 19, 5200, None),
        ("prefill19_kv5230_causal", 19, 5230, None),
        ("decode_kv5140_slice", 1, 5140, 5376),
        ("decode_kv5140_slice_again", 1, 5140, 5376),
        ("decode_kv5141_slice", 1, 5141, 5376),
        ("decode_kv5400_slice", 1, 5400, 5632),
        ("prefill19_kv60_mask", 19, 60, None),
        ("decode_kv70_slice", 1, 70, 256),
    ]:
        q = mx.random.normal((B, H, q_len, D)).astype(mx.bfloat16)
        if cap:
            kb = mx.random.normal((B, KH, cap, D)).astype(mx.bfloat16)
            vb = mx.random.normal((B, KH, cap, D)).astype(mx.bfloat16)
            mx.eval(kb, vb)
            k, v = kb[..., :kv_len, :], vb[..., :kv_len, :]
        else:
            k = mx.random.normal((B, KH, kv_len, D)).astype(mx.bfloat16)
            v = mx.random.normal((B, KH, kv_len, D)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        if "mask" in name:
            m = mx.ones((B, 1, q_len, kv_len), mx.bool_)
            mx.eval(m)
            fn = lambda q=q, k=k, v=v, m=m: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=m)  # noqa: E731
        elif "causal" in name:
            fn = lambda q=q, k=k, v=v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask="causal")  # noqa: E731
        else:
            fn = lambda q=q, k=k, v=v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)  # noqa: E731
        res[name] = [t(fn), t(fn)]
        print(name, res[name], flush=True)
    out["sdpa_ms_first_second"] = res


def caches_of(model, lengths, seed):
    caches, prefixes = [], []
    for b, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        for c in cache:
            kk = mx.random.normal((1, 8, n, 128), key=mx.random.key(seed + b)).astype(mx.bfloat16) * 0.1
            c.update_and_fetch(kk, kk)
        mx.eval([c.state for c in cache])
        caches.append(cache)
        prefixes.append([1 + (i * 31 + b) % (VOCAB - 1) for i in range(n)])
    return caches, prefixes


def step_batch(model, caches, prefixes, segments) -> dict:
    """mlx-lm's BatchGenerator over these caches until every prompt has 3 tokens:
    each prompt's time to its first token, and each step's time (synchronised)."""
    gen = BatchGenerator(
        model,
        completion_batch_size=4,
        prefill_batch_size=4,
        prefill_step_size=2048,
        stream=mx.default_stream(mx.default_device()),
    )
    steps, first = [], {}
    mx.synchronize()
    started = time.perf_counter()
    try:
        n = len(caches)
        uids = gen.insert_segments(segments=segments, max_tokens=[3] * n, caches=caches, all_tokens=prefixes)
        done = set()
        for _ in range(64):
            a = time.perf_counter()
            _, responses = gen.next()
            mx.synchronize()
            steps.append(round((time.perf_counter() - a) * 1000, 1))
            now = round((time.perf_counter() - started) * 1000, 1)
            for r in responses:
                first.setdefault(r.uid, now)
                if r.finish_reason is not None:
                    done.add(r.uid)
            if done >= set(uids):
                break
    finally:
        gen.close()
    return {"first_token_ms": sorted(first.values()), "steps_ms": steps}


def batch(model, lengths, seed):
    caches, prefixes = caches_of(model, lengths, seed)
    segments = [[[1 + (seed * 7 + i * 13 + b) % (VOCAB - 1) for i in range(19)]] for b in range(len(lengths))]
    return step_batch(model, caches, prefixes, segments)


def prefill_mode():
    model = tiny_model("llama", seed=0, dtype=mx.bfloat16, vocab_size=VOCAB, **MODEL)
    mx.eval(model.parameters())
    tokens = [1 + (i * 7919) % (VOCAB - 1) for i in range(32768 + 512)]

    def run(n, cache):
        for lo in range(0, n, 2048):
            model(mx.array(tokens[lo : min(lo + 2048, n)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        return mx.argmax(model(mx.array(tokens[n : n + 1])[None], cache=cache)[0, -1])

    res = {}
    for n in (4800, 8192, 32768) if not os.environ.get("PROBE_SMALL") else (300, 600):
        res[f"prefill_{n}_ms"] = [t(lambda n=n: run(n, make_prompt_cache(model))) for _ in range(2)]
        print(n, res[f"prefill_{n}_ms"], flush=True)
    cache = make_prompt_cache(model)
    start = 5000 if not os.environ.get("PROBE_SMALL") else 500
    run(start, cache)
    turns, pos = [], start
    for i in range(8):
        n = 50 + i
        turns.append(t(lambda lo=pos, n=n: model(mx.array(tokens[lo : lo + n])[None], cache=cache)))
        pos += n
    res["turns_ms"] = turns
    print("turns", turns, flush=True)
    out["prefill"] = res


def staged_hashes(arrays: dict) -> dict:
    """--staged: each array's xxh3-128 from the chunks ColdTier.write stages
    (device.staged_sources: the copy engine into two pinned host buffers, no copy
    on the device, no page moved). bench-results/archive/2026-11/probe-spill-staged.log was made
    by this probe's first version, which built its own address kernel for each
    input dtype (the 1.3 s of its first staged run)."""
    import xxhash

    from promptstore.snapshots import device

    sums = {}
    for name, chunks in device.staged_sources(arrays).items():
        digest = xxhash.xxh3_128()
        for chunk in chunks():
            digest.update(chunk)
        sums[name] = digest.hexdigest()
    return sums


def spill_mode(beside: bool):
    import threading

    from promptstore.snapshots import device
    from promptstore.snapshots.cold import checksums

    model = tiny_model("llama", seed=0, dtype=mx.bfloat16, vocab_size=VOCAB, **MODEL)
    mx.eval(model.parameters())
    lengths = [5096, 5098, 5101, 5097]
    batch(model, lengths, 0)  # kernels
    res = {}
    variants = ["none", "dropped", "released", "dropped", "released", "none"]
    if "--staged" in sys.argv:
        variants = ["none", "released", "staged", "released", "staged", "none"]
    for i, variant in enumerate(variants):
        spill_ms = [0.0]
        worker = None
        if variant != "none":
            caches, _ = caches_of(model, lengths, 50 + i)
            arrays = {
                f"{b}.{j}.{k}": a
                for b, c in enumerate(caches)
                for j, layer in enumerate(c)
                for k, a in enumerate(layer.state)
                if isinstance(a, mx.array)
            }
            del caches

            if variant == "staged":
                kept = arrays

            def spill(arrays=arrays, release=variant == "released", spill_ms=spill_ms, staged=variant == "staged"):
                a = time.perf_counter()
                if staged:
                    sums = staged_hashes(arrays)
                    spill_ms[0] = round((time.perf_counter() - a) * 1000, 1)
                    spill_ms.append({n: sums[n] for n in list(arrays)[:2]})  # checked after the batches
                    return
                copies = device.host_readable(arrays)  # what ColdTier.write reads
                checksums(copies)
                if release:
                    device.release_host_copies(copies)  # past device.CLEAR_BYTES: empties MLX's buffer cache
                del copies
                spill_ms[0] = round((time.perf_counter() - a) * 1000, 1)

            del arrays
            worker = threading.Thread(target=spill)
            worker.start()
            if not beside:
                worker.join()
        r = batch(model, lengths, 100 * i)
        if worker is not None:
            worker.join()
        r.update(variant=variant, spill_ms=spill_ms[0], cache_gb=round(mx.get_cache_memory() / 1e9, 2))
        if beside:
            r["next_first_token_ms"] = batch(model, lengths, 100 * i + 1)["first_token_ms"][0]
        if variant == "staged":  # the bytes staged are the arrays' bytes
            first = {n: kept[n] for n in spill_ms[1]}
            r["staged_bytes_equal"] = checksums(device.host_readable(first)) == spill_ms[1]
            kept = None
        res.setdefault(variant, []).append(r)
        print(variant, r, flush=True)
    out["spill"] = res


def keep_mode():
    """Batches with MLX's buffer cache emptied after each prompt step (as mlx-lm
    does) and kept, alternating, after a first batch that builds the kernels."""
    from unittest import mock

    model = tiny_model("llama", seed=0, dtype=mx.bfloat16, vocab_size=VOCAB, **MODEL)
    mx.eval(model.parameters())
    batch(model, [5000, 5002, 5005, 5001], 1)
    res = {"cleared": [], "kept": []}
    for i in range(8):
        base = 5096 + 37 * i
        variant = "kept" if i % 2 else "cleared"
        if variant == "kept":
            with mock.patch.object(mx, "clear_cache", lambda: None):
                r = batch(model, [base + d for d in (0, 2, 5, 1)], 100 * i)
        else:
            r = batch(model, [base + d for d in (0, 2, 5, 1)], 100 * i)
        res[variant].append(r)
        print(variant, r, flush=True)
    out["keep"] = res


def main():
    mode = sys.argv[1]
    if mode == "sdpa":
        sdpa()
    elif mode == "prefill":
        prefill_mode()
    elif mode == "spill":
        spill_mode("--beside" in sys.argv)
    elif mode == "keep":
        keep_mode()
    else:
        warm_prefix = int(sys.argv[sys.argv.index("--warm-prefix") + 1]) if "--warm-prefix" in sys.argv else 0
        a = time.perf_counter()
        model = tiny_model("llama", seed=0, dtype=mx.bfloat16, vocab_size=VOCAB, **MODEL)
        mx.eval(model.parameters())
        out["model_s"] = round(time.perf_counter() - a, 1)
        if "--digest" in sys.argv:
            from promptstore.store.model import weights_digest

            a = time.perf_counter()
            weights_digest(model)
            out["digest_s"] = round(time.perf_counter() - a, 1)
            out["cache_after_digest_gb"] = round(mx.get_cache_memory() / 1e9, 2)
        if "--clear" in sys.argv:
            mx.clear_cache()
        if warm_prefix:
            warmup.PREFIX_TOKENS = warm_prefix
            out["warm_up_s"] = round(warmup.warm_up(model, VOCAB, 4, prefill_batch_size=4, prefill_step_size=2048), 3)
        runs = []
        for i, base in enumerate([5096, 5170, 5245]):
            r = batch(model, [base + d for d in (0, 2, 5, 1)], 100 * i)
            runs.append(r)
            print(i, r, flush=True)
        out["batches"] = runs
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
