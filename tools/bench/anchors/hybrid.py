"""The hybrid models: where promptstore restores against where each prompt diverges."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .harness import Contender, Engine, pct, warm_up
from .models import build_model
from .runs import finish_workload, run_chat_like
from .workloads import ChatScript, Profile, content


def restore_points(outs: list[dict], step: int) -> dict:
    """Where promptstore restored against where each prompt diverges from what the
    store holds (`matched`, what a model of attention layers only restores)."""
    gaps = np.asarray([o["matched"] - o["restored"] for o in outs], dtype=float)
    prompt = sum(o["prompt_tokens"] for o in outs)
    edges = [0, 1, 65, 257, step + 1, float("inf")]
    names = ["0", "1-64", "65-256", f"257-{step}", f"> {step}"]
    hist = {n: int(((gaps >= lo) & (gaps < hi)).sum()) for n, lo, hi in zip(names, edges, edges[1:])}
    return {
        "requests": len(outs),
        "prefill_step": step,
        "at_divergence": int((gaps == 0).sum()),
        "within_step": int((gaps <= step).sum()),
        "gap_p50": pct(gaps, 50),
        "gap_p95": pct(gaps, 95),
        "gap_max": float(gaps.max()) if len(gaps) else None,
        "histogram": hist,
        "attention_only_cut": 1 - sum(o["prompt_tokens"] - o["matched"] for o in outs) / prompt if prompt else None,
    }


def probe_divergences(contenders: list[Contender], script: ChatScript, profile: Profile, n: int = 64) -> dict:
    """Prompts that leave a stored one at a random position (nothing is prefilled or
    stored): where promptstore hot restores them, against where they diverge."""
    store = next(c for c in contenders if c.name == "promptstore hot")
    rng = np.random.default_rng(11)
    outs = []
    for _ in range(n):
        c = int(rng.integers(script.conversations))
        prompt = script.prompt(c, script.turns - 1, script.replies)
        at = int(rng.integers(1, len(prompt) - 1))
        tokens = prompt[:at] + content(rng, 8, profile.vocab)
        hit = store.space.fetch(tokens)
        outs.append({"matched": hit.matched, "restored": hit.length, "prompt_tokens": len(tokens)})
    return restore_points(outs, profile.prefill_step)


FAMILIES = ("gemma3_text", "qwen3_next")


def run_hybrid(profile: Profile, family: str, tmp: Path) -> dict:
    """The chat workload on a hybrid model of `family`: its summary, with where
    promptstore restored (the chat's requests and random divergence probes)."""
    hmodel, hid, hdesc = build_model(profile, family)
    hengine = Engine(hmodel, profile)
    warm_up(hengine)
    # Seeded as the chat workload: the same prompts, when the sizes are the same.
    script = ChatScript(
        profile,
        profile.vocab,
        profile.hybrid_conversations,
        profile.hybrid_turns,
        name=f"hybrid-{family}",
        seed=1,
    )
    root = tmp / family
    contenders, results, reference, t0 = run_chat_like(script, hengine, hid, hdesc, root, profile, keep_open=True)
    probes = probe_divergences(contenders, script, profile)
    s = finish_workload(script.name, hdesc, contenders, results, reference, root, profile, t0)
    s["divergence_probes"] = probes
    s["same_prompts_as_chat"] = (profile.hybrid_conversations, profile.hybrid_turns) == (
        profile.conversations,
        profile.turns,
    )
    s["restore_points"] = restore_points(s["outcomes"]["promptstore hot"], profile.prefill_step)
    grid = profile.checkpoint_interval or profile.prefill_step
    s["requests_note"] = (
        f"{profile.hybrid_conversations} conversations x {profile.hybrid_turns} turns over the same "
        f"system prompts{' as the chat workload' if s['same_prompts_as_chat'] else ''}; promptstore "
        f"checkpoints every {grid} tokens{' (its prefill step)' if grid == profile.prefill_step else ''}"
    )
    return s
