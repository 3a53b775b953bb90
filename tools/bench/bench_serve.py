"""promptstore serve against its peers, mlx_lm.server and vllm-mlx, on three workloads.

Every server runs the same model directory with the same memory budget for
cached prompts and its own best caching settings (mlx_lm.server: its LRU
prompt cache; vllm-mlx: continuous batching, its memory-aware prefix cache,
its SSD tier and, where a system prompt is known, its warm prompts;
promptstore serve: its store, and the same warm prompts). The servers answer the same requests in turn,
the one that goes first rotating, so each sees the same machine load.

- chat: LMCache's multi-round QA: users with a shared system prompt and a
  context of their own over several rounds; then every server killed by
  SIGKILL and started again on its same folders, the next round timed, one
  more round; then the same after a SIGTERM.
- chat-8, chat-16, chat-32: the chat workload with 8, 16 and 32 users, the
  budget grown with them (not in `all`: `--workload chat-users` runs the three).
- pressure: conversations whose state is several times the memory budget,
  visited round-robin (one request at a time), so a returning conversation
  finds its state evicted from memory; every reply compared with a full
  prefill's (mlx_lm.server with no prompt cache) at temperature 0.
- single: one conversation alone, hot, several rounds: what one agent sees.

The workloads are in serve_workloads.py, the servers in serve_peers.py, the
figures and goals in serve_goals.py, the tables in serve_docs.py.

--replies: the model's random weights write random tokens, which mostly
tokenize otherwise when the next turn's template renders the reply's text, so
a server prefills the whole reply again; with `round-trip` the model folder's
weights are reshaped (promptstore/testing/round_trip.py) so that its greedy
replies render back to exactly the tokens generated, as a real model's mostly
do. Every reply is checked against the template either way (each round's
`replies_round_trip`).

Each workload runs --runs times on fresh servers and folders; a round's
figure is the median over runs of its TTFT p50 over users. Before servers
start, the machine's dirty pages are written back (os.sync): with
--one-at-a-time, one server's writes (vllm-mlx's SSD tier wrote ~40 GB in the
cuda profile's memory-pressure run) are not still going to disk while the
next server is timed; the pages pending and the seconds taken are kept in each
run's `settled`. Prints the tables
and the goals; writes bench-results/serve-<profile>.json and renders its
section of docs/benchmarks.md (tools/bench/serve_docs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
from common import (
    OPENBLAS_HINT,
    blas_info,
    blas_warning,
    describe_device,
    drop_page_cache,
    write_back,
    write_results,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks_doc import write_docs  # noqa: E402
from serve_docs import print_report  # noqa: E402
from serve_goals import goals, restart_figures, summarize  # noqa: E402
from serve_peers import (  # noqa: E402
    MLX_LM,
    PROMPTSTORE,
    VLLM_MLX,
    Server,
    Setup,
    ask,
    build,
    promptstore_log,
    reference_server,
    vllm_log,
    vllm_missing,
)
from serve_workloads import (  # noqa: E402
    CHAT_USERS,
    QUESTIONS,
    VOCAB,
    Run,
    chat,
    fire,
    kind,
    pressure,
    round_trips,
    single,
    text_of,
    warm_prompts,
)

from promptstore.testing.model_dir import REPLIES, replies_of, write_model_dir  # noqa: E402
from promptstore.testing.models import DEMO_LLAMA  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PROFILES = {
    # The demo's model in float32 on 2 CPU cores: prefill dominates at these lengths.
    "cpu": dict(
        model=dict(DEMO_LLAMA),
        dtype="float32",
        chat=dict(users=4, rounds=3, system_tokens=768, context_tokens=256, answer_tokens=24, budget=256 * MiB),
        pressure=dict(conversations=16, context_tokens=1024, passes=3, answer_tokens=16, budget=16 * MiB),
        single=dict(system_tokens=1024, context_tokens=1024, rounds=6, answer_tokens=24, budget=256 * MiB),
        note="the demo's llama (4 layers, hidden 256) in float32 on CPU, OpenBLAS preloaded when installed",
    ),
    # LMCache's multi-round QA in Llama-3.1-8B's shape (random weights; the demo
    # tokenizer's small vocabulary, so the LM head is smaller than the real one's).
    "cuda": dict(
        model=dict(
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
        dtype="bfloat16",
        chat=dict(users=4, rounds=4, system_tokens=1900, context_tokens=2900, answer_tokens=48, budget=4 * GiB),
        # Replies are compared with a full prefill's in float32 only: in bfloat16 a
        # prefill in other chunks may round otherwise and pick another token.
        pressure=dict(
            conversations=16, context_tokens=4096, passes=3, answer_tokens=32, budget=2 * GiB, check_replies=False
        ),
        single=dict(system_tokens=2048, context_tokens=6144, rounds=6, answer_tokens=48, budget=4 * GiB),
        note="Llama-3.1-8B's shape (32 layers, hidden 4096, 8 KV heads of 128) with random bfloat16 weights "
        "and the demo tokenizer's 1,024-token vocabulary",
    ),
}
# A smoke test of the bench itself, well under its goals' sizes: a minute or two.
PROFILES["quick"] = dict(
    PROFILES["cpu"],
    chat=dict(users=2, rounds=2, system_tokens=256, context_tokens=64, answer_tokens=8, budget=64 * MiB),
    pressure=dict(conversations=4, context_tokens=256, passes=2, answer_tokens=8, budget=1 * MiB),
    single=dict(system_tokens=256, context_tokens=256, rounds=3, answer_tokens=8, budget=64 * MiB),
)
# chat-8, chat-16, chat-32: each profile's chat with that many users, its budget grown
# with them (every user's conversation fits, as in chat: more users, not memory pressure).
for _profile in PROFILES.values():
    for _users in CHAT_USERS:
        _chat = _profile["chat"]
        _profile[f"chat-{_users}"] = dict(_chat, users=_users, budget=_chat["budget"] * _users // _chat["users"])
WORKLOADS = ("chat", *(f"chat-{n}" for n in CHAT_USERS), "pressure", "single")
# --workload all: chat-8, chat-16 and chat-32 take 14 times chat's users (about 30 min more
# on 2 CPU cores); --workload chat-users runs those three.
GROUPS = {"all": ("chat", "pressure", "single"), "chat-users": tuple(f"chat-{n}" for n in CHAT_USERS)}
SERVERS = (MLX_LM, VLLM_MLX, PROMPTSTORE)
SETTLE_S = 2.0  # before a stop: spills written through land, as they would on a server at rest


def kv_bytes_per_token(profile: dict) -> int:
    m = profile["model"]
    return 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * getattr(mx, profile["dtype"]).size


def run_workload(workload: str, w: dict, base: Setup, names: list[str], args, run_no: int, tokenizer) -> dict:
    """One run of `workload` on fresh servers and folders; its rows and diagnostics,
    each reply checked against the chat template (`tokenizer`, the model folder's)."""
    work = base.work / f"{workload}-{run_no}"
    work.mkdir(parents=True)
    setup = Setup(
        **{
            **base.__dict__,
            "work": work,
            "budget_bytes": w["budget"],
            "answer_tokens": w["answer_tokens"],
            "warm_prompts": warm_prompts(workload, w),
        }
    )
    k = run_no % len(names)  # who starts first rotates too
    if args.one_at_a_time:
        # Each server alone on the machine, in turn: the same requests, its own run.
        out = merged([run_servers(workload, w, setup, [name], args) for name in names[k:] + names[:k]])
    else:
        out = run_servers(workload, w, setup, names[k:] + names[:k], args)
    # A sharded run checks every reply: a rank restoring another state would still answer, wrongly.
    if (workload == "pressure" or args.group > 1) and w.get("check_replies", True):
        out["full_prefill"] = compare_with_full_prefill(out["rows"], setup)
    for r in out["rows"]:
        r["round_trip"] = round_trips(tokenizer, r.pop("messages"), r)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return out


def run_servers(workload: str, w: dict, setup: Setup, names: list[str], args) -> dict:
    """`workload` through the servers `names` (in this order at their first round), side by side."""
    if len(names) == 1:
        setup = Setup(**{**setup.__dict__, "work": setup.work / names[0].replace(" ", "-")})
        setup.work.mkdir(parents=True)
    servers = {name: build(name, setup) for name in names}
    settled = write_back()  # no earlier server's (or the model's) writes still going to disk while these run
    started = time.perf_counter()
    together = not args.drop_page_cache
    start_all(list(servers.values()), together)
    run = Run(servers)
    restarts: dict[str, dict] = {}

    def restart(how: str) -> None:
        time.sleep(SETTLE_S)
        run.settle()
        t0 = time.perf_counter()
        each(list(servers.values()), lambda server: server.stop() if how == "SIGTERM" else server.kill())
        dropped = drop_page_cache() if args.drop_page_cache else None
        # Each starts alone after the page cache was emptied; else all at once.
        took = start_all([servers[name] for name in run.order()], together, before=drop_page_cache if dropped else None)
        restarts[how] = {name: {"start_s": s} for name, s in took.items()}
        restarts[how] |= {"page_cache_dropped": dropped, "started_together": together}
        print(f"  {how}: every server stopped and started again in {time.perf_counter() - t0:.1f} s", flush=True)

    try:
        if kind(workload) == "chat":
            chat(run, w, restart)
        elif workload == "pressure":
            pressure(run, w)
        else:
            single(run, w)
        time.sleep(SETTLE_S)
        run.settle()
    finally:
        each([server for server in servers.values() if server.running()], lambda server: server.stop())
    out = {
        "wall_s": time.perf_counter() - started,
        "rounds": run.rounds,
        "rows": run.rows,
        "round_diagnostics": run.round_diagnostics,
        "restarts": restarts,
        "promptstore_log": promptstore_log(log_lines(servers[PROMPTSTORE])) if PROMPTSTORE in servers else None,
        "vllm_mlx_log": vllm_log(log_lines(servers[VLLM_MLX])) if VLLM_MLX in servers else None,
        "disk_bytes": {name: du(setup.work / d) for name, d in DISK.items() if name.split(" (")[0] in servers},
        "settled": {name: settled for name in names},
    }
    return out


def merged(parts: list[dict]) -> dict:
    """Runs of one workload by one server each, as one run of them all."""
    out = {
        "wall_s": sum(p["wall_s"] for p in parts),
        "rounds": parts[0]["rounds"],
        "rows": [r for p in parts for r in p["rows"]],
        "round_diagnostics": {},
        "restarts": {},
        "one_at_a_time": True,
        "disk_bytes": {},
        "settled": {},
    }
    for p in parts:
        out["settled"] |= p.get("settled", {})
        for label, by_server in p["round_diagnostics"].items():
            out["round_diagnostics"].setdefault(label, {}).update(by_server)
        for how, figures in p["restarts"].items():
            out["restarts"].setdefault(how, {}).update(figures)
        out["disk_bytes"] |= p["disk_bytes"]
        for key in ("promptstore_log", "vllm_mlx_log"):
            if p.get(key) is not None:
                out[key] = p[key]
    out.setdefault("promptstore_log", None)
    out.setdefault("vllm_mlx_log", None)
    return out


def each(servers: list[Server], do) -> None:
    """`do(server)` for every server at once (threads); the first error is raised."""
    errors: list[BaseException] = []

    def one(server: Server) -> None:
        try:
            do(server)
        except BaseException as e:  # noqa: BLE001 - raised again below, on this thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(server,)) for server in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def start_all(servers: list[Server], together: bool, before=None) -> dict[str, float]:
    """Start the servers (all at once when `together`, else in order, `before()`
    ahead of each); seconds each took to answer its first request. Starting is
    not timed against the goals: together, a run spends a third of the time on it
    (an 8B model's three servers took 20-32 s each to start, one after another)."""
    took: dict[str, float] = {}

    def start(server: Server) -> None:
        if before is not None:
            before()
        t = time.perf_counter()
        server.start()
        took[server.name] = time.perf_counter() - t

    if together:
        each(servers, start)
    else:
        for server in servers:
            start(server)
    return took


def log_lines(server: Server) -> list[str]:
    return server.log.read_text(errors="replace").splitlines() if server.log.exists() else []


DISK = {PROMPTSTORE: "store", VLLM_MLX: "vllm-ssd", f"{VLLM_MLX} (saved at SIGTERM)": "vllm-home"}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def compare_with_full_prefill(rows: list[dict], setup: Setup) -> dict:
    """Every pressure request again through its server's software with no prompt
    cache (mlx_lm.server's for promptstore serve); each reply against that one."""
    replies: dict[tuple[str, str], str] = {}
    for software in dict.fromkeys(VLLM_MLX if r["server"] == VLLM_MLX else MLX_LM for r in rows):
        ref = reference_server(software, setup).start()
        try:
            for r in rows:
                key = (software, json.dumps(r["messages"]))
                if (VLLM_MLX if r["server"] == VLLM_MLX else MLX_LM) == software and key not in replies:
                    replies[key] = ask(ref, r["messages"], setup.answer_tokens)["reply"]
        finally:
            ref.stop()
    out: dict[str, dict] = {}
    for r in rows:
        software = VLLM_MLX if r["server"] == VLLM_MLX else MLX_LM
        same = replies[(software, json.dumps(r["messages"]))] == r["reply"]
        r["equals_full_prefill"] = same
        s = out.setdefault(r["server"], {"equal": 0, "requests": 0, "differ": []})
        s["equal"] += same
        s["requests"] += 1
        if not same:
            s["differ"].append({"round": r["round"], "conversation": r["user"]})
    return out


# ---- main ------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument(
        "--workload",
        choices=[*WORKLOADS, *GROUPS],
        default="all",
        help="all: chat, pressure and single; chat-users: chat-8, chat-16 and chat-32 (default: all)",
    )
    p.add_argument("--runs", type=int, default=3, help="runs of each workload; figures are medians over runs")
    p.add_argument(
        "--replies",
        choices=REPLIES,
        default="random",
        help="random: the random-weight model's replies, random tokens that mostly tokenize otherwise when the "
        "next turn renders them; round-trip: weights whose greedy replies render back to the tokens generated, "
        "as a real model's mostly do (promptstore/testing/round_trip.py) (default: random)",
    )
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {', '.join(SERVERS)}")
    p.add_argument(
        "--vllm-mlx-python",
        default=".peers/vllm-mlx/bin/python",
        help="the python that runs vllm-mlx (`make peers` installs it there); on a machine where vllm-mlx "
        "sits on a path of its own, `python3` with --vllm-mlx-pythonpath",
    )
    p.add_argument("--vllm-mlx-pythonpath", default="", help="PYTHONPATH for vllm-mlx alone (empty: none)")
    p.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="empty the machine's page cache between the stop and each server's restart (root)",
    )
    p.add_argument(
        "--warm-up-process",
        action=argparse.BooleanOptionalAction,
        help="first run rounds of other text through a throwaway promptstore serve, so MLX's kernels are "
        "compiled before any server is timed (default: on for --profile cuda)",
    )
    p.add_argument("--serve-args", default="", help="extra options for promptstore serve (one string)")
    p.add_argument("--keep-work", action="store_true", help="keep the model, stores and logs (removed by default)")
    p.add_argument("--out", help="JSON path (default bench-results/serve-<profile>.json)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="add this call's runs to those already in the result file (same profile): a run split over "
        "several calls, one workload each, say",
    )
    p.add_argument(
        "--model-dir", help="write the model here, or read it when it is there already (default: the work folder)"
    )
    p.add_argument("--skip-generated", action="store_true", help=argparse.SUPPRESS)  # earlier runs' commands
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each server runs the workload alone on the machine, in turn (where the servers' memory together "
        "outgrows it: three 8B servers on an 80 GB card), instead of side by side, round by round",
    )
    p.add_argument(
        "--mlx-cache-limit-gb",
        type=float,
        default=None,
        help="cap every server's MLX buffer cache (mx.set_cache_limit, through a sitecustomize on its path): "
        "three 8B servers each keeping freed buffers outgrow an 80 GB card",
    )
    p.add_argument(
        "--group",
        type=int,
        default=1,
        help="run mlx_lm.server and promptstore serve sharded over this many ranks (mlx.launch, tensor "
        "parallel; vllm-mlx has no sharded mode); each server's ranks are one server (default: 1)",
    )
    p.add_argument("--group-backend", default="ring", help="mlx.launch's backend with --group (ring, nccl, ...)")
    p.add_argument("--note", default="", help="a sentence on this run kept in the result (the machine, say)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = p.parse_args()
    if args.warm_up_process is None:
        args.warm_up_process = args.profile == "cuda"
    out_path = args.out or f"bench-results/serve-{args.profile}.json"
    blas = blas_info()
    if args.profile == "cpu" and (warning := blas_warning(blas)):
        print(warning, file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        code = run_bench(args, work, out_path, blas)
    except BaseException:
        print(f"work folder kept (the servers' logs): {work}", file=sys.stderr)
        raise
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)  # the cuda profile's model alone is 16 GB
    return code


def run_bench(args, work: Path, out_path: str, blas: dict) -> int:
    profile = PROFILES[args.profile]
    started = time.perf_counter()
    model = Path(args.model_dir) if args.model_dir else work / "model"
    if (model / "config.json").exists():
        if replies_of(model) != args.replies:
            raise SystemExit(f"{model} was written for {replies_of(model)} replies, not --replies {args.replies}")
        print(f"model read from {model}: {profile['note']}; {args.replies} replies", flush=True)
    else:
        dtype = getattr(mx, profile["dtype"])
        write_model_dir(model, "llama", vocab_size=VOCAB, dtype=dtype, replies=args.replies, **profile["model"])
        mx.clear_cache()
        took = time.perf_counter() - started
        print(f"model written in {took:.1f} s: {profile['note']}; {args.replies} replies", flush=True)
    tokenizer = folder_tokenizer(model)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    vllm_pythonpath = args.vllm_mlx_pythonpath
    if args.mlx_cache_limit_gb is not None:
        capped = mlx_cache_cap(work, int(args.mlx_cache_limit_gb * GiB))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [capped, env.get("PYTHONPATH", "")]))
        vllm_pythonpath = os.pathsep.join(filter(None, [capped, vllm_pythonpath]))
    if args.profile == "cpu" and Path(OPENBLAS_HINT).exists():
        env["LD_PRELOAD"] = OPENBLAS_HINT  # every server: a fair float32 prefill
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    vllm_python = args.vllm_mlx_python  # a path (made absolute: vllm-mlx runs in its own folder) or a command
    vllm_python = os.path.abspath(vllm_python) if os.sep in vllm_python else vllm_python
    skipped = {}
    if VLLM_MLX in names and args.group > 1:
        print("vllm-mlx skipped: it has no sharded mode", flush=True)
        skipped[VLLM_MLX] = "no sharded mode (--group)"
        names.remove(VLLM_MLX)
    if VLLM_MLX in names and (why := vllm_missing(vllm_python, vllm_pythonpath)):
        print(f"vllm-mlx skipped: {why}", flush=True)
        skipped[VLLM_MLX] = why
        names.remove(VLLM_MLX)
    names = [n for n in SERVERS if n in names]
    base = Setup(
        python=sys.executable,
        model=model,
        budget_bytes=0,
        answer_tokens=0,
        env=env,
        work=work,
        serve_args=args.serve_args.split(),
        vllm_python=vllm_python if VLLM_MLX in names else None,
        vllm_pythonpath=vllm_pythonpath,
        group=args.group,
        group_backend=args.group_backend,
    )
    if args.warm_up_process:
        warm_up_process(base, profile)
    before = earlier(out_path, args) if args.merge else {}
    details: dict[str, list] = dict(before.get("details", {}))
    for workload in GROUPS.get(args.workload, [args.workload]):
        done = details.get(workload, [])
        details[workload] = list(done)
        for n in range(len(done), len(done) + args.runs):
            print(f"{workload}, run {n + 1} ({args.runs} in this call):", flush=True)
            details[workload].append(run_workload(workload, profile[workload], base, names, args, n, tokenizer))
    results: dict[str, dict] = {}
    for workload in [w for w in WORKLOADS if w in details]:
        ran = [n for n in SERVERS if any(r["server"] == n for r in details[workload][0]["rows"])]
        for name, rounds in summarize(workload, details[workload], ran).items():
            results.setdefault(name, {})[workload] = rounds
    kv = kv_bytes_per_token(profile)
    payload = {
        "benchmark": "serve-peers",
        "profile": args.profile,
        "device": describe_device(),
        "commands": [*before.get("commands", []), command(args)],
        "note": profile["note"],
        "replies": args.replies,
        **(
            {"group": {"ranks": args.group, "backend": args.group_backend, "parallel": "tensor"}}
            if args.group > 1
            else {}
        ),
        "run_note": "; ".join(n for n in (before.get("run_note"), args.note) if n),
        "wall_s": before.get("wall_s", 0) + time.perf_counter() - started,
        "servers": sorted(results, key=SERVERS.index),
        "skipped": before.get("skipped", {}) | skipped,
        "versions": versions(names, base),
        "workloads": {
            k: dict(profile[k], kv_bytes_per_token=kv, runs=len(v), wall_s=sum(d["wall_s"] for d in v))
            for k, v in details.items()
        },
        "server_ld_preload": Path(env.get("LD_PRELOAD", "")).name,
        "results": results,
        "goals": goals(results),
        "after_sigterm": restart_figures(results),
        "details": details,
    }
    # Log lines name the run's temporary folder: keep the result free of this machine's paths.
    payload = json.loads(json.dumps(payload).replace(str(work), "<work>"))
    out = write_results(out_path, payload, blas)
    print_report(json.loads(out.read_text()))
    print(f"wrote {out}")
    if not args.no_docs and not args.out:
        write_docs()
    return 0


def folder_tokenizer(model: Path):
    """The model folder's tokenizer, with its chat template: what the servers load."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def mlx_cache_cap(work: Path, limit: int) -> str:
    """A folder whose sitecustomize caps MLX's buffer cache at `limit` bytes in
    every Python started with it on its path (each server, alike)."""
    folder = work / "mlx-cache-cap"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        f"try:\n    import mlx.core as mx\n\n    mx.set_cache_limit({limit})\nexcept ImportError:\n    pass\n"
    )
    return str(folder)


def earlier(out_path: str, args) -> dict:
    """The result file's runs to add to (--merge): the same benchmark and profile, else none."""
    path = Path(out_path) if Path(out_path).is_absolute() else Path(__file__).resolve().parents[2] / out_path
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    if doc.get("benchmark") != "serve-peers" or doc.get("profile") != args.profile:
        print(f"--merge: {path} holds another benchmark or profile; not merged", flush=True)
        return {}
    if doc.get("replies", "random") != args.replies:
        print(f"--merge: {path} holds runs with {doc.get('replies', 'random')} replies; not merged", flush=True)
        return {}
    return doc


def command(args) -> str:
    flags = [f"--profile {args.profile}", f"--workload {args.workload}", f"--runs {args.runs}"]
    flags += [f"--replies {args.replies}"] if args.replies != "random" else []
    flags += ["--drop-page-cache"] if args.drop_page_cache else []
    flags += ["--one-at-a-time"] if args.one_at_a_time else []
    flags += [f"--mlx-cache-limit-gb {args.mlx_cache_limit_gb:g}"] if args.mlx_cache_limit_gb is not None else []
    flags += [f"--serve-args '{args.serve_args}'"] if args.serve_args else []
    flags += [f"--servers '{args.servers}'"] if args.servers != ",".join(SERVERS) else []
    flags += [f"--group {args.group} --group-backend {args.group_backend}"] if args.group > 1 else []
    return "python tools/bench/bench_serve.py " + " ".join(flags)


def versions(names: list[str], base: Setup) -> dict:
    import importlib.metadata as md

    out = {"mlx": mx.__version__, "mlx-lm": md.version("mlx-lm")}
    if VLLM_MLX in names:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"PYTHONPATH": base.vllm_pythonpath} if base.vllm_pythonpath else {}
        code = "import importlib.metadata as m; print(m.version('vllm-mlx'), m.version('mlx-lm'), m.version('mlx'))"
        import subprocess

        got = subprocess.run([base.vllm_python, "-c", code], capture_output=True, text=True, env=env).stdout.split()
        if len(got) == 3:
            out["vllm-mlx"] = {"vllm-mlx": got[0], "mlx-lm": got[1], "mlx": got[2]}
    return out


def warm_up_process(base: Setup, profile: dict) -> None:
    """Two rounds of other text through a throwaway promptstore serve, a restart,
    one more: MLX compiles its kernels once per machine (into its on-disk
    cache), not per server, and a restarted server meets kernels the rounds
    before it do not."""
    started = time.perf_counter()
    w = profile["chat"]
    work = base.work / "warm-up"
    work.mkdir()
    setup = Setup(**{**base.__dict__, "work": work, "budget_bytes": w["budget"], "answer_tokens": w["answer_tokens"]})
    server = build(PROMPTSTORE, setup).start()
    other = text_of(w["system_tokens"], 5)
    convs = [
        [{"role": "system", "content": other + "\n\n" + text_of(w["context_tokens"], 7 * (u + 3))}]
        for u in range(w["users"])
    ]
    for turn in range(3):
        if turn == 2:
            server.stop()
            server.start()
        q = {"role": "user", "content": QUESTIONS[turn]}
        answers = fire(server, [(u, c + [q]) for u, c in enumerate(convs)], w["answer_tokens"])
        convs = [c + [q, {"role": "assistant", "content": answers[u]["reply"]}] for u, c in enumerate(convs)]
    server.stop()
    shutil.rmtree(work, ignore_errors=True)
    print(f"warm-up process: {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
