"""Running a workload: every contender on the same requests (the chat, the fork)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from .ceilings import ceilings_for
from .files import Files
from .harness import Contender, Engine, NoCache, run_script
from .lru import LRU
from .store import Store
from .summary import summarize_workload
from .workloads import ForkScript, Profile, Script


def contenders_for(engine: Engine, model_id: str, root: Path, profile: Profile) -> list[Contender]:
    control = []
    if profile.control_step:
        # Full prefill again, chunked differently: how often float rounding alone
        # flips a greedy reply (it changes nothing a cache does).
        other = NoCache(Engine(engine.model, replace(profile, prefill_step=profile.control_step)))
        other.name = f"no cache, prefill step {profile.control_step} (control)"
        control = [other]
    return [
        NoCache(engine),
        *control,
        LRU(engine),
        Files(engine, root / "files"),
        Store(engine, root / "store-hot", model_id, hot_bytes=profile.hot_bytes),
        Store(engine, root / "store-cold", model_id, cold_only=True),
    ]


def run_chat_like(
    script: Script, engine: Engine, model_id: str, desc: str, root: Path, profile: Profile, keep_open: bool = False
):
    started = time.perf_counter()
    contenders = contenders_for(engine, model_id, root, profile)
    results = run_script(script, contenders)
    reference = dict(script.replies)
    if keep_open:
        return contenders, results, reference, started
    return finish_workload(script.name, desc, contenders, results, reference, root, profile, started)


def finish_workload(name, desc, contenders, results, reference, root, profile, started, extra=None):
    for c in contenders:
        c.close()
    disks = {c.name: c.disk_bytes() for c in contenders}
    samples = ceilings_for(results, profile, root)
    return summarize_workload(name, desc, results, reference, samples, disks, time.perf_counter() - started, extra)


def run_fork(profile: Profile, engine: Engine, model_id: str, desc: str, root: Path) -> dict:
    """The agent fork workload's summary."""
    fork = ForkScript(profile, profile.vocab)
    summary = run_chat_like(fork, engine, model_id, desc, root, profile)
    summary["requests_note"] = (
        f"a root request on a {profile.fork_system}-token system prompt, {profile.fork_width} branches "
        f"off it and {profile.fork_retries} retries off each (depth first), then back to the root and to "
        f"the first branch: {len(fork.nodes)} requests"
    )
    return summary
