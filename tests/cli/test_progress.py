"""Progress of long work goes to stderr, never into what a command prints on
stdout; library code reports through callbacks and logging, never prints."""

from __future__ import annotations

import json

import mlx.core as mx

from promptstore import PromptStore, console, generation
from promptstore.testing.tokenizer import demo_tokenizer


def test_generate_json_is_clean_while_progress_draws_on_a_terminal(cli, tmp_path, model_dir):
    """TTY_COMPATIBLE=1 makes rich treat stderr as a terminal: the live bars draw there."""
    system = tmp_path / "system.txt"
    system.write_text("You are the shop's assistant. " * 60)
    args = ["generate", "--model", str(model_dir), "--system-file", str(system), "--prompt", "Hi", "-m", "4", "--json"]
    first = cli(*args, "--store", str(tmp_path / "s"), TTY_COMPATIBLE="1")
    assert first.returncode == 0, first.stderr
    reply = json.loads(first.stdout)  # the whole of stdout is the JSON document
    assert reply["restored_tokens"] == 0 and reply["prefilled_tokens"] == reply["prompt_tokens"] > 300
    assert "processing the prompt" in first.stderr and "\x1b[" in first.stderr
    assert "\x1b[" not in first.stdout
    again = json.loads(cli(*args, "--store", str(tmp_path / "s")).stdout)
    assert again["restored_tokens"] == again["prompt_tokens"] - 1
    assert again["reply"] == reply["reply"]  # greedy: the restored prefix changes nothing


def test_compact_json_is_clean(cli, tmp_path):
    PromptStore.open(tmp_path / "s").close()
    proc = cli("compact", "--store", str(tmp_path / "s"), "--json", TTY_COMPATIBLE="1")
    assert proc.returncode in (0, 1), proc.stderr
    assert json.loads(proc.stdout)["status"] in ("clean", "repaired")


def test_off_a_terminal_progress_is_a_few_plain_lines(monkeypatch, capsys):
    monkeypatch.setattr(console, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr(console, "QUIET_UNDER_S", 0.0)
    progress = console.Progress()
    assert not progress.live  # pytest's stderr is no terminal
    with progress.task("processing the prompt", total=3000, unit="tokens") as task:
        task.update(1024)
        task.update(3000)
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert lines[:2] == ["processing the prompt: 1,024/3,000 tokens", "processing the prompt: 3,000/3,000 tokens"]
    assert lines[2].startswith("processing the prompt: 3,000/3,000 tokens in ")


def test_short_tasks_say_nothing(capsys):
    with console.Progress().task("loading", total=None) as task:
        task.update(advance=1)
    assert capsys.readouterr().err == ""


def test_prompt_progress_callback_counts_restored_tokens_as_processed(tmp_path, model_of, capsys):
    """As in mlx-lm: (processed, total) while prefilling, ending at the whole prompt."""
    model = model_of("llama")
    tokens = [1 + i % 255 for i in range(299)]  # inside the tiny model's vocabulary of 256
    calls = []
    with PromptStore.open(tmp_path, prefill_step=64) as store:
        space = store.bind(model, model_id="m")
        text = generation.generate(
            model,
            demo_tokenizer(),
            tokens,
            space=space,
            max_tokens=2,
            prompt_progress_callback=lambda *c: calls.append(c),
        )
        assert calls[0] == (0, 299) and calls[-1] == (299, 299)
        assert [p for p, _ in calls] == sorted(p for p, _ in calls) and {t for _, t in calls} == {299}
        assert any(0 < p < 298 for p, _ in calls)  # while prefilling, step by step
        calls.clear()
        generation.generate(
            model,
            demo_tokenizer(),
            tokens,
            space=space,
            max_tokens=2,
            prompt_progress_callback=lambda *c: calls.append(c),
        )
        assert calls[0] == (298, 299) and calls[-1] == (299, 299)  # restored: nothing left to prefill
    assert isinstance(text, str)
    assert capsys.readouterr() == ("", "")  # the library printed nothing


def test_spill_on_close_is_shown(tmp_path, model_of, monkeypatch, capsys):
    monkeypatch.setattr(console, "QUIET_UNDER_S", 0.0)
    model = model_of("llama")
    store = PromptStore.open(tmp_path, durability="write_back")
    space = store.bind(model, model_id="m")
    cache = space.new_cache()
    model(mx.array(list(range(1, 65)))[None], cache=cache)
    space.insert(list(range(1, 65)), cache)
    console.close_store(store, console.Progress())
    line = capsys.readouterr().err.strip()
    assert line.startswith("writing 1 snapshot to disk: ") and " MiB in " in line
    with PromptStore.open(tmp_path) as again:
        assert again.cold_bytes() > 0


def test_a_failed_task_does_not_say_done(monkeypatch, capsys):
    monkeypatch.setattr(console, "QUIET_UNDER_S", 0.0)
    try:
        with console.Progress().task("writing the demo model"):
            raise OSError("disk full")
    except OSError:
        pass
    assert capsys.readouterr().err == ""
