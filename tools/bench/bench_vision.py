"""promptstore serve against mlx-vlm's server (its prefix cache on, with its disk
tier) and vllm-mlx (multimodal), on image chats; every reply checked against a
full prefill of its own prompt.

Every server runs the same random-weight vision-language model folder
(promptstore.testing.vision_models, at the profile's shape) in turn, on fresh
folders, one request at a time. The workload, for `--users` users:

- round 1: user 0's first turn: the system prompt, an image, a question (cold
  for every server; it makes the system prompt known);
- "new image": every other user's first turn: the same system prompt, an image
  of their own;
- "next turn": every user's second turn: their first turn, its reply, a new
  question with --images-per-turn new images;
- then every server stopped by SIGTERM and started again on its folders;
- "after restart": every user's third turn.

A figure is the median over --runs of each round's TTFT p50 over users. Each
reply is compared with the greedy reply of a full prefill of the prompt the
server was sent (computed here, by promptstore.vision with no store), as text
(less a leading space, which mlx_lm.server's detokenizer drops): equal; a "near
tie" where it leaves the reference at a step whose two best logits were within
the profile's `tie` (0.25 in bfloat16, 0.01 in float32: five times the largest
difference a prefill in steps makes at a prompt's last position, 0.048-0.055 in
bfloat16 and 0.002 in float32 on an H200, bench-results/vision/vision-cuda-chunks.json;
past such a tie any two correct runs may part); else wrong. The model's
vocabulary is the test tokenizer's (1,079 tokens, not Qwen's 152k: the output
layer is the smaller for it).
Writes bench-results/vision-<profile>.json, with `goals`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from common import blas_info, blas_warning, describe_device, print_goals, write_back, write_results
from serve_peers import Server, ask

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from promptstore.testing.tokenizer import CORPUS  # noqa: E402
from promptstore.testing.vision_models import write_vision_dir  # noqa: E402
from promptstore.vision import VisionModel  # noqa: E402

PROMPTSTORE, MLX_VLM, VLLM_MLX = "promptstore serve", "mlx-vlm", "vllm-mlx"
ROUNDS = ("first image", "new image", "next turn", "after restart")
GOALS = {"new image": 0.5, "next turn": 1.0, "after restart": 0.3}

# Qwen2.5-VL-7B's shape (its text model and vision tower) for the GPU; a small one for 2 CPU cores.
PROFILES = {
    "cpu": dict(
        text=dict(
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=768,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]},
        ),
        vision=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, window_size=112),
        vocab=2048,
        system_tokens=1000,
        image=(448, 336),
        answer_tokens=8,
        dtype="float32",
        tie=0.01,
    ),
    "cuda": dict(
        text=dict(
            hidden_size=3584,
            num_hidden_layers=28,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            rope_theta=1e6,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        vocab=32000,
        system_tokens=4000,
        image=(1024, 768),
        answer_tokens=16,
        dtype="bfloat16",
        tie=0.25,
    ),
}


def profile_model(folder: Path, profile: dict) -> Path:
    """The profile's model folder at `folder`: used as it is if written, else written there."""
    if (folder / "config.json").exists():
        return folder
    return write_vision_dir(
        folder,
        "qwen2_5_vl",
        vocab_size=profile["vocab"],
        dtype=getattr(mx, profile["dtype"]),
        text=profile["text"],
        vision=profile["vision"],
        processor={"max_pixels": profile["image"][0] * profile["image"][1] + 28 * 28 * 64},
    )


def picture(seed: int, size: tuple[int, int]) -> str:
    """A random photo-like image (smooth colour fields and noise) as a PNG data URL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    waves = [np.sin(x * rng.uniform(2, 9) + y * rng.uniform(2, 9) + rng.uniform(0, 6)) for _ in range(3)]
    noise = rng.normal(0, 0.1, (h, w, 3))
    pixels = ((np.stack(waves, axis=-1) + noise + 1) * 127).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def system_prompt(tokenizer, tokens: int) -> str:
    """Corpus text of about `tokens` tokens."""
    text, lines = "", CORPUS.read_text().splitlines()
    i = 0
    while len(tokenizer.encode(text)) < tokens:
        text += lines[i % len(lines)] + " "
        i += 1
    return text.strip()


def user_turn(question: str, images: list[str]) -> dict:
    parts = [{"type": "text", "text": question}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"role": "user", "content": parts}


class Reference:
    """Greedy replies of full prefills, made here with promptstore.vision and no store."""

    def __init__(self, folder: Path, answer_tokens: int):
        # MLX keeps freed buffers for reuse: over a run's prompts of ever other lengths, this
        # process held 94 GB of an H200's 141 GB, and the server beside it slowed tenfold in
        # the runs after. A reference is not timed: its buffers are let go after each reply.
        mx.set_cache_limit(1 << 30)
        self.model = VisionModel.load(folder)
        self.n = answer_tokens
        tok = self.model.tokenizer
        self.eos = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}

    def reply(self, messages: list[dict]) -> tuple[list[int], list[float]]:
        """The greedy tokens of a full prefill of `messages`, and at each step the gap
        between its two best logits (the last step's: the end of turn, or past the
        reply's length)."""
        from promptstore.serve.vision import chat_parts

        prompt = self.model.prompt(chat_parts(messages))
        cache = self.model.make_cache()
        logits = self.model.forward(prompt, cache, 0, self.model.embed(prompt, 0))[:, -1]
        decoder, out, gaps = self.model.decoder(prompt), [], []
        for _ in range(self.n + 1):
            best = mx.sort(logits.astype(mx.float32), axis=-1)[0, -2:].tolist()
            gaps.append(best[1] - best[0])
            token = int(mx.argmax(logits, axis=-1).item())
            if token in self.eos or len(out) == self.n:
                break
            out.append(token)
            logits = decoder(mx.array([[token]]), cache=cache)[:, -1]
        del cache, logits
        mx.clear_cache()
        return out, gaps

    def verdict(self, reply: str, tokens: list[int], gaps: list[float], tie: float) -> dict:
        """How a server's `reply` compares with the reference's `tokens`: "equal"; "near tie"
        where it leaves them at a step whose two best logits were within `tie` (a tie the
        dtype's rounding can break either way, after which the two go their own ways); else
        "wrong". Text is compared without a leading space, which mlx_lm.server's detokenizer
        drops (mlx-vlm's keeps it)."""
        decode = self.model.tokenizer.decode
        got = reply.lstrip()
        if got == decode(tokens).lstrip():
            return {"verdict": "equal", "expected": decode(tokens)}
        agree = 0  # the reference's tokens the reply begins with
        while agree < len(tokens) and got.startswith(decode(tokens[: agree + 1]).lstrip()):
            agree += 1
        gap = gaps[agree]
        return {
            "verdict": "near tie" if gap <= tie else "wrong",
            "expected": decode(tokens),
            "departs_at": agree,
            "gap_there": gap,
        }


def build(
    name: str, folder: Path, work: Path, answer_tokens: int, env: dict, peers_python: str, peers_pythonpath: str
) -> Server:
    common = ["--max-tokens", str(answer_tokens)]
    if name == PROMPTSTORE:
        cmd = [sys.executable, "-m", "promptstore", "serve", "--model", str(folder), "--store", str(work / "store")]
        return Server(name, [*cmd, *common], env, work / "promptstore.log")
    if name == MLX_VLM:
        # Its automatic prefix cache (APC) and the APC's disk tier, in this run's folder.
        apc = dict(env, APC_ENABLED="1", APC_DISK_ENABLED="1", APC_DISK_PATH=str(work / "apc"))
        cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", str(folder), *common]
        return Server(name, cmd, apc, work / "mlx_vlm.log", model=str(folder))
    if name == VLLM_MLX:
        home = work / "vllm-home"
        home.mkdir(exist_ok=True)
        vllm_env = {k: v for k, v in env.items() if k != "PYTHONPATH"} | {"HOME": str(home)}
        if peers_pythonpath:  # its own packages ahead (on the GPU machine: vllm-mlx's mlx-lm 0.31)
            vllm_env["PYTHONPATH"] = peers_pythonpath
        cmd = [peers_python, "-m", "vllm_mlx.cli", "serve", str(folder), "--mllm", "--continuous-batching"]
        cmd += ["--ssd-cache-dir", str(work / "ssd")]  # its prefix cache's disk tier
        return Server(name, cmd, vllm_env, work / "vllm.log", model=str(folder))
    raise ValueError(name)


def run_server(name: str, s: dict) -> dict:
    """One server through the workload: each round's requests, timed and checked."""
    work = Path(tempfile.mkdtemp(prefix=f"{name.split()[0]}-", dir=s["work"]))
    server = build(name, s["folder"], work, s["answer_tokens"], s["env"], s["peers_python"], s["peers_pythonpath"])
    rounds: dict[str, list[dict]] = {r: [] for r in ROUNDS}
    histories: dict[int, list[dict]] = {}
    try:
        server.start()
    except RuntimeError as e:  # the folder goes with the run: what its log said, kept
        raise RuntimeError(f"{e}; its log ends: {server.log_tail(12)}") from None
    try:
        client = server.client()

        def turn(user: int, label: str, question: str, images: list[str]) -> None:
            messages = histories.get(user, [{"role": "system", "content": s["system"]}])
            messages = [*messages, user_turn(question, images)]
            got = ask(server, messages, s["answer_tokens"], client)
            tokens, gaps = s["reference"].reply(messages)
            got |= {"user": user} | s["reference"].verdict(got["reply"], tokens, gaps, s["tie"])
            got["equal_full_prefill"] = got["verdict"] == "equal"
            rounds[label].append(got)
            histories[user] = [*messages, {"role": "assistant", "content": got["reply"]}]

        size, k = s["image"], s["images_per_turn"]
        turn(0, "first image", "Describe this picture for the catalogue.", [picture(100, size)])
        for u in range(1, s["users"]):
            turn(u, "new image", "Describe this picture for the catalogue.", [picture(100 + u, size)])
        for u in range(s["users"]):
            turn(u, "next turn", "And how does this one compare?", [picture(200 + 10 * u + j, size) for j in range(k)])
        write_back()
        server.stop()
        server.start()
        client = server.client()
        for u in range(s["users"]):
            turn(u, "after restart", "Which of them is brighter?", [picture(300 + 10 * u + j, size) for j in range(k)])
    finally:
        server.kill()
        if s.get("keep_logs"):  # the server's own log (its phases), kept where asked
            for log in work.glob("*.log"):
                Path(s["keep_logs"]).mkdir(parents=True, exist_ok=True)
                shutil.copy(log, Path(s["keep_logs"]) / f"{work.name}-{log.name}")
    shutil.rmtree(work, ignore_errors=True)
    return rounds


def summary(runs: list[dict[str, list[dict]]]) -> dict:
    out = {}
    for label in ROUNDS:
        p50s = [statistics.median(r["ttft_s"] for r in run[label]) for run in runs if run[label]]
        rows = [r for run in runs for r in run[label]]
        out[label] = {
            "ttft_p50_s": statistics.median(p50s) if p50s else None,
            "ttft_p50_s_per_run": p50s,
            "cached_tokens_median": statistics.median(r["cached_tokens"] or 0 for r in rows) if rows else None,
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] or 0 for r in rows) if rows else None,
        }
    rows = [r for run in runs for label in ROUNDS for r in run[label]]
    out["replies_equal_full_prefill"] = f"{sum(r['equal_full_prefill'] for r in rows)}/{len(rows)}"
    out["replies_near_tie"] = sum(r.get("verdict") == "near tie" for r in rows)
    out["replies_wrong"] = sum(r.get("verdict") == "wrong" for r in rows)
    unjudged = sum("verdict" not in r and not r["equal_full_prefill"] for r in rows)
    if unjudged:  # results of a bench before near ties were told apart: differing, not judged
        out["replies_differing_unjudged"] = unjudged
    return out


def goals(results: dict) -> list[dict]:
    ours = results.get(PROMPTSTORE, {})
    out = []
    for label, limit in GOALS.items():
        peers = [
            results[p][label]["ttft_p50_s"] for p in results if p != PROMPTSTORE and results[p][label]["ttft_p50_s"]
        ]
        mine = ours.get(label, {}).get("ttft_p50_s")
        value = mine / min(peers) if mine and peers else None
        out.append(
            {
                "goal": f"{label}: vs the faster peer",
                "value": value,
                "limit": limit,
                "met": None if value is None else value <= limit,
            }
        )
    if "replies_wrong" in ours:
        out.append(
            {"goal": "wrong replies", "value": ours["replies_wrong"], "limit": 0, "met": not ours["replies_wrong"]}
        )
    return out


def merge(paths: list[str], out: str | None) -> int:
    """One result of several (the same profile and workload, other servers)."""
    docs = [json.loads(Path(path).read_text()) for path in paths]
    first = docs[0]
    if any(d["profile"] != first["profile"] or d["workload"] != first["workload"] for d in docs):
        print("bench_vision.py: error: the results to merge differ in profile or workload", file=sys.stderr)
        return 2
    per_server: dict[str, list] = {}
    for doc in docs:
        for name, runs in doc["per_request"].items():
            per_server.setdefault(name, []).extend(runs)
    results = {name: summary(runs) for name, runs in per_server.items() if runs}
    rows = goals(results)
    print_goals([(g["goal"], g["value"], f"<= {g['limit']}") for g in rows])
    payload = {k: v for k, v in first.items() if k not in ("date", "machine", "blas")}
    payload |= {
        "results": results,
        "per_request": per_server,
        "goals": rows,
        "merged_from": [Path(p).name for p in paths],
    }
    payload["skipped"] = {k: v for d in docs for k, v in d.get("skipped", {}).items() if k not in results}
    payload["failed"] = {k: v for d in docs for k, v in d.get("failed", {}).items()}
    written = write_results(out or f"bench-results/vision-{first['profile']}.json", payload, first["blas"])
    print(f"wrote {written}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cuda" if mx.default_device() == mx.gpu else "cpu")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--images-per-turn", type=int, default=1)
    p.add_argument("--servers", default=f"{PROMPTSTORE},{MLX_VLM},{VLLM_MLX}")
    p.add_argument("--peers-python", default=str(REPO / ".peers/vllm-mlx/bin/python"), help="vllm-mlx's python")
    p.add_argument("--peers-pythonpath", default="", help="vllm-mlx's PYTHONPATH (default: none)")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="copy each server's log there after its run")
    p.add_argument(
        "--model-dir", default=None, help="the model folder: used as it is if written, else written there and kept"
    )
    p.add_argument("--out", default=None, help="the JSON to write (default: bench-results/vision-<profile>.json)")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="join results written apart (servers run in separate calls, each its own --out) into one, "
        "its figures and goals computed again over every server",
    )
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    blas = blas_info()
    if warning := blas_warning(blas):
        print(warning, file=sys.stderr)
    profile = PROFILES[args.profile]
    servers = [n.strip() for n in args.servers.split(",") if n.strip()]
    skipped = {}
    if VLLM_MLX in servers and not (Path(args.peers_python).exists() or shutil.which(args.peers_python)):
        skipped[VLLM_MLX] = f"not installed ({args.peers_python}; `make peers`)"
        servers.remove(VLLM_MLX)
    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    try:
        folder = profile_model(Path(args.model_dir) if args.model_dir else root / "model", profile)
        reference = Reference(folder, profile["answer_tokens"])
        setup = dict(
            folder=folder,
            work=root,
            env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=pythonpath),
            peers_python=args.peers_python,
            peers_pythonpath=args.peers_pythonpath,
            system=system_prompt(reference.model.tokenizer, profile["system_tokens"]),
            reference=reference,
            users=args.users,
            image=profile["image"],
            images_per_turn=args.images_per_turn,
            answer_tokens=profile["answer_tokens"],
            tie=profile["tie"],
            keep_logs=args.keep_logs,
        )
        print(f"{describe_device()}; profile {args.profile}; servers {', '.join(servers)}")
        per_server: dict[str, list] = {n: [] for n in servers}
        failed: dict[str, str] = {}
        workload = {
            "users": args.users,
            "images_per_turn": args.images_per_turn,
            "system_tokens": profile["system_tokens"],
            "image": list(profile["image"]),
            "answer_tokens": profile["answer_tokens"],
            "model": {"family": "qwen2_5_vl", "text": profile["text"], "vision": profile["vision"]},
            "dtype": profile["dtype"],
        }
        out = Path(args.out or f"bench-results/vision-{args.profile}.json")

        def write(final: bool) -> dict:
            """The results so far (after every server's run: a run cut short keeps what it did)."""
            results = {name: summary(runs) for name, runs in per_server.items() if runs}
            payload = {
                "profile": args.profile,
                "device": describe_device(),
                "workload": workload,
                "runs": args.runs,
                "complete": final,
                "results": results,
                "per_request": {n: runs for n, runs in per_server.items() if runs},
                "skipped": skipped,
                "failed": failed,
                "goals": goals(results),
            }
            write_results(out, payload, blas)
            return payload

        for run in range(args.runs):
            for name in servers[run % len(servers) :] + servers[: run % len(servers)]:  # who goes first rotates
                if name in failed:
                    continue
                started = time.perf_counter()
                try:
                    per_server[name].append(run_server(name, setup))
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    failed[name] = f"{type(e).__name__}: {e}"
                    print(f"  {name}: failed ({failed[name]})")
                    continue
                print(f"  run {run + 1}, {name}: {time.perf_counter() - started:.1f} s", flush=True)
                write(final=False)
        payload = write(final=True)
        results = payload["results"]
        print(f"\n  {'round':14}" + "".join(f"{n:>20}" for n in results))
        for label in ROUNDS:
            cells = [results[n][label]["ttft_p50_s"] for n in results]
            print(f"  {label:14}" + "".join(f"{c * 1e3:>17.1f} ms" if c else f"{'-':>20}" for c in cells))
        print("  replies equal:" + "".join(f"{results[n]['replies_equal_full_prefill']:>20}" for n in results))
        print("  near ties:    " + "".join(f"{results[n].get('replies_near_tie', '-'):>20}" for n in results))
        print("  wrong:        " + "".join(f"{results[n].get('replies_wrong', '-'):>20}" for n in results))
        print()
        print_goals([(g["goal"], g["value"], f"<= {g['limit']}") for g in payload["goals"]])
        print(f"\nwrote {out}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
