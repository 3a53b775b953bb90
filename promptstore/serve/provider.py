"""The model provider: the one model the server was started with (never a
download; any other name is refused), loaded on the generation thread and made
ready there before the first request: the store bound to its weights, the heap
kept, its kernels built, the known prompts stored, the GPU runtime's libraries
read."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ServeRequestError
from ..store import CUDA
from .cache import StoreCache
from .heap import keep_heap
from .kernels import warm_up
from .known_prompts import store_known_prompts
from .libraries import read_libraries, runtime_libraries
from .mlx_lm_server import ModelProvider, hf_tokenizer
from .pieces import Pieces, PieceTokenizer
from .tenants import Tenant
from .vision import ServedVisionModel, load_vision, vision_folder

log = logging.getLogger("promptstore.serve")

WARM_UP_BATCH = 4  # on an H100, warming a batch of 4 left a later batch of 1 fast too (kernels.py)


class StoreModelProvider(ModelProvider):
    """Serves the configured model only: any other name is refused, never loaded."""

    def __init__(self, cli_args, cache: StoreCache):
        super().__init__(cli_args)
        self.cache = cache
        path = Path(cli_args.model)
        resolved = str(path.resolve()) if path.exists() else cli_args.model
        self.public_id = cli_args.model_id or resolved
        self.names = {"default_model", cli_args.model, resolved, self.public_id}
        self.max_positions: int | None = None
        self.vocab_size: int | None = None
        self.ready = False  # the model loaded, attached and warmed up
        self.busy: Callable[[], bool] = lambda: False  # a request waits for its first token (the generator's)

    def served(self, model: str | None, adapter: str | None, draft: str | None) -> bool:
        return (
            model in self.names
            and adapter in (None, self.cli_args.adapter_path)
            and draft in (None, "default_model", self.cli_args.draft_model)
        )

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if not self.served(model_path, adapter_path, draft_model_path):
            raise ServeRequestError(f"model {model_path!r} is not served here", status=404)
        return super().load("default_model", None, "default_model")

    def load_weights(self, model_path, adapter_path=None, draft_model_path=None) -> None:
        if vision_folder(model_path):
            load_vision(self, model_path)  # an mlx-vlm folder (serve/vision.py)
        else:
            super().load_weights(model_path, adapter_path, draft_model_path)

    @property
    def vision(self) -> ServedVisionModel | None:
        """The model, where it takes images."""
        return self.model if isinstance(self.model, ServedVisionModel) else None

    def vision_counts(self) -> dict | None:
        """The vision tower's runs and skips (None: the model takes no images)."""
        return self.vision.vision.counts() if self.vision is not None else None

    def before_load(self) -> None:
        first = self.cli_args.warm_start_first
        warming = self.cache.store.warming
        if (CUDA if first is None else first) and warming is not None:
            # Measured on an H100 (a probe of the store's warm start and mlx-lm's
            # batches, one process each way): a warm start still reading while
            # the model's weights were made left later batches over its caches
            # at 1.1-2.3 s to the first token; finished first, 0.20-0.22 s, as
            # without a warm start. Why is not known; until it is, the model
            # waits (on a CPU or Apple silicon nothing like it was seen).
            started = time.perf_counter()
            warming.wait()
            log.info("warm start finished before the model loads (waited %.1f s)", time.perf_counter() - started)

    def after_load(self) -> None:
        args = getattr(self.model, "args", None)
        self.max_positions = getattr(args, "max_position_embeddings", None)
        vocab = [len(hf_tokenizer(self.tokenizer)), getattr(args, "vocab_size", None)]
        self.vocab_size = min(v for v in vocab if v)
        # A chat's unchanged messages are not tokenized again; the first texts are
        # checked on a thread of their own, which waits while a request is busy.
        self.pieces = Pieces(self.tokenizer, busy=lambda: self.busy())
        self.cache.attach(self.model, self.tokenizer, self.draft_model, self.model_key, self.cli_args.prefill_step_size)
        self.cache.pieces = self.pieces
        kept = keep_heap(self.cli_args.heap_reserve)  # before the warm-up, whose arrays it then keeps alive
        if kept is not None:
            log.info("heap: %d MiB kept for the model's arrays, touched in %.2f s", kept[0] >> 20, kept[1])
        if self.cli_args.kernel_warm_up and self.draft_model is None:
            self._build_kernels()
        prompts = getattr(self.cli_args, "known_prompts", None)
        if prompts:
            log.info("%s", store_known_prompts(self.cache, prompts, self.cli_args.chat_template_args))
        libraries = runtime_libraries() if self.cli_args.read_gpu_libraries else []
        if libraries:
            files, nbytes, seconds = read_libraries(libraries)
            log.info("GPU runtime libraries: %d files, %.2f GB read in %.2f s", files, nbytes / 1e9, seconds)
        self.ready = True

    def piecewise(self, tokenizer, tenant: Tenant):
        """`tokenizer`, rendering chats through the pieces kept for `tenant` (serve/pieces.py)."""
        pieces = getattr(self, "pieces", None)
        if pieces is None or pieces.tokenizer is not tokenizer:
            return tokenizer
        return PieceTokenizer(tokenizer, pieces, tenant.salt)

    def _build_kernels(self) -> None:
        """Run a small batch as a restarted server's first round runs (on the
        generation thread, where this is called), so that round does not build
        the kernels; a model the batch path cannot run is served without it."""
        batch = min(WARM_UP_BATCH, self.cli_args.decode_concurrency, self.cli_args.prompt_concurrency)
        try:
            seconds = warm_up(
                self.model,
                self.vocab_size,
                batch,
                prefill_batch_size=self.cli_args.prompt_concurrency,
                prefill_step_size=self.cli_args.prefill_step_size,
            )
        except Exception as e:  # a warm-up is never a reason not to serve
            log.warning("kernel warm-up skipped: %s", e)
            return
        log.info("kernel warm-up: a batch of %d in %.2f s", batch, seconds)
