"""What `promptstore serve` relies on in mlx_lm.server, pinned: these fail
loudly when an mlx-lm release changes the seam (raise the pin in pyproject
only once they pass). The seam is one module, serve/mlx_lm_server.py, which
refuses an mlx-lm outside the pin when it is imported."""

import ast
import importlib.metadata
import inspect
import tomllib
from pathlib import Path

import pytest
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import LRUPromptCache

from promptstore.errors import ServeConfigError
from promptstore.serve.cache import StoreCache
from promptstore.serve.mlx_lm_server import check_version, installed_version, mlx_lm_parser, pinned_range
from promptstore.serve.options import build_parser

ROOT = Path(__file__).resolve().parents[2]

SOURCE = inspect.getsource(mlx_server)


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_mlx_lm_is_the_pinned_release():
    assert importlib.metadata.version("mlx-lm").startswith("0.32.")
    assert installed_version() == importlib.metadata.version("mlx-lm")


def test_the_range_checked_is_the_pin_in_pyproject():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = [d for d in dependencies if d.startswith("mlx-lm")]
    assert len(pinned) == 1
    assert sorted(pinned_range().split(",")) == sorted(pinned[0].removeprefix("mlx-lm").split(","))
    check_version(installed_version(), pinned_range())  # what this environment runs passes


@pytest.mark.parametrize("version", ["0.32.2", "0.32.9", "0.32.10.dev1"])
def test_a_version_within_the_range_is_taken(version):
    check_version(version, ">=0.32.2,<0.33")


@pytest.mark.parametrize("version", ["0.31.3", "0.32.1", "0.33.0", "0.33", "0.33.0rc1", "1.0.0", "unknown"])
def test_a_version_outside_the_range_is_refused_in_one_line_naming_the_range(version):
    with pytest.raises(ServeConfigError) as refused:
        check_version(version, "<0.33,>=0.32.2")  # as the installed metadata writes it
    said = str(refused.value)
    assert "\n" not in said and f"mlx-lm {version} is installed" in said
    assert "supports mlx-lm >=0.32.2,<0.33" in said


def test_a_missing_mlx_lm_is_refused_and_no_pin_checks_nothing():
    with pytest.raises(ServeConfigError, match="mlx-lm is not installed; promptstore serve supports mlx-lm >=0.32.2"):
        check_version(None, ">=0.32.2,<0.33")
    check_version("9.9", None)


def test_only_the_seam_imports_mlx_lm_server():
    """mlx_lm.server (and its names) are imported by serve/mlx_lm_server.py alone:
    every private point it touches is there, each checked by the version range."""
    importing = []
    for path in sorted((ROOT / "promptstore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "mlx_lm.server" or n.startswith("mlx_lm.server.") for n in names):
                importing.append(str(path.relative_to(ROOT)))
    assert sorted(set(importing)) == ["promptstore/serve/mlx_lm_server.py"]


def test_the_prompt_cache_is_used_only_through_methods_the_store_cache_has():
    used = {
        node.attr
        for node in ast.walk(ast.parse(SOURCE))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "prompt_cache"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }
    assert used == {"fetch_nearest_cache", "insert_cache", "trim_to", "nbytes", "stats_by_type"}
    assert "len(self.prompt_cache)" in SOURCE
    for name in ("fetch_nearest_cache", "insert_cache", "trim_to"):
        ours, theirs = inspect.signature(getattr(StoreCache, name)), inspect.signature(getattr(LRUPromptCache, name))
        assert [(p.name, p.kind) for p in ours.parameters.values()][1:] == [
            (p.name, p.kind) for p in theirs.parameters.values()
        ][1:], name
    assert callable(StoreCache.__len__) and isinstance(StoreCache.nbytes, property)


def test_the_classes_and_functions_the_server_builds_on_keep_their_signatures():
    assert _params(mlx_server.ResponseGenerator.__init__) == ["self", "model_provider", "prompt_cache"]
    assert _params(mlx_server.ResponseGenerator._tokenize) == ["self", "tokenizer", "request", "args"]
    assert _params(mlx_server.ResponseGenerator.generate) == ["self", "request", "generation_args", "progress_callback"]
    assert _params(mlx_server.ModelProvider.__init__) == ["self", "cli_args"]
    assert _params(mlx_server.ModelProvider.load) == ["self", "model_path", "adapter_path", "draft_model_path"]
    assert _params(mlx_server.ModelProvider._load) == ["self", "model_path", "adapter_path", "draft_model_path"]
    assert _params(mlx_server.APIHandler.handle_completion) == ["self", "request", "stop_words"]
    assert _params(mlx_server._run_http_server)[:5] == [
        "host",
        "port",
        "response_generator",
        "server_class",
        "handler_class",
    ]
    fields = [f for f in mlx_server.CompletionRequest.__dataclass_fields__]
    assert fields == ["request_type", "prompt", "messages", "tools", "role_mapping"]
    for name in ("prompt", "prompt_cache_count"):
        assert name in mlx_server.GenerationContext.__dataclass_fields__
    for name in ("handle_models_request", "do_GET", "do_POST", "_set_completion_headers"):
        assert callable(getattr(mlx_server.APIHandler, name))
    assert isinstance(mlx_server.ResponseGenerator.is_healthy, property)


def test_tokenize_reads_only_chat_template_kwargs_from_its_args():
    """The HTTP thread measures prompts with mlx-lm's own _tokenize and a stand-in args."""
    tree = ast.parse(inspect.getsource(mlx_server.ResponseGenerator._tokenize).lstrip())
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
    }
    assert read == {"chat_template_kwargs"}


def test_the_prompt_from_tokenize_lives_in_the_generation_context():
    """In-flight requests end when the list _tokenize returned is freed: both
    paths keep it in the request's GenerationContext."""
    for fn in (mlx_server.ResponseGenerator._generate, mlx_server.ResponseGenerator._serve_single):
        src = inspect.getsource(fn)
        assert "self._tokenize(" in src and "prompt=prompt," in src, fn.__name__
        assert "self.prompt_cache.fetch_nearest_cache(" in src and "self.prompt_cache.insert_cache(" in src


def test_every_mlx_lm_server_option_is_a_promptstore_serve_option():
    theirs = {a.dest for a in mlx_lm_parser()._actions}
    ours = build_parser()
    assert theirs <= {a.dest for a in ours._actions}
    assert {"model", "draft_model", "kv_bits", "prompt_cache_bytes", "prefill_step_size"} <= theirs
    help_text = ours.format_help()
    for flag in ("--model", "--draft-model", "--kv-bits", "--store", "--api-keys", "--model-id", "--durability"):
        assert flag in help_text
    args = ours.parse_args(["--model", "m", "--port", "9", "--hot-bytes", "1024", "--api-keys", "k.json"])
    assert (args.model, args.port, args.store_hot_bytes, args.api_keys) == ("m", 9, "1024", "k.json")
    assert mlx_server.argparse.ArgumentParser is __import__("argparse").ArgumentParser  # restored after capture


def test_the_generation_loop_steps_a_batch_under_the_time_budget_it_set_in_init():
    # ArrivalBudget wraps what __init__ assigns to _time_budget, and the loop
    # iterates self._time_budget around batch_generator.next().
    init = inspect.getsource(mlx_server.ResponseGenerator.__init__)
    assert init.index("self.requests = Queue()") < init.index("self._time_budget = TimeBudget()")
    assert init.index("self._time_budget = TimeBudget()") < init.index("self._generation_thread.start()")
    loop = inspect.getsource(mlx_server.ResponseGenerator._generate)
    assert "for _ in self._time_budget:" in loop
    assert loop.index("for _ in self._time_budget:") < loop.index("batch_generator.next()")


def test_the_loop_the_deferred_inserts_hook_into():
    """StoreCache defers a prompt's inserts to the generation loop's next step or
    request, and finished requests' inserts to an idle loop: mlx-lm's loop takes
    requests through _next_request, steps through the time budget, and stores a
    prompt's segments before it hands out the step's tokens (the reason for the
    deferral)."""
    assert _params(mlx_server.ResponseGenerator._next_request) == ["self", "timeout"]
    src = inspect.getsource(mlx_server.ResponseGenerator._generate)
    assert "self._next_request(timeout)" in src and "for _ in self._time_budget:" in src
    segments, tokens = src.index("batch_generator.extract_cache("), src.index("for r in gen_responses:")
    assert segments < tokens
    # Finished requests' inserts wait for an idle loop: it asks with a timeout
    # only when its batch has no request, and comes back when given none.
    flat = "".join(src.split())
    assert "timeout=(Noneif(batch_generatorisnotNoneandlen(batch_results)>0)else0.1)" in flat
    assert "iflen(batch_results)==0:" in flat


def test_every_private_point_the_seam_touches_is_there():
    """serve/mlx_lm_server.py's private points, by name: a release that drops one
    fails here rather than in a running server."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    for name in ("_run_generate", "_generate", "_next_request", "_tokenize", "_make_state_machine"):
        assert callable(getattr(mlx_server.ResponseGenerator, name)), name
    init = inspect.getsource(mlx_server.ResponseGenerator.__init__)
    for name in ("self._stop = False", "self._generation_failed = False", "self._generation_thread = Thread("):
        assert name in init, name
    assert "self._generation_failed" in inspect.getsource(mlx_server.ResponseGenerator.generation_available)
    assert _params(mlx_server.ResponseGenerator._make_state_machine) == ["self", "model_key", "tokenizer", "stop_words"]
    for name in ("_set_completion_headers", "_set_stream_headers"):
        assert _params(getattr(mlx_server.APIHandler, name)) == ["self", "status_code"], name
    # A refusal unwinds past this `except Exception` (which answers 404) with a BaseException.
    handle = inspect.getsource(mlx_server.APIHandler.handle_completion)
    assert "self.response_generator.generate(" in handle and "except Exception as e:" in handle
    assert "self._tokenizer = tokenizer" in inspect.getsource(TokenizerWrapper.__init__)
    assert mlx_server.argparse is __import__("argparse") and "parser.parse_args()" in inspect.getsource(mlx_server.main)
