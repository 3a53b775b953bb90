"""The `promptstore` command: one function per command, registered in COMMANDS
(`serve` hands its arguments to promptstore.serve, whose parser is mlx_lm.server's).

Every failure ends in one line on stderr and a non-zero status (`--debug`
shows the traceback); progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import compact_cli
from .config import warn_unknown_variables
from .console import (
    FAILED,
    ArgumentParser,
    Progress,
    close_store,
    existing_store,
    guarded,
    model_dir,
    prefill_callback,
    setup_logging,
    store_path,
)
from .errors import SettingsError

PROG = "promptstore"


@dataclass(frozen=True)
class Command:
    """A subcommand: what runs, its arguments, and its help."""

    name: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None]
    summary: str  # one line, listed by `promptstore --help`
    epilog: str  # examples (and notes) shown by `promptstore NAME --help`
    failed: int = FAILED  # the status of a failure
    description: str = ""


# --- demo -------------------------------------------------------------------------------


def _demo(args) -> int:
    from rich.console import Console

    from .demo import render, run, save_model

    if args.save_model:
        with Progress().task("writing the demo model"):
            out = save_model(args.save_model)
        print(f"wrote the demo's random-weight llama and tokenizer to {out}")
        return 0
    model = str(model_dir(args.model)) if args.model else None
    store = str(store_path(args.store)) if args.store else None
    result = run(model_path=model, store_dir=store, progress=Progress())
    if args.json:
        figures = {"rows": result.rows, "replies_equal": result.replies_equal, "model": result.model}
        print(json.dumps({**figures, "device": result.device, "blas": result.blas}, indent=2))
    else:
        render(Console(), result)
    return 0 if result.ok else 1


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a local MLX model directory (default: a random-weight llama built in-process)")
    p.add_argument("--store", help="store directory (default: a temporary one, removed afterwards)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout instead of the table")
    p.add_argument(
        "--save-model",
        metavar="DIR",
        help="write the demo's random-weight llama and tokenizer to DIR as an MLX model directory, and stop",
    )


# --- generate and chat --------------------------------------------------------------------


def _generate(args) -> int:
    progress = Progress()
    messages = _system_messages(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages.append({"role": "user", "content": text})
    with _session(args, progress) as (model, tokenizer, space):
        prompt = _prompt_tokens(tokenizer, messages)
        reply = _reply(model, tokenizer, prompt, space, args, progress, echo=not args.json)
        hit = space.last_hit
    if args.json:
        print(json.dumps({"reply": reply, **_restored(hit, prompt)}, indent=2))
    else:
        print(_restored_line(hit, prompt), file=sys.stderr)
    return 0


def _chat(args) -> int:
    progress = Progress()
    messages = _system_messages(args)
    with _session(args, progress) as (model, tokenizer, space):
        for turn, text in enumerate(_turns(), 1):
            messages.append({"role": "user", "content": text})
            prompt = _prompt_tokens(tokenizer, messages)
            reply = _reply(model, tokenizer, prompt, space, args, progress, echo=True)
            messages.append({"role": "assistant", "content": reply})
            print(_restored_line(space.last_hit, prompt, f"turn {turn}: "), file=sys.stderr, flush=True)
    return 0


def _turns():
    """The person's messages: typed at a prompt on a terminal, else one per line of stdin."""
    if sys.stdin.isatty():
        print("chat: type a message and press enter; an empty line or ctrl-d ends", file=sys.stderr)
        while True:
            try:
                text = input("you> ").strip()
            except EOFError:
                return
            if not text:
                return
            yield text
    else:
        for line in sys.stdin:
            if line.strip():
                yield line.strip()


def _reply(model, tokenizer, prompt: list[int], space, args, progress: Progress, echo: bool) -> str:
    """Generate through the store, showing the prompt's progress until the first token."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from .generation import stream_generate

    if args.seed is not None:
        mx.random.seed(args.seed)
    text = ""
    with ExitStack() as showing:
        task = showing.enter_context(progress.task("processing the prompt", total=len(prompt), unit="tokens"))
        for response in stream_generate(
            model,
            tokenizer,
            prompt,
            space=space,
            max_tokens=args.max_tokens,
            sampler=make_sampler(args.temp, args.top_p),
            prompt_progress_callback=prefill_callback(task),
        ):
            showing.close()  # the first token: the prompt is done, the reply takes the terminal
            text += response.text
            if echo:
                print(response.text, end="", flush=True)
    if echo:
        print(flush=True)
    return text


def _restored(hit, prompt: list[int]) -> dict:
    return {
        "prompt_tokens": len(prompt),
        "restored_tokens": hit.length,
        "restored_cold_tokens": hit.cold_tokens,
        "prefilled_tokens": len(prompt) - hit.length,
        "restore_seconds": hit.seconds,
    }


def _restored_line(hit, prompt: list[int], prefix: str = "") -> str:
    share = 100 * hit.length / len(prompt) if prompt else 0.0
    return (
        f"[{prefix}restored {hit.length:,} of {len(prompt):,} prompt tokens ({share:.0f}%) "
        f"in {hit.seconds * 1e3:.1f} ms; prefilled {len(prompt) - hit.length:,}]"
    )


def _system_messages(args) -> list[dict]:
    if not args.system_file:
        return []
    return [{"role": "system", "content": Path(args.system_file).read_text()}]


def _prompt_tokens(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode("\n\n".join(m["content"] for m in messages)))


@contextmanager
def _session(args, progress: Progress):
    """(model, tokenizer, the store's namespace of the model); every argument is checked
    before the model loads, and the store is closed (everything spilled) afterwards."""
    from .store import PromptStore

    root, model_id, salt = model_dir(args.model), _model_id(args), _salt(args)
    store = PromptStore.open(store_path(args.store))
    try:
        model, tokenizer = _load_model(root, progress)
        yield model, tokenizer, store.bind(model, model_id=model_id, salt=salt)
    finally:
        close_store(store, progress)


def _generation_arguments(p: argparse.ArgumentParser, chat: bool) -> None:
    p.add_argument("--model", required=True, help="a local MLX model directory (nothing is downloaded)")
    if not chat:
        p.add_argument("--prompt", "-p", required=True, help="the message to the model ('-' reads it from stdin)")
    p.add_argument("--system-file", help="a file whose text is the system prompt")
    p.add_argument("--max-tokens", "-m", type=_max_tokens, default=256, help="most tokens per reply (default: 256)")
    p.add_argument("--temp", type=_at_least_zero, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="sampling top-p (default: 1)")
    p.add_argument("--seed", type=int, help="PRNG seed (default: none)")
    _namespace_arguments(p)
    if not chat:
        p.add_argument("--json", action="store_true", help="print the reply and token counts as JSON on stdout")


def _namespace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="store directory (default: $PROMPTSTORE_HOME, else the user cache)")
    p.add_argument("--model-id", help="the identity the store keys the model by (default: the model's absolute path)")
    p.add_argument("--salt-file", help="a file holding a tenant's secret salt (its namespace is its own)")


# --- stats ----------------------------------------------------------------------------------


def _stats(args) -> int:
    from .store import default_path
    from .store.group import rank_stores

    path = Path(args.store or default_path())
    ranks = [] if (path / "index").exists() else rank_stores(path)
    if ranks:  # a distributed group's folder: each rank's store, in turn
        return _group_stats(path, ranks, args)
    root = existing_store(path)
    if args.salt_file and not (args.model or args.namespace):
        raise SettingsError("--salt-file needs --model or --namespace: the salt selects one namespace")
    if args.model or args.namespace:
        figures = _namespace_figures(root, args)
    else:
        figures = _store_totals(root)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        _print_figures(figures)
    return 0


def _group_stats(path: Path, ranks: list[Path], args) -> int:
    """stats of a distributed group's folder: each rank's store's totals."""
    if args.model or args.namespace:
        raise SettingsError(
            f"{path} holds the stores of a distributed group's ranks: give one rank's folder "
            f"({ranks[0]}) with --model or --namespace"
        )
    figures = [_store_totals(rank) for rank in ranks]
    if args.json:
        print(json.dumps({"store": str(path), "ranks": figures}, indent=2))
    else:
        for one in figures:
            _print_figures(one)
    return 0


def _store_totals(root: Path) -> dict:
    """The operator's view: totals over every namespace, nothing of any one of them."""
    from .store import store_totals

    stats, remote = store_totals(root)
    return {
        "store": str(root),
        "view": "totals over every namespace",
        **{k: stats[k] for k in ("nodes", "tokens_stored", "nbytes", "hits", "misses", "tokens_served")},
        **_wear(stats),
        "index_bytes": stats["used_bytes"],
        **({"remote": remote} if remote is not None else {}),
    }


def _namespace_figures(root: Path, args) -> dict:
    """One namespace's counters, found by model (and salt) or by fingerprint and salt; nothing of others."""
    from .store import namespace_counters

    salt = _salt(args)
    found = namespace_counters(
        root, salt, args.namespace, lambda: (_load_model(args.model, Progress())[0], _model_id(args))
    )
    if found is None:
        raise SettingsError(f"no namespace of this model{' and salt' if salt else ''} in the store at {root}")
    ns, counters = found
    return {
        "store": str(root),
        "view": "one namespace",
        "namespace": ns.hex,
        "model_id": ns.spec.model_id,
        **{k: counters.get(k, 0) for k in ("nodes", "tokens_stored", "nbytes", "hits", "misses", "tokens_served")},
        **_wear(counters),
    }


def _wear(counters: dict) -> dict:
    """What the store wrote to disk against what it read back, since it was made."""
    written = counters.get("disk_written_bytes", 0) + counters.get("compact_written_bytes", 0)
    read = counters.get("disk_read_bytes", 0)
    return {
        "disk_written_bytes": counters.get("disk_written_bytes", 0),
        "compact_written_bytes": counters.get("compact_written_bytes", 0),
        "disk_read_bytes": read,
        "write_amplification": round(written / read, 3) if read else None,
    }


LABELS = {
    "nbytes": "snapshot bytes",
    "index_bytes": "index bytes",
    "model_id": "model id",
    "disk_written_bytes": "bytes written (spills)",
    "compact_written_bytes": "bytes rewritten (compact)",
    "disk_read_bytes": "bytes read back",
    "write_amplification": "write amplification (written / read back)",
}


def _print_figures(figures: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"promptstore at {figures['store']}: {figures['view']}", highlight=False, soft_wrap=True)
    table = Table(show_header=False)
    table.add_column()
    table.add_column(justify="right")
    for key, value in figures.items():
        if key in ("store", "view"):
            continue
        if key == "remote":  # what this store published to the remote tier
            for name, n in value.items():
                table.add_row(f"remote: {name.replace('_', ' ')}", "?" if n is None else f"{n:,}")
            continue
        if isinstance(value, int):
            value = f"{value / 2**20:.1f} MiB" if key.endswith("bytes") else f"{value:,}"
        elif value is None:
            value = "-"
        table.add_row(LABELS.get(key, key.replace("_", " ")), str(value))
    lookups = figures["hits"] + figures["misses"]
    table.add_row("hit rate", f"{100 * figures['hits'] / lookups:.0f}%" if lookups else "-")
    console.print(table)


def _stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="store directory (default: $PROMPTSTORE_HOME, else the user cache)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="show only this model's namespace (with --salt-file for a tenant's)")
    which.add_argument(
        "--namespace", type=_namespace_hex, help="show only the namespace of this fingerprint (32 hex digits)"
    )
    p.add_argument("--model-id", help="the identity the model was stored under (default: its absolute path)")
    p.add_argument("--salt-file", help="a file holding the namespace's salt")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")


# --- shared pieces ------------------------------------------------------------------------


def _load_model(path: str | Path, progress: Progress):
    root = model_dir(str(path))
    from mlx_lm import load

    with progress.task(f"loading {root.name}"):
        return load(str(root))


def _model_id(args) -> str:
    return args.model_id or str(model_dir(args.model))


def _salt(args) -> str | None:
    if not args.salt_file:
        return None
    salt = Path(args.salt_file).read_text().rstrip("\r\n")
    if not salt:
        raise SettingsError(f"--salt-file {args.salt_file} is empty; expected a secret of at least one character")
    return salt


def _max_tokens(text: str) -> int:
    value = _number(text, int)
    if value == 0 or value < -1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive number of tokens (or -1 for no limit)")
    return value


def _at_least_zero(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a temperature of 0 or more")
    return value


def _top_p(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a probability in (0, 1]")
    return value


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None


def _namespace_hex(text: str) -> str:
    try:
        if len(bytes.fromhex(text)) == 16:
            return text.lower()
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: expected a namespace fingerprint of 32 hex digits")


COMMANDS = [
    Command(
        "demo",
        _demo,
        _demo_arguments,
        "the same chats without a store, with one, and after a restart",
        "examples:\n  promptstore demo\n  promptstore demo --json > demo.json\n  promptstore demo --save-model demo-model",
    ),
    Command(
        "generate",
        _generate,
        lambda p: _generation_arguments(p, chat=False),
        "one reply from a local MLX model, through the store",
        'examples:\n  promptstore generate --model demo-model --prompt "Any books about sailing?"\n'
        "  promptstore generate --model ~/models/my-mlx-model --system-file system.txt \\\n"
        '      --prompt "Hello" --temp 0.7 --seed 1 --json',
    ),
    Command(
        "chat",
        _chat,
        lambda p: _generation_arguments(p, chat=True),
        "a conversation through the store; shows tokens restored per turn",
        "examples:\n  promptstore chat --model demo-model --system-file system.txt\n"
        "  printf 'Hello\\nAnd the weather?\\n' | promptstore chat --model demo-model",
    ),
    Command(
        "stats",
        _stats,
        _stats_arguments,
        "what a store holds: totals, or one namespace's counters",
        "examples:\n  promptstore stats --store ~/.cache/promptstore\n"
        "  promptstore stats --model demo-model\n"
        "  promptstore stats --model demo-model --salt-file tenant.salt --json",
    ),
    Command(
        "serve",
        lambda args: 0,  # main() hands `serve` its own argv: see _serve
        lambda p: None,
        "an OpenAI-compatible server on mlx_lm.server, over the store",
        "examples:\n  promptstore serve --model demo-model --store ~/promptstore --port 8080\n"
        "  promptstore serve --model demo-model --api-keys keys.json\n"
        "Run `promptstore serve --help` for every option (mlx_lm.server's and the store's).",
    ),
    Command(
        "compact",
        compact_cli.execute,
        compact_cli.add_arguments,
        compact_cli.SUMMARY,
        compact_cli.EPILOG.format(prog="promptstore compact"),
        failed=compact_cli.EXIT["failed"],
        description=compact_cli.DESCRIPTION,
    ),
]


EXAMPLES = f"""\
examples:
  {PROG} demo                          the demonstration, about a minute
  {PROG} demo --save-model demo-model  its model, as an MLX model directory
  {PROG} chat --model demo-model       a conversation through the store
  {PROG} stats                         what the store holds

Run `{PROG} COMMAND --help` for a command's options and examples."""


def parser() -> argparse.ArgumentParser:
    top = ArgumentParser(
        prog=PROG,
        description="A persistent prompt-cache store for MLX language models.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--debug", action="store_true", help="show the traceback of an error (before or after COMMAND)")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for c in COMMANDS:
        p = sub.add_parser(
            c.name,
            help=c.summary,
            description=f"{c.summary[0].upper()}{c.summary[1:]}." + (f"\n\n{c.description}" if c.description else ""),
            epilog=c.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.arguments(p)
        # SUPPRESS: a command's parser leaves `debug` alone unless given, so a --debug
        # before the command is not reset by the command's default.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
        p.set_defaults(command=c)
    return top


def main(argv=None) -> int:
    # Nothing this command does may reach for the network (mlx-lm would try the hub).
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = argv[:1] == ["--debug"]  # `promptstore --debug COMMAND ...`
    rest = argv[1:] if debug else argv
    if rest[:1] == ["serve"]:
        # The server's options are mlx_lm.server's plus the store's: its own parser has them all.
        from .serve import main as serve

        return serve(rest[1:] + (["--debug"] if debug else []))
    args = parser().parse_args(argv)
    command: Command = args.command
    prog = f"{PROG} {command.name}"
    setup_logging(prog, args.debug)
    warn_unknown_variables()
    return guarded(lambda: command.run(args), prog, args.debug, failed=command.failed)


if __name__ == "__main__":
    sys.exit(main())
