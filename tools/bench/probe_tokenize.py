"""What tokenizing a chat's prompt costs, whole against piece by piece (serve/pieces.py).

A chat of one long system prompt and a question, rendered with the demo
tokenizer's chat template, tokenized as mlx_lm.server does (apply_chat_template
with tokenize=True) and through the kept pieces once they are kept; the median
of `--repeats` calls each, side by side, and the tokens compared.

    python tools/bench/probe_tokenize.py [--tokens 4800]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from promptstore.serve.pieces import Pieces, PieceTokenizer  # noqa: E402
from promptstore.testing.tokenizer import CORPUS, demo_tokenizer  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4800, help="about this many tokens of system prompt")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    tok = demo_tokenizer(1024)
    words = CORPUS.read_text().split()
    system = ""
    while len(tok.encode(system)) < args.tokens:  # the corpus, over again, until long enough
        system += " " + " ".join(words[: max(50, (args.tokens - len(tok.encode(system))) // 2)])
        words = words[50:] + words[:50]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does it say?"}]
    pieces = Pieces(tok)
    wrapped = PieceTokenizer(tok, pieces)
    whole = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    for _ in range(10):  # past the first requests, which are tokenized both ways
        assert wrapped.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == whole
    a = timed(lambda: tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True), args.repeats)
    b = timed(lambda: wrapped.apply_chat_template(messages, add_generation_prompt=True, tokenize=True), args.repeats)
    print(
        f"a chat of {len(whole):,} tokens: whole {a * 1e3:.2f} ms, in pieces {b * 1e3:.3f} ms ({b / a:.3f}x); same tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
