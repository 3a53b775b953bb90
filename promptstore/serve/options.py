"""The `promptstore serve` command line: every option of mlx_lm.server's own
parser (taken from its main(), so none is copied or lost: mlx_lm_server.py),
plus promptstore's: the store, API keys, the model's identity, limits and store
settings."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
from pydantic import ByteSize, TypeAdapter

from ..config import ENV_PREFIX, Settings
from ..errors import ServeConfigError
from .arrivals import GATHER_S
from .connections import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from .door import BODY_SECONDS, DEFAULT_MAX_BODY_BYTES
from .heap import DEFAULT_RESERVE
from .mlx_lm_server import mlx_lm_parser

# --prefill-step-size's default. On 2 CPU cores (the demo's llama, float32,
# OpenBLAS; tools/bench/probe_prefill_step.py in git history at commit e209242,
# bench-results/prefill-step-cpu.json)
# a 1,048-token prefill on 1,028 stored tokens took 704 ms in steps of 2,048, 634
# in steps of 512 and 567 in steps of 256; 4,096 fresh tokens 3,813, 2,913 and
# 2,599 ms. 256 split the chat's 259-token segments into a step of 256 and one
# of 3, and the first round of bench_serve's chat took 30 ms longer; 512 keeps
# such segments whole. On a GPU a step is bound by compute: mlx_lm.server's.
CPU_PREFILL_STEP, GPU_PREFILL_STEP = 512, 2048


def default_prefill_step() -> int:
    """--prefill-step-size's default for the device MLX runs on."""
    return CPU_PREFILL_STEP if mx.default_device() == mx.cpu else GPU_PREFILL_STEP


# Settings the server does not use (mlx-lm's --prefill-step-size drives prefill).
UNUSED_SETTINGS = ("prefill_step",)
# A server is stopped and killed by deployments, and runs on laptops whose SSDs
# are soldered in: unless told otherwise, write what is reused, a conversation
# gone idle and, at a stop, every chat turn and conversation; never a one-off prompt (the
# store's own default keeps inserts in memory until eviction or close).
# docs/durability.md has the measurements (tools/bench/bench_wear.py).
SERVE_DURABILITY = "admit"
SERVE_DEFAULTS = {
    "durability": f" (default: {SERVE_DURABILITY} here)",
    "warm_start": " (default: true here)",
    "hot_bytes": " (default here: --prompt-cache-bytes when given, else a quarter of a GPU's memory)",
}


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's options and promptstore's, in one parser."""
    parser = mlx_lm_parser()
    parser.prog = "promptstore serve"
    parser.description = (
        "An OpenAI-compatible server (mlx_lm.server) whose prompt cache is a promptstore:\n"
        "it survives restarts and is shared by every process on the store."
    )
    parser.epilog = (
        "examples:\n  promptstore serve --model demo-model --store ~/promptstore --port 8080\n"
        "  promptstore serve --model demo-model --api-keys keys.json"
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if action.dest == "prefill_step_size":
            action.default = default_prefill_step()
            action.help = (
                f"tokens per prefill step (default: {CPU_PREFILL_STEP} on CPU, where attention over a long "
                f"prompt in smaller steps stays in cache, {GPU_PREFILL_STEP} elsewhere, as mlx_lm.server's)"
            )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error at start")
    group = parser.add_argument_group("promptstore")
    _add_options(group)
    _add_settings(group, parser)
    return parser


def _add_options(group) -> None:
    group.add_argument("--store", help="store directory (default: $PROMPTSTORE_HOME or the user cache)")
    group.add_argument(
        "--allowed-image-folder",
        action="append",
        metavar="DIR",
        help="a vision-language model reads image files (file:// or a path) from under DIR (repeatable); "
        "without one only data URLs and base64 are taken. Remote URLs are always refused",
    )
    group.add_argument(
        "--max-images",
        type=int,
        default=16,
        metavar="N",
        help="images one request may carry to a vision-language model (default: 16)",
    )
    group.add_argument(
        "--model-id",
        help="identity to key the store by, vouched for by you (default: a digest of the weights, "
        "computed once at start)",
    )
    group.add_argument(
        "--model-id-spans-weights",
        action="store_true",
        help="the --model-id is meant to span versions of the weights: serve a model whose weights differ from "
        "those the store's namespaces of the id were bound with (default: refuse it, as another model's)",
    )
    group.add_argument(
        "--api-keys",
        metavar="FILE",
        help='JSON object {"<api key>": "<tenant salt>", ...}: requests need "Authorization: Bearer <key>", '
        "and each salt is a namespace no other tenant shares or times",
    )
    group.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve Prometheus metrics at /metrics (default: on; --no-metrics answers 404). With --api-keys "
        "only the key of --metrics-key-file reads them, never a tenant's key",
    )
    group.add_argument(
        "--metrics-key-file",
        metavar="FILE",
        help="a file holding the operator's key: /metrics then needs 'Authorization: Bearer <key>' (401 without "
        "it, 403 for a tenant's API key). Without it /metrics is open, or refused to all (403) with --api-keys",
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="longest prompt accepted, in tokens (default: the model's max_position_embeddings, when known)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest request body accepted: a larger one is answered 413 before any of it is read "
        f"(default: {DEFAULT_MAX_BODY_BYTES >> 20} MiB, the Messages API's own limit)",
    )
    group.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="the longest a client may take to send a request's line and headers: one slower is answered 408 "
        f"and its connection closed (default: {DEFAULT_HEADER_TIMEOUT_S:g}; the body has {BODY_SECONDS:g} s of its own)",
    )
    group.add_argument(
        "--max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="connections open at once, each served by a thread: one more is answered 503 at once "
        f"(default: {DEFAULT_MAX_CONNECTIONS})",
    )
    group.add_argument(
        "--max-tokens-limit",
        type=_positive_int,
        metavar="TOKENS",
        help="most tokens one request may generate: a larger max_tokens is capped to it, and the reply says so "
        "in its X-Max-Tokens-Capped header (default: no limit but the model's context; --max-tokens is the "
        "default for requests that give none)",
    )
    group.add_argument(
        "--reply-tokens",
        choices=("rendered", "generated"),
        default="rendered",
        help="what the store keeps after a chat reply: the conversation as the chat template renders it for "
        "the next turn (default), or the tokens as generated (mlx_lm.server's way)",
    )
    group.add_argument(
        "--reply-before-fetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a chat's next turn first stores its previous reply (when that still waits) and then fetches, so "
        "its batch does not prefill the reply (mlx-lm pads a batch's prompts to the longest). Default: on; "
        "--no-reply-before-fetch lets the batch prefill it (docs/serve.md)",
    )
    group.add_argument(
        "--reply-batch",
        type=_positive_int,
        default=None,
        metavar="N",
        help="at most N chat replies waiting to be stored are prefilled together, in one batched forward "
        "(default: --decode-concurrency on CPU; 1, one after another, on a GPU)",
    )
    group.add_argument(
        "--kernel-warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a small batch while starting, so the first requests do not build the kernels (default: on; "
        "takes a few seconds at start on a GPU)",
    )
    group.add_argument(
        "--heap-reserve",
        type=_byte_size,
        default=DEFAULT_RESERVE,
        metavar="SIZE",
        help="on MLX's CPU backend (with glibc): the freed heap the process keeps for the model's next arrays, "
        "touched once while starting, so requests do not fault memory back in a page at a time (default: "
        f"{DEFAULT_RESERVE >> 20}MiB; 0 leaves the C library's settings as they are; serve/heap.py)",
    )
    group.add_argument(
        "--warm-start-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the warm start finish before the model loads (default: on with CUDA, off elsewhere: on an "
        "H100, a warm start still reading while the weights were made left later batches over its caches at "
        "1.1-2.3 s to the first token instead of 0.2; docs/serve.md)",
    )
    group.add_argument(
        "--arrival-wait",
        type=float,
        default=GATHER_S,
        metavar="SECONDS",
        help="the longest the generation thread, taking a request, waits for requests whose prompts are being "
        f"checked at that moment, so a burst prefills as one batch (default: {GATHER_S}; 0 turns it off)",
    )
    group.add_argument(
        "--cudnn-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on CUDA, let MLX run attention through cuDNN (MLX_CUDA_USE_CUDNN_SDPA). Default: off unless that "
        "variable is set. MLX builds a cuDNN graph for every new prompt length, 0.04-1.3 s on an H100, and "
        "a chat server meets a new length with nearly every request (docs/serve.md)",
    )
    group.add_argument(
        "--read-gpu-libraries",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, after the warm-up, read the shared libraries the server maps once (bounded to 30 s), so "
        "that after a reboot the first requests do not fault kernels in from disk (default: on; 6.2 GB in 5.2 s "
        "on an H100 host whose page cache was dropped, 0.3 s when it is warm; nothing on CPU; docs/serve.md)",
    )
    group.add_argument(
        "--warm-prompts",
        metavar="FILE",
        help="a JSON list of message arrays (as a chat completion's messages) a deployment sends at the start "
        "of its conversations, e.g. its system prompt: each is prefilled and stored at start unless the store "
        "holds it already, so the first conversation restores it too (serve/known_prompts.py)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds SIGTERM/SIGINT may take to finish the current step and close the store (default: 60)",
    )


def _add_settings(group, parser: argparse.ArgumentParser) -> None:
    taken = set(parser._option_string_actions)
    for name, field in Settings.model_fields.items():
        if name in UNUSED_SETTINGS:
            continue
        flag = "--" + name.replace("_", "-")
        if flag in taken:
            flag = "--store-" + name.replace("_", "-")
        default = SERVE_DEFAULTS.get(name, "")
        group.add_argument(
            flag,
            dest=f"store_{name}",
            metavar=name.upper(),
            help=f"store setting: {field.description}{default}; also {ENV_PREFIX}{name.upper()}",
        )


def store_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Store settings given on the command line, as Settings overrides."""
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        raw = getattr(args, f"store_{name}", None)
        if raw is None:
            continue
        if name.endswith("_mode"):
            try:
                raw = int(raw, 0)
            except ValueError:
                raise ServeConfigError(f"--{name.replace('_', '-')} {raw!r}: not a number (e.g. 0o600)") from None
        out[name] = raw
    if "durability" not in out and ENV_PREFIX + "DURABILITY" not in os.environ:
        out["durability"] = SERVE_DURABILITY
    if "warm_start" not in out and ENV_PREFIX + "WARM_START" not in os.environ:
        out["warm_start"] = True  # a restarted server's first requests are hot hits
    if "hot_bytes" not in out and ENV_PREFIX + "HOT_BYTES" not in os.environ:
        if args.prompt_cache_bytes:
            out["hot_bytes"] = args.prompt_cache_bytes  # mlx-lm's memory budget for prompt caches
        elif (budget := accelerator_hot_bytes()) is not None:
            out["hot_bytes"] = budget
    return out


def accelerator_hot_bytes() -> int | None:
    """The hot tier's default budget on a GPU: a quarter of its memory (mlx_lm.server
    bounds its own prompt cache by sequences, not bytes); None on CPU."""
    if mx.default_device() != mx.gpu:
        return None
    info = mx.device_info()
    total = info.get("total_memory") or info.get("memory_size")  # CUDA, Metal
    return int(total) // 4 if isinstance(total, int) and total > 0 else None


_SIZE = TypeAdapter(ByteSize)


def _byte_size(text: str) -> int:
    try:
        value = int(_SIZE.validate_python(text.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512MiB or 536870912)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of at least 0 bytes")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def read_json_file(path: str | Path, what: str) -> Any:
    """A JSON file a serve option names, or ServeConfigError saying what is wrong
    with it (`what`: "API keys file", say)."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ServeConfigError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServeConfigError(f"the {what} {path} is not JSON: {e}") from None
