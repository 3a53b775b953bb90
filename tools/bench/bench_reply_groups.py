"""Storing a round's chat replies: one at a time, grouped with right padding, and
grouped with even tails (serve/reply_inserts.py), side by side in one run.

Each user's conversation is prefilled as mlx_lm.server hands it over (prompt and
reply in one cache), its reply spelled one token a letter so that the next
turn's rendering differs and the store must prefill it; then the waiting
replies are stored the way the server's generation thread does
(`run_background`, with the server's settings for the device: on CPU a reply's
prefill gives way every 8 tokens), timed. Profile cpu: the demo's llama in float32
(OpenBLAS preloaded when installed); cuda: bench_serve's Llama-3.1-8B shape in
bfloat16. Each run's replies are one letter longer than the last run's, so every
run meets batch shapes not met before, as a server's rounds do; the first run also
holds the process's first kernel builds, and is reported apart. Prints a table and
writes bench-results/chat-users/reply-groups-<device>.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from bench_serve import PROFILES as SERVE_PROFILES
from common import blas_info, blas_warning, write_device_results
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore import PromptStore  # noqa: E402
from promptstore.serve.cache import StoreCache  # noqa: E402
from promptstore.serve.insert_scheduler import InsertSettings  # noqa: E402
from promptstore.serve.replies import ChatTurn  # noqa: E402
from promptstore.serve.tenants import PUBLIC  # noqa: E402
from promptstore.testing.model_dir import write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402
from promptstore.testing.tokenizer import CORPUS  # noqa: E402

WAYS = {"one at a time": dict(batch=1, even=True), "grouped, padded": dict(batch=64, even=False)}
WAYS["grouped, even tails"] = dict(batch=64, even=True)
ANSWER = "the answer is about the harbour and the tides of the bay"


def one_way(model, tok, work: Path, users: int, chars: int, way: dict, runs: int) -> tuple[list[float], int, int]:
    """Seconds to store `users` waiting replies in each of `runs` rounds (one
    store, as a server's: every round's prompts are stored before it, its replies
    are new), the forwards a round took, and the longest prompt's tokens."""
    text = CORPUS.read_text() * (1 + chars // max(1, len(CORPUS.read_text())))
    samples, forwards = [], 0
    with PromptStore.open(Path(tempfile.mkdtemp(dir=work))) as store:
        cache = StoreCache(store, model_id="bench")
        cache.attach(model, tok, None, ("m", None, None), prefill_step=512)
        # The server's settings on this device (on CPU a reply's prefill gives way every 8 tokens).
        cache.inserts.settings = InsertSettings.for_server(
            batch=64, replies_before_fetch=True, reply_batch=way["batch"]
        )
        cache.replies.even_tails = way["even"]
        for run in range(runs):
            held = []
            for u in range(users):
                messages = [
                    {"role": "system", "content": text[: chars + 40 * u]},
                    {"role": "user", "content": "q" * (u + 1)},
                ]
                prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
                request, _ = cache.begin(PUBLIC, prompt, ChatTurn(messages, None, {}), ())
                held.append(request)
                # Each round's replies one letter longer: batch shapes not met before.
                spelled = (ANSWER * 2)[: 36 + 2 * u + run]
                reply = [t for ch in spelled for t in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
                kv = make_prompt_cache(model)
                # The prompt is stored as the server stores it while the request runs (a
                # part of its prompt), untimed: what the round's replies add is their tails.
                model(mx.array(prompt)[None], cache=kv)
                mx.eval([c.state for c in kv])
                cache.insert_cache(cache.model_key, prompt, kv)
                cache.inserts.run_deferred()
                model(mx.array(reply[:-1])[None], cache=kv)
                mx.eval([c.state for c in kv])
                cache.insert_cache(cache.model_key, prompt + reply, kv)
            before, started = cache.counts["reply_forwards"], time.perf_counter()
            cache.inserts.run_background()
            samples.append(time.perf_counter() - started)
            forwards = cache.counts["reply_forwards"] - before
            del held, kv
            mx.clear_cache()  # the next round's buffers are its own (a GPU's cache would grow run to run)
    return samples, forwards, len(prompt)


PROFILES = {
    "cpu": dict(model=dict(DEMO_LLAMA), dtype="float32", note="the demo's llama (4 layers, hidden 256), float32"),
    "cuda": dict(model=SERVE_PROFILES["cuda"]["model"], dtype="bfloat16", note=SERVE_PROFILES["cuda"]["note"]),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--users", type=int, nargs="+", default=[4, 8])
    p.add_argument("--chars", type=int, nargs="+", default=[3000, 12000], help="system prompt lengths (characters)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", help="JSON path (default bench-results/chat-users/reply-groups-<device>.json)")
    args = p.parse_args()
    profile = PROFILES[args.profile]
    blas = blas_info()
    if args.profile == "cpu" and (warning := blas_warning(blas)):
        print(warning)
    work = Path(tempfile.mkdtemp(prefix="bench-reply-groups-"))
    try:
        folder = write_model_dir(
            work / "model", "llama", vocab_size=1024, dtype=getattr(mx, profile["dtype"]), **profile["model"]
        )
        model, tok = load(str(folder))
        rows = []
        print(f"{profile['note']}; first run apart, then the median of the others")
        print(f"{'users':>5} {'tokens':>6}  " + "  ".join(f"{w:>30}" for w in WAYS))
        for users in args.users:
            for chars in args.chars:
                row = {"users": users, "system_chars": chars}
                for name, way in WAYS.items():
                    samples, forwards, row["prompt_tokens"] = one_way(model, tok, work, users, chars, way, args.runs)
                    rest = samples[1:] or samples
                    row[name] = {
                        "median_s": statistics.median(rest),
                        "first_s": samples[0],
                        "samples_s": samples,
                        "forwards": forwards,
                    }
                rows.append(row)
                cells = "  ".join(
                    f"{row[w]['first_s'] * 1e3:>7,.0f} / {row[w]['median_s'] * 1e3:>7,.0f} ms, {row[w]['forwards']:>2} fwd"
                    for w in WAYS
                )
                print(f"{users:>5} {row['prompt_tokens']:>6}  {cells}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the cuda profile's model is 16 GB
    note = profile["note"]
    write_device_results("reply-groups", __file__, blas, args, benchmark="reply groups", model=note, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
