"""`generate` and `chat` over the store: mlx-lm's sampling options, and a
conversation whose restored share grows turn by turn."""

from __future__ import annotations

import json
import re

TURNS = ["Do you have any books about sailing?", "What are the opening hours?", "Is it open on Sunday?", "Thanks!"]


def test_chat_over_stdin_restores_more_each_turn(cli, tmp_path, model_dir):
    proc = cli(
        "chat", "--model", str(model_dir), "--store", str(tmp_path / "s"), "-m", "8", input="\n".join(TURNS) + "\n"
    )
    assert proc.returncode == 0, proc.stderr
    turns = re.findall(r"^\[turn (\d+): restored ([\d,]+) of ([\d,]+) prompt tokens", proc.stderr, flags=re.M)
    assert [int(t) for t, _, _ in turns] == [1, 2, 3, 4]
    restored = [int(r.replace(",", "")) for _, r, _ in turns]
    prompt = [int(p.replace(",", "")) for _, _, p in turns]
    assert restored[0] == 0
    share = [r / p for r, p in zip(restored, prompt)]
    assert share == sorted(share) and len(set(share)) == 4, share  # it grows turn by turn
    # Each turn restores the whole earlier conversation up to the last reply, at least.
    assert all(restored[t] >= prompt[t - 1] for t in range(1, 4)), (restored, prompt)
    assert proc.stdout.strip() and "[turn" not in proc.stdout  # replies on stdout, counts on stderr


def test_generate_takes_mlx_lm_sampling_options(cli, tmp_path, model_dir):
    def reply(*args) -> str:
        proc = cli(
            "generate", "--model", str(model_dir), "--store", str(tmp_path / "s"), "-p", "Hello", "--json", *args
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["reply"]

    sampled = ["--temp", "1.5", "--top-p", "0.9", "--max-tokens", "12"]
    first, again = reply(*sampled, "--seed", "3"), reply(*sampled, "--seed", "3")
    assert first == again  # the seed fixes the sample, stored prefix or not
    assert reply(*sampled, "--seed", "4") != first
    assert reply("--max-tokens", "12") != first  # temperature 0 is greedy: another reply


def test_generate_reads_the_prompt_from_stdin(cli, tmp_path, model_dir):
    args = ["generate", "--model", str(model_dir), "--store", str(tmp_path / "s"), "--json", "-m", "4"]
    piped = json.loads(cli(*args, "-p", "-", input="Hello").stdout)
    given = json.loads(cli(*args, "-p", "Hello").stdout)
    assert piped["reply"] == given["reply"] and given["restored_tokens"] == given["prompt_tokens"] - 1
