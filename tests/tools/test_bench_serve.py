"""tools/bench's serve bench without servers: promptstore serve's log read per
round, the chat-N workloads' goals, and their tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))

import bench_serve  # noqa: E402
import serve_docs  # noqa: E402
from serve_goals import goals, restart_figures  # noqa: E402
from serve_peers import MLX_LM, PROMPTSTORE, VLLM_MLX, promptstore_log  # noqa: E402
from serve_workloads import Run, reply_window, round_said  # noqa: E402

LOG = """\
12:00:01,100 INFO promptstore.serve.timeline: request (default): prompt 300 tokens, restored 200; check_ms=1.0 fetch_ms=2.0
12:00:01,300 INFO promptstore.serve.reply_inserts: reply forwards: n=2 replies=3 tokens=40 ms=12.5
12:00:01,400 INFO promptstore.serve.reply_inserts: reply stored without a forward: tokens=310
12:00:01,500 INFO promptstore.serve.reply_inserts: reply forwards: n=1 replies=1 tokens=9 ms=3.0
12:00:01,600 INFO promptstore.serve.reply_inserts: reply stored without a forward: tokens=320
"""


class FakeServer:
    def __init__(self, name: str, log: Path):
        self.name, self.log = name, log


def test_reply_lines_are_read_and_summed():
    d = promptstore_log(LOG.splitlines())
    assert d["reply_forwards"] == [
        {"n": 2, "replies": 3, "tokens": 40, "ms": 12.5},
        {"n": 1, "replies": 1, "tokens": 9, "ms": 3.0},
    ]
    assert d["replies_without_forward"] == [310, 320]
    w = reply_window(FakeServer(PROMPTSTORE, Path("unused")), LOG.splitlines())
    assert w["reply_forwards"] == 3 and w["replies_by_forwards"] == 4 and w["replies_without_forward"] == 2
    assert w["reply_forward_tokens"] == 49 and w["reply_forward_ms"] == 15.5


def test_a_log_without_reply_lines_counts_zero():
    lines = LOG.splitlines()[:1]
    d = promptstore_log(lines)
    assert d["reply_forwards"] == [] and d["replies_without_forward"] == []
    w = reply_window(FakeServer(PROMPTSTORE, Path("unused")), lines)
    assert set(w.values()) == {0}
    assert reply_window(FakeServer(MLX_LM, Path("unused")), LOG.splitlines()) == {}


def test_a_round_counts_the_reply_lines_since_the_last_read(tmp_path):
    """A reply stored after its round was read counts to the next round, or to
    the last one when the server stops (Run.settle); none is counted twice."""
    log = tmp_path / "promptstore.log"
    lines = LOG.splitlines(keepends=True)
    log.write_text(lines[0] + lines[1])
    run = Run({PROMPTSTORE: FakeServer(PROMPTSTORE, log)})
    run.rounds.append("round 1")
    first = run.window(PROMPTSTORE, 0)
    run.round_diagnostics["round 1"] = {PROMPTSTORE: first}
    assert first["reply_forwards"] == 2 and first["restored_share"] == pytest.approx(2 / 3)
    assert "; reply forwards 2 (3 replies), 0 stored without one" in round_said(first)
    with open(log, "a") as f:
        f.write(lines[2])  # logged between the rounds
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(lines[3])
    run.rounds.append("round 2")
    second = run.window(PROMPTSTORE, offset)
    run.round_diagnostics["round 2"] = {PROMPTSTORE: second}
    assert (second["reply_forwards"], second["replies_without_forward"]) == (1, 1)
    assert second["timelines"] == []  # the requests' lines are the round's own
    with open(log, "a") as f:
        f.write(lines[4])
    run.settle()
    assert second["replies_without_forward"] == 2


def results(workload: str, ours: dict[str, float], theirs: dict[str, float]) -> dict:
    return {
        PROMPTSTORE: {workload: {label: {"ttft_p50_s": s} for label, s in ours.items()}},
        MLX_LM: {workload: {label: {"ttft_p50_s": s} for label, s in theirs.items()}},
    }


@pytest.mark.parametrize(("workload", "limit"), [("chat", 1.0), ("chat-8", 1.0), ("chat-16", 0.9), ("chat-32", 0.9)])
def test_chat_goals_by_users(workload, limit):
    labels = ["round 1", "round 2, after SIGKILL", "round 3, after SIGTERM"]
    res = results(workload, dict(zip(labels, (0.9, 0.2, 0.1))), dict(zip(labels, (1.0, 1.0, 1.0))))
    got = {g["goal"]: g for g in goals(res)}
    assert got[f"{workload}, round 1: vs the faster peer"]["limit"] == limit
    assert got[f"{workload}, round 1: vs the faster peer"]["met"] == (0.9 <= limit)
    assert got[f"{workload}, round 2, after SIGKILL: vs {MLX_LM}"]["limit"] == 0.3
    assert got[f"{workload}, round 2, after SIGKILL: vs {VLLM_MLX}"]["met"] is None  # not run
    assert len(got) == 3
    figures = restart_figures(res)
    assert [f["what"] for f in figures] == [f"{workload}, round 3, after SIGTERM: vs {p}" for p in (MLX_LM, VLLM_MLX)]


def test_every_profile_has_the_chat_workloads():
    for profile in bench_serve.PROFILES.values():
        for users in (8, 16, 32):
            w = profile[f"chat-{users}"]
            assert w["users"] == users and w["rounds"] == profile["chat"]["rounds"]
    assert bench_serve.GROUPS["all"] == ("chat", "pressure", "single")


def test_the_tables_keep_chat_and_chat_8_apart():
    ours = {"round 1": 0.5, "round 2, after SIGTERM": 0.1}
    res = results("chat", ours, {"round 1": 1.0, "round 2, after SIGTERM": 1.0})
    res[PROMPTSTORE] |= results("chat-8", ours, {"round 1": 2.0, "round 2, after SIGTERM": 2.0})[PROMPTSTORE]
    res[MLX_LM] |= {"chat-8": {"round 1": {"ttft_p50_s": 2.0}, "round 2, after SIGTERM": {"ttft_p50_s": 2.0}}}
    w = dict(users=8, rounds=1, system_tokens=10, context_tokens=10, answer_tokens=4, budget=1 << 20)
    doc = {
        "results": res,
        "goals": goals(res),
        "after_sigterm": restart_figures(res),
        "workloads": {"chat": dict(w, users=4, runs=1, wall_s=1.0), "chat-8": dict(w, runs=1, wall_s=1.0)},
        "commands": ["python tools/bench/bench_serve.py --workload chat-8"],
        "date": "2026-01-01T00:00:00",
        "device": "CPU",
        "note": "a note",
        "wall_s": 60.0,
        "replies": "round-trip",
    }
    assert [g for g, _, _ in serve_docs.goal_rows(doc, "chat")] == ["chat, round 1: vs the faster peer"]
    assert [g for g, _, _ in serve_docs.goal_rows(doc, "chat-8")] == ["chat-8, round 1: vs the faster peer"]
    text = serve_docs.section("serve-quick.json", "CPU", doc)
    assert "#### multi-round chat, a SIGKILL restart and a SIGTERM restart, 8 users" in text
    assert "8 users at once" in text and "replies that render back to the tokens generated" in text
    assert text.count("After the SIGTERM restart") == 2


def test_a_sharded_server_is_started_by_mlx_launch_running_a_script_of_its_own(tmp_path):
    from serve_peers import Setup, build, launched

    setup = Setup("python3", tmp_path / "model", 1 << 20, 8, {}, tmp_path, [], None, "", group=2)
    for name, module in ((MLX_LM, "mlx_lm"), (PROMPTSTORE, "promptstore")):
        server = build(name, setup)
        assert server.group == (2, "ring", tmp_path)
        cmd = launched(server.cmd, server.group, 40000)
        launcher, script = cmd[: cmd.index("--")], cmd[cmd.index("--") + 1 :]
        assert launcher[3:] == ["--backend", "ring", "-n", "2", "--starting-port", "40000", "--python", "python3"]
        assert script[0] == str(tmp_path / f"launch_{module}.py") and Path(script[0]).is_file()
        # mlx-lm's script is its server's main; promptstore's is the command, given `serve`.
        assert script[1] == ("serve" if name == PROMPTSTORE else "--model")
    alone = build(MLX_LM, Setup("python3", tmp_path / "model", 1 << 20, 8, {}, tmp_path, [], None, ""))
    assert alone.group is None and alone.cmd[:4] == ["python3", "-m", "mlx_lm", "server"]


def test_a_rounds_line_says_the_batch_steps_and_the_handoff_of_its_first_tokens():
    line = (
        "12:00:02,000 INFO promptstore.serve.timeline: request (default): prompt 300 tokens, restored 200; "
        "fetch_ms=2.0 prefill_first_ms=40.0 batch_ms=38.0 steps_ms=30.0 steps=3.0 out_ms=2.0"
    )
    rows = promptstore_log([line])["timelines"]
    said = round_said({"timelines": rows, "restored_share": 2 / 3, "from_disk_tokens": 0})
    assert ", prefill_first 40 ms, steps 30 ms (3 steps), out 2 ms" in said, said
