"""The restart: the chat resumed for one more turn in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from promptstore import PromptStore

from .ceilings import ceilings_for
from .files import Files
from .harness import Contender, Engine, NoCache, Outcome, Reference, log, serve_all, warm_up
from .lru import LRU
from .models import build_model
from .runs import finish_workload, run_chat_like
from .store import Store
from .summary import summarize_workload
from .workloads import ChatScript, Profile, Request

# The command line the fresh process runs (its hidden --phase restart).
ENTRY = Path(__file__).resolve().parents[1] / "bench_anchors.py"


def run_restart(
    profile: Profile, chat: ChatScript, contenders: list[Contender], root: Path, model_id: str, desc: str
) -> dict:
    """Resume the chat for one more turn in a fresh process, on what the stores
    left on disk. Before closing, probe what an uninterrupted process would
    restore for those requests; the fresh process probes again first."""
    started = time.perf_counter()
    resumed = ChatScript(profile, profile.vocab, profile.conversations, 1, name="restart", first_turn=profile.turns)
    resumed.systems, resumed.users = chat.systems, chat.users
    requests = [build(chat.replies) for build in resumed.steps()]
    by_name = {c.name: c for c in contenders}
    before = {
        name: sum(by_name[name].probe(r) for r in requests)
        for name in ("mlx-lm LRUPromptCache", "mlx-lm cache files", "promptstore hot")
    }
    files, hot = by_name["mlx-lm cache files"], by_name["promptstore hot"]
    state = {
        "profile": profile.name,
        "model_id": model_id,
        "requests": [asdict(r) for r in requests],
        "files_dir": str(files.root),
        "files_held": files.held,
        "store_dir": str(hot.root),
        "store_settings": hot.settings,
    }
    state_path = root / "restart-state.json"
    state_path.write_text(json.dumps(state))
    result_path = root / "restart-result.json"
    return state_path, result_path, before, started, requests


def restart_phase(state_path: Path, result_path: Path, profile: Profile) -> None:
    """The fresh process: probe what survived, then serve the resumed turn."""
    state = json.loads(state_path.read_text())
    model, model_id, _ = build_model(profile)
    assert model_id == state["model_id"]
    engine = Engine(model, profile)
    warm_up(engine)
    requests = [Request(**r) for r in state["requests"]]
    files = Files(engine, Path(state["files_dir"]), held=state["files_held"])
    # Probe the store from a hot-less instance, so the run below starts cold.
    probe = PromptStore.open(state["store_dir"], **dict(state["store_settings"], hot_bytes=0))
    probe_space = probe.bind(model, model_id=model_id)
    after = {
        "mlx-lm LRUPromptCache": sum(LRU(engine).probe(r) for r in requests),
        "mlx-lm cache files": sum(files.probe(r) for r in requests),
        "promptstore hot": sum(probe_space.fetch(r.prompt).length for r in requests),
    }
    probe.close()
    store = Store(engine, Path(state["store_dir"]), model_id, hot_bytes=state["store_settings"]["hot_bytes"])
    store.name = "promptstore (restarted)"
    lru = LRU(engine)
    lru.name = "mlx-lm LRUPromptCache (restarted: empty)"
    contenders = [NoCache(engine), lru, files, store]
    results, reference = {}, Reference()
    for i, c in enumerate(contenders):
        results[c.name] = serve_all(c, requests, reference, i == 0, "restart (fresh process)")
    store.close()
    result_path.write_text(
        json.dumps(
            {
                "after": after,
                "results": {n: [asdict(o) for o in outs] for n, outs in results.items()},
                "disks": {c.name: c.disk_bytes() for c in contenders},
            }
        )
    )


def finish_restart(state_path, result_path, before, started, profile, root, desc) -> dict:
    cmd = [
        sys.executable,
        str(ENTRY),
        "--profile",
        profile.name,
        "--phase",
        "restart",
        "--state",
        str(state_path),
        "--result",
        str(result_path),
    ]
    log("  restart: starting a fresh process")
    subprocess.run(cmd, check=True)
    got = json.loads(result_path.read_text())
    results = {n: [Outcome(**o) for o in outs] for n, outs in got["results"].items()}
    reference = {o.name: o.reply for o in results["no cache"]}
    names = {
        "mlx-lm LRUPromptCache": "mlx-lm LRUPromptCache (restarted: empty)",
        "mlx-lm cache files": "mlx-lm cache files",
        "promptstore hot": "promptstore (restarted)",
    }
    survived = {
        names[k]: {
            "restorable_before": before[k],
            "restorable_after": got["after"][k],
            "kept": got["after"][k] / before[k] if before[k] else None,
        }
        for k in before
    }
    samples = ceilings_for(results, profile, root)
    summary = summarize_workload(
        "restart",
        desc,
        results,
        reference,
        samples,
        got["disks"],
        time.perf_counter() - started,
        {"survived": survived},
    )
    for row in summary["rows"]:
        if row["contender"] in survived:
            row["kept_after_restart"] = survived[row["contender"]]["kept"]
    return summary


def run_chat_and_restart(profile: Profile, engine: Engine, model_id: str, desc: str, tmp: Path, workloads: dict, save):
    """The chat workload and, where the profile asks, the restart that resumes it
    (on what the chat's stores left); each summary goes into `workloads`, saved
    after each."""
    log("chat")
    chat = ChatScript(profile, profile.vocab, profile.conversations, profile.turns)
    root = tmp / "chat"
    contenders, results, reference, t0 = run_chat_like(chat, engine, model_id, desc, root, profile, keep_open=True)
    restart = None
    if "restart" in profile.workloads:
        restart = run_restart(profile, chat, contenders, tmp / "chat", model_id, desc)
    workloads["chat"] = finish_workload("chat", desc, contenders, results, reference, root, profile, t0)
    workloads["chat"]["requests_note"] = (
        f"{profile.conversations} conversations x {profile.turns} turns over {len(profile.system_tokens)} "
        f"system prompts of {', '.join(map(str, profile.system_tokens))} tokens, user messages of "
        f"{profile.user_tokens} tokens, replies of {profile.reply_tokens}"
    )
    save(partial=True)
    if restart is not None:
        log("restart")
        workloads["restart"] = finish_restart(*restart[:4], profile, tmp / "chat", desc)
        workloads["restart"]["requests_note"] = (
            f"turn {profile.turns + 1} of each of the {profile.conversations} conversations, in a new "
            "process after every store was closed; 'kept': tokens restorable for these requests right "
            "after the restart over those restorable just before it"
        )
    if "chat" not in profile.workloads:
        workloads.pop("chat")
    save(partial=True)
