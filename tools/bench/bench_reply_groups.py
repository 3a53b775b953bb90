"""Storing a round's chat replies: one at a time, grouped with right padding, and
grouped with even tails (serve/reply_inserts.py), side by side in one run.

Each user's conversation is prefilled as mlx_lm.server hands it over (prompt and
reply in one cache), its reply spelled one token a letter so that the next
turn's rendering differs and the store must prefill it; then the waiting
replies are stored the way the server's generation thread does
(`run_background`, with the server's settings for the device: on CPU a reply's
prefill gives way every 8 tokens), timed. The demo's llama in float32 (OpenBLAS preloaded
when installed). Prints a table and writes bench-results/chat-users/reply-groups-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from common import blas_info, blas_warning, describe_device, write_results
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


def one_round(model, tok, work: Path, users: int, chars: int, way: dict) -> tuple[float, int]:
    """Seconds to store `users` waiting replies, and the forwards it took."""
    text = CORPUS.read_text() * (1 + chars // max(1, len(CORPUS.read_text())))
    with PromptStore.open(Path(tempfile.mkdtemp(dir=work))) as store:
        cache = StoreCache(store, model_id="bench")
        cache.attach(model, tok, None, ("m", None, None), prefill_step=512)
        # The server's settings on this device (on CPU a reply's prefill gives way every 8 tokens).
        cache.inserts.settings = InsertSettings.for_server(
            batch=64, replies_before_fetch=True, reply_batch=way["batch"]
        )
        cache.replies.even_tails = way["even"]
        held = []
        for u in range(users):
            messages = [
                {"role": "system", "content": text[: chars + 40 * u]},
                {"role": "user", "content": "q" * (u + 1)},
            ]
            prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
            request, _ = cache.begin(PUBLIC, prompt, ChatTurn(messages, None, {}), ())
            held.append(request)
            spelled = ANSWER[: 36 + 2 * u]
            reply = [t for ch in spelled for t in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
            kv = make_prompt_cache(model)
            named = prompt + reply
            model(mx.array(named[:-1])[None], cache=kv)
            mx.eval([c.state for c in kv])
            cache.insert_cache(cache.model_key, named, kv)
        started = time.perf_counter()
        cache.inserts.run_background()
        return time.perf_counter() - started, cache.counts["reply_forwards"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, nargs="+", default=[4, 8])
    p.add_argument("--chars", type=int, nargs="+", default=[3000, 12000], help="system prompt lengths (characters)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    blas = blas_info()
    if warning := blas_warning(blas):
        print(warning)
    work = Path(tempfile.mkdtemp(prefix="bench-reply-groups-"))
    folder = write_model_dir(work / "model", "llama", **{**DEMO_LLAMA, "vocab_size": 1024})
    model, tok = load(str(folder))
    rows = []
    print(f"{'users':>5} {'prompt chars':>12}  " + "  ".join(f"{w:>22}" for w in WAYS))
    for users in args.users:
        for chars in args.chars:
            row = {"users": users, "system_chars": chars}
            for name, way in WAYS.items():
                samples, forwards = [], 0
                for _ in range(args.runs):
                    seconds, forwards = one_round(model, tok, work, users, chars, way)
                    samples.append(seconds)
                row[name] = {"median_s": statistics.median(samples), "samples_s": samples, "forwards": forwards}
            rows.append(row)
            cells = "  ".join(f"{row[w]['median_s'] * 1e3:>11,.0f} ms, {row[w]['forwards']:>2} fwd" for w in WAYS)
            print(f"{users:>5} {chars:>12}  {cells}", flush=True)
    device = "cpu" if mx.default_device() == mx.cpu else "cuda"
    out = write_results(
        f"bench-results/chat-users/reply-groups-{device}.json",
        {
            "benchmark": "reply groups",
            "device": describe_device(),
            "command": "python tools/bench/bench_reply_groups.py " + " ".join(sys.argv[1:]),
            "model": "the demo's llama (4 layers, hidden 256), float32",
            "runs": args.runs,
            "rows": rows,
        },
        blas,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
