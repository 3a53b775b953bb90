"""`promptstore serve`'s main(): the command line read, what must hold before
the store opens checked (the HTTP port bound among it), the store opened under
the signals' watch, then the model provider, the generation loop and the HTTP
handler put together over it (provider.py, loop.py, handler.py) and served until
a signal; then the store closed and the closing line said (shutdown.py)."""

from __future__ import annotations

import logging
import sys

import mlx.core as mx

from ..console import model_dir
from ..errors import PromptStoreError
from ..store import PromptStore
from .cache import StoreCache
from .connections import capped_server
from .handler import StoreHandler
from .insert_scheduler import InsertSettings
from .kernels import attention_kernels
from .known_prompts import load_known_prompts
from .loop import StoreResponseGenerator
from .metrics import load_metrics_key
from .mlx_lm_server import maybe_set_recommended_wired_limit, serve_http
from .options import build_parser, store_settings
from .provider import StoreModelProvider
from .shutdown import Shutdown, closing_line, exit_now
from .startup import listening_socket, serve_group
from .tenants import KeyRing, load_api_keys

log = logging.getLogger("promptstore.serve")


def store_cache(store: PromptStore, args, keyring: KeyRing) -> StoreCache:
    """The prompt cache mlx-lm's loop calls, over `store`, as the options say."""
    return StoreCache(
        store,
        model_id=args.model_id,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        reply_tokens=args.reply_tokens,
        tenants=keyring.tenants(),
        spans_weights=args.model_id_spans_weights,
        # Each waiting insert keeps its finished request's cache alive: no more than the batch did.
        inserts=InsertSettings.for_server(
            batch=args.decode_concurrency, replies_before_fetch=args.reply_before_fetch, reply_batch=args.reply_batch
        ),
    )


def run(args, cache: StoreCache, keyring: KeyRing) -> StoreResponseGenerator:
    """Start the generation thread and serve HTTP until interrupted (mlx_lm.server.run's job)."""
    provider = StoreModelProvider(args, cache)
    generator = StoreResponseGenerator(provider, cache, keyring)
    try:
        if mx.distributed.init().rank() == 0:
            listener = getattr(args, "listener", None) or listening_socket(args.host, args.port)  # main() binds it
            server = capped_server(listener, args.max_connections, args.header_timeout)
            serve_http(args.host, args.port, generator, server_class=server, handler_class=StoreHandler)
        else:  # no HTTP here: wait for the loop, where a signal may land and leave nothing amiss
            while not generator.join_for(1.0):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        generator.stop_and_join()
    return generator


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model is required: promptstore serve serves one local model")
    if not 0 <= args.arrival_wait <= 10:
        parser.error(f"--arrival-wait {args.arrival_wait}: give 0 to 10 seconds")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s - %(levelname)s - %(message)s"
    )
    attention_kernels(args.cudnn_attention)
    # Installed first: a signal while the store opens (and starts its warm start) closes it.
    shutdown = Shutdown(args.shutdown_timeout)
    shutdown.install()
    store = generator = None
    try:
        try:
            args.model = str(model_dir(args.model))  # a local directory: nothing is ever downloaded
            keyring = KeyRing(load_api_keys(args.api_keys) if args.api_keys else None)
            args.metrics_key = load_metrics_key(args.metrics_key_file, keyring) if args.metrics_key_file else None
            args.known_prompts = load_known_prompts(args.warm_prompts) if args.warm_prompts else None
            group = serve_group(args.pipeline)
            # Bound before the store opens and the model loads: a port in use ends the start at once.
            args.listener = listening_socket(args.host, args.port)
            with shutdown.signals_postponed():  # a signal meanwhile comes once `store` can be closed
                store = PromptStore.open(args.store, group=group, **store_settings(args))
        except PromptStoreError as e:
            if args.debug:
                raise
            print(f"promptstore serve: error: {e}", file=sys.stderr)
            return 2
        maybe_set_recommended_wired_limit()
        cache = store_cache(store, args, keyring)
        log.info("store %s (durability %s)", store.path, store.settings.durability)
        generator = run(args, cache, keyring)
    except KeyboardInterrupt:
        pass
    finally:
        if store is not None:
            shutdown.begin()
            store.close()
            log.info("%s", closing_line(generator.closed_inserts if generator is not None else None, store))
    exit_now(1 if generator is not None and generator.gave_up else 0)
