"""mlx-lm's server (mlx_lm.server), imported here and nowhere else in promptstore.

mlx-lm's server is a script more than a library: its parser is built inside
main(), its generation loop and HTTP handler keep their state in private
attributes, and no hook runs where the store needs one. `promptstore serve`
extends it at the points below, each a private name of mlx-lm's (or of
http.server's, under mlx-lm's handler) with a comment saying why no public one
serves; the rest of serve/ uses the names this module gives them. A release of
mlx-lm that renames one would break the server when it runs, not when it is
imported: so the installed mlx-lm is checked first against the range this
package pins (its dependencies, as pyproject.toml states them), and
tests/serve/test_seam.py pins each point's shape.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import threading
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from queue import Empty as QueueEmpty
from queue import Queue

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..errors import GenerationFailed, ServeConfigError

DISTRIBUTION = "mlx-lm"


def _pin_in(requirements) -> str | None:
    for line in requirements:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) == DISTRIBUTION:
            return str(requirement.specifier) or None
    return None


def pinned_range() -> str | None:
    """The mlx-lm versions this package was written for: its dependency's pin,
    read from the installed package's metadata (pyproject.toml's, as installed),
    else from pyproject.toml in a source tree; None where neither is found."""
    try:
        return _pin_in(importlib.metadata.requires("promptstore") or ())
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        return None
    return _pin_in(tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", []))


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(installed: str | None, pin: str | None) -> None:
    """ServeConfigError, in one line naming the supported range, unless
    `installed` (mlx-lm's version) is within `pin`; nothing to check without a pin."""
    if pin is None:
        return
    wanted = SpecifierSet(pin)
    bounds = sorted((str(s) for s in wanted), key=lambda s: (not s.startswith(">"), s))  # lower bounds first
    said = f"{DISTRIBUTION} {','.join(bounds)}"
    if installed is None:
        raise ServeConfigError(f"{DISTRIBUTION} is not installed; promptstore serve supports {said}")
    try:
        within = wanted.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        within = False
    if not within:
        raise ServeConfigError(f"{DISTRIBUTION} {installed} is installed; promptstore serve supports {said}")


check_version(installed_version(), pinned_range())

# Imported once its version is known to be one this module was written for.
from mlx_lm import server as _server  # noqa: E402
from mlx_lm import utils as _utils  # noqa: E402

# mlx-lm's public names the rest of serve/ builds on.
CompletionRequest = _server.CompletionRequest
GenerationArguments = _server.GenerationArguments
LogitsProcessorArguments = _server.LogitsProcessorArguments
ModelDescription = _server.ModelDescription
SamplingArguments = _server.SamplingArguments
ToolCallFormatter = _server.ToolCallFormatter
process_message_content = _server.process_message_content
Response = _server.Response  # a generated token as mlx-lm's loop puts it in a request's queue
Vision = _server.Vision  # a prompt's images as mlx-lm's image path takes them (serve/vision.py)
load_tokenizer = _utils.load_tokenizer  # what mlx-lm's load reads a folder's tokenizer with
maybe_set_recommended_wired_limit = _server.maybe_set_recommended_wired_limit


# --- the command line -------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser captured")
        self.parser = parser


def mlx_lm_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's parser with every option it defines."""

    class Capturing(argparse.ArgumentParser):
        def parse_args(self, *args, **kwargs):
            raise _Captured(self)

    # Private: main() builds the parser inline and parses at once; no function
    # returns it. main() runs with the module's `argparse` swapped for one whose
    # ArgumentParser hands the finished parser back instead of parsing.
    shim = types.SimpleNamespace(**vars(argparse))
    shim.ArgumentParser = Capturing
    saved = _server.argparse
    _server.argparse = shim
    try:
        _server.main()
    except _Captured as captured:
        captured.parser.__class__ = argparse.ArgumentParser  # parse normally from now on
        return captured.parser
    finally:
        _server.argparse = saved
    raise ServeConfigError(
        "mlx_lm.server.main() no longer parses its arguments with argparse; promptstore cannot serve"
    )


# --- the model ----------------------------------------------------------------------


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (any other: itself)."""
    # Private: the wrapper passes attribute reads through to it, but not len()
    # (looked up on the type), which counts the added tokens its vocab_size leaves out.
    return getattr(tokenizer, "_tokenizer", tokenizer)


class ModelProvider(_server.ModelProvider):
    """mlx-lm's model provider, with hooks either side of a load."""

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        # Private: load() calls _load, on the generation thread, only when the
        # model asked for is not the one loaded; no public hook runs just before
        # the weights are read and just after (where the store binds to them).
        self.before_load()
        self.load_weights(model_path, adapter_path, draft_model_path)
        self.after_load()

    def before_load(self) -> None:
        """Called before the model's weights are read (generation thread)."""

    def load_weights(self, model_path, adapter_path=None, draft_model_path=None) -> None:
        """Load the model, tokenizer and draft model as mlx-lm's _load does (a subclass
        loads other kinds of model: serve/vision.py)."""
        super()._load(model_path, adapter_path, draft_model_path)

    def after_load(self) -> None:
        """Called once the model, tokenizer and draft model are set (generation thread)."""


# --- the generation loop ------------------------------------------------------------


class ResponseGenerator(_server.ResponseGenerator):
    """mlx-lm's generation loop, its private points as named hooks: subclasses
    override step_budget, generation_thread, next_request and tokenize."""

    def __init__(self, *args, **kwargs):
        self.loop_ended = threading.Event()  # set as the generation thread ends (its __init__ starts it)
        super().__init__(*args, **kwargs)

    def step_budget(self, budget):
        """The iterable a run of batch steps goes through (mlx-lm's TimeBudget, given)."""
        return budget

    def generation_thread(self) -> None:
        """The generation thread's body: mlx-lm's runs the loop once."""
        _server.ResponseGenerator._run_generate(self)

    def next_request(self, timeout=None):
        """The next request for the loop (None: none); mlx-lm's is take_request."""
        return self.take_request(timeout)

    def tokenize(self, tokenizer, request, args):
        """A request rendered for the loop; mlx-lm's is render."""
        return self.render(tokenizer, request, args)

    @property
    def _time_budget(self):
        return self._steps

    @_time_budget.setter
    def _time_budget(self, budget) -> None:
        # Private: __init__ makes its TimeBudget after the request queue and
        # before the generation thread starts, and the loop iterates it around
        # each batch step; nothing else can end a run of steps early.
        self._steps = self.step_budget(budget)

    def _run_generate(self) -> None:
        # Private: the generation thread's target. mlx-lm's runs the loop once
        # and, when it raises, marks generation failed for good; the subclass
        # decides instead (it starts the loop again).
        try:
            self.generation_thread()
        finally:
            self.loop_ended.set()

    def run_loop(self) -> None:
        """mlx-lm's generation loop on this thread, until it stops (stop_loop) or raises."""
        self._generate()  # Private: the loop itself, which only _run_generate runs

    def join_for(self, seconds: float) -> bool:
        """Wait at most `seconds` for the generation thread to end; whether it did.
        A signal may interrupt it and it can be called again: a Thread.join() a
        KeyboardInterrupt cut short can take the thread for ended while it runs."""
        return self.loop_ended.wait(seconds)

    def mark_failed(self) -> None:
        """Generation is over for good: generation_available() says so from now on."""
        self._generation_failed = True  # Private: the flag generation_available() reads

    def stop_loop(self) -> None:
        """The loop ends after its current round (called on the generation thread)."""
        # Private: the flag the loop checks each round; stop_and_join() sets it
        # from another thread, but a close must stop the loop from inside it.
        self._stop = True

    @property
    def loop_stopped(self) -> bool:
        return self._stop

    def _next_request(self, timeout=None):
        # Private: the loop takes every request here, with a timeout only when
        # its batch is empty: the one point where an idle thread may do other work.
        return self.next_request(timeout)

    def take_request(self, timeout=None):
        """mlx-lm's: the next queued request (shared across ranks), or None."""
        return _server.ResponseGenerator._next_request(self, timeout)

    def _tokenize(self, tokenizer, request, args):
        # Private: the loop renders each request here, just before it asks the
        # prompt cache for it: the point where the store's fetch goes.
        return self.tokenize(tokenizer, request, args)

    def render(self, tokenizer, request, args):
        """mlx-lm's rendering of a request: (prompt, segments, kinds, state, vision).
        Reads only `args.chat_template_kwargs` (the HTTP thread calls it too)."""
        return _server.ResponseGenerator._tokenize(self, tokenizer, request, args)

    def check_stop_words(self, tokenizer, stop_words) -> None:
        """Make the request's stop-sequence matcher now (mlx-lm caches it): mlx-lm
        makes it after tokenize, outside the try that fails one request alone."""
        self._make_state_machine(self.model_provider.model_key, tokenizer, stop_words)  # Private: no public maker

    def submit(self, request, generation_args, progress_callback, replies: Queue):
        """mlx-lm's generate() with the response queue given (the caller knows it
        until its last item) and a loop that stopped said as GenerationFailed.
        Restated: generate() makes its own queue, and raises RuntimeError."""
        # Private: what the generation thread puts on a request's queue: its
        # GenerationContext first, then responses, (processed, total) progress,
        # an exception, and None at the end.
        self.requests.put((replies, request, generation_args))

        def _inner():
            while True:
                response = self._await_reply(replies)
                if response is None:
                    break
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                yield response

        ctx = self._await_reply(replies)
        if isinstance(ctx, Exception):
            raise ctx
        return ctx, _inner()

    def _await_reply(self, replies: Queue):
        while True:
            try:
                return replies.get(timeout=1.0)
            except QueueEmpty:
                if not self.generation_available():
                    raise GenerationFailed("generation stopped", 503) from None


# --- the HTTP handler ---------------------------------------------------------------


class _Unwind(BaseException):
    """Raised once a refused request is answered: it passes mlx-lm's `except
    Exception` around generate(), which would answer 404 in a shape of its own."""


class _AnsweringGenerator:
    """The response generator as one completion's handler sees it: a request it
    refuses is answered by `answer(error)`, then unwinds the handler."""

    def __init__(self, generator, answer: Callable[[Exception], None]):
        self._generator, self._answer = generator, answer

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, *args, **kwargs):
        try:
            return self._generator.generate(*args, **kwargs)
        except Exception as e:
            self._answer(e)
        raise _Unwind


class APIHandler(_server.APIHandler):
    """mlx-lm's HTTP handler; subclasses add headers through extra_headers."""

    def extra_headers(self, status_code: int) -> None:
        """Headers of our own on a reply mlx-lm's handler or ours begins."""

    def _set_completion_headers(self, status_code: int = 200):
        # Private: mlx-lm's handler begins every JSON reply here (status, content
        # type, CORS): the one place a header of ours joins its replies.
        super()._set_completion_headers(status_code)
        self.extra_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200):
        # Private: as _set_completion_headers, for an event stream.
        super()._set_stream_headers(status_code)
        self.extra_headers(status_code)

    def start_json_reply(self, status_code: int) -> None:
        """The status line and headers of a JSON reply (end_headers sends them)."""
        self._set_completion_headers(status_code)

    def start_event_stream(self, status_code: int) -> None:
        """The status line and headers of an event stream (end_headers sends them)."""
        self._set_stream_headers(status_code)

    def forget_headers(self) -> None:
        """Drop the status line and headers not yet sent (end_headers not called)."""
        self._headers_buffer = []  # Private (http.server's): where send_response buffers them

    def completion_answering(self, request, stop_words, answer: Callable[[Exception], None]) -> None:
        """mlx-lm's handle_completion, a request the generator refuses answered by
        `answer(error)` rather than with mlx-lm's 404."""
        generator = self.response_generator
        self.response_generator = _AnsweringGenerator(generator, answer)
        try:
            _server.APIHandler.handle_completion(self, request, stop_words)
        except _Unwind:
            pass
        finally:
            self.response_generator = generator


def serve_http(host: str, port: int, generator, server_class, handler_class) -> None:
    """Serve HTTP with `generator` until interrupted (a KeyboardInterrupt shuts
    the server down and stops the generator)."""
    # Private: run() makes its own ResponseGenerator over mlx-lm's LRU cache;
    # _run_http_server is the part that serves a given generator, server and handler.
    _server._run_http_server(host, port, generator, server_class=server_class, handler_class=handler_class)
