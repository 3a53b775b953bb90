"""The `promptstore` command: demo, generate, stats, compact, serve."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import run

    return 0 if run(model_path=args.model, store_dir=args.store, json_out=args.json) else 1


def _demo_phase(args) -> int:
    from .demo import phase_main

    return phase_main(args.store, args.model)


def _generate(args) -> int:
    from mlx_lm import load

    from .generation import stream_generate
    from .store import PromptStore

    model, tokenizer = load(args.model)
    messages = []
    if args.system_file:
        with open(args.system_file) as f:
            messages.append({"role": "system", "content": f.read()})
    messages.append({"role": "user", "content": args.prompt})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    with PromptStore.open(args.store) as store:
        space = store.bind(model, model_id=args.model_id or args.model)
        for response in stream_generate(model, tokenizer, prompt, space=space, max_tokens=args.max_tokens):
            print(response.text, end="", flush=True)
        hit = space.last_hit
        print(
            f"\n[{hit.length} of {len(prompt)} prompt tokens restored in {hit.seconds * 1e3:.1f} ms]", file=sys.stderr
        )
    return 0


def _stats(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .store import PromptStore

    with PromptStore.open(args.store) as store:
        table = Table(title=f"promptstore at {store.path}")
        for col in ("namespace", "model", "nodes", "tokens stored", "hits", "misses", "tokens served", "cold bytes"):
            table.add_column(col, justify="right")
        for ns in store.index.namespaces():
            c = store.index.counters(ns)
            nodes = list(store.index.iter_nodes(ns))
            cold = sum(n.record.nbytes for n in nodes if n.record.file)
            table.add_row(
                ns.hex[:12],
                ns.spec.model_id or ns.spec.weights_digest[:12],
                str(len(nodes)),
                str(c.get("tokens_stored", 0)),
                str(c.get("hits", 0)),
                str(c.get("misses", 0)),
                str(c.get("tokens_served", 0)),
                f"{cold / 2**20:.1f} MiB",
            )
        Console().print(table)
        largest = sorted(
            (n for ns in store.index.namespaces() for n in store.index.iter_nodes(ns)),
            key=lambda n: n.end,
            reverse=True,
        )[:5]
        for n in largest:
            print(f"  prefix of {n.end} tokens (node {n.key.hex()[:12]}, span [{n.start}, {n.end}))")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="promptstore", description="A persistent prompt-cache store for MLX models.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="chats and agent forks, without and with a store, and after a restart")
    demo.add_argument("--model", help="a local MLX model directory (default: a random-weight llama)")
    demo.add_argument("--store", help="store directory (default: a temporary one)")
    demo.add_argument("--json", help="also write the figures to this file")
    demo.set_defaults(func=_demo)
    phase = sub.add_parser("demo-phase", help=argparse.SUPPRESS)
    phase.add_argument("--store", required=True)
    phase.add_argument("--model")
    phase.set_defaults(func=_demo_phase)
    gen = sub.add_parser("generate", help="generate with a local model through the store")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system-file")
    gen.add_argument("--store", help="store directory (default: $PROMPTSTORE_HOME or the user cache)")
    gen.add_argument("--model-id", help="identity to key the cache by (default: the model path)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.set_defaults(func=_generate)
    compact = sub.add_parser("compact", help="keep a store within budget, repair and verify it", add_help=False)
    compact.set_defaults(func=None)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (mlx_lm.server) on the store", add_help=False)
    serve.set_defaults(func=None)
    stats = sub.add_parser("stats", help="namespaces, nodes, tokens, bytes and hit rates of a store")
    stats.add_argument("--store")
    stats.set_defaults(func=_stats)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compact"]:
        from .compact_cli import run

        return run(argv[1:])
    if argv[:1] == ["serve"]:
        from .serve import main as serve

        return serve(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
