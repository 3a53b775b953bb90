"""The `promptstore` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import run

    return 0 if run(system_tokens=args.system_tokens, conversations=args.conversations) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="promptstore", description="A persistent prompt-cache store for MLX models.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demonstration on a random-weight model")
    demo.add_argument("--system-tokens", type=int, default=1536, help="length of the shared system prompt")
    demo.add_argument("--conversations", type=int, default=4, help="requests sharing it")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
