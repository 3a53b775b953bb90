"""--warm-prompts: a deployment's system prompt prefilled and stored at start, so
the first conversation restores it, replies equal a full prefill's, and a
restart finds it stored; a bad file stops the start with one line."""

import json
import subprocess
import sys

import pytest

from promptstore.errors import ServeConfigError
from promptstore.serve.known_prompts import load_known_prompts, shared_tokens
from promptstore.testing.tokenizer import demo_tokenizer

from .conftest import QUESTIONS, SYSTEM, chat, loaded, reference_reply


def test_the_shared_tokens_begin_every_prompt_that_starts_with_the_messages():
    tok = demo_tokenizer(1024)
    system = [{"role": "system", "content": SYSTEM}]
    shared = shared_tokens(tok, system, {})
    assert len(shared) > 10
    for question in QUESTIONS:
        prompt = tok.apply_chat_template([*system, {"role": "user", "content": question}], add_generation_prompt=True)
        assert prompt[: len(shared)] == shared


@pytest.mark.parametrize(
    "content,says",
    [
        ("not json", "is not JSON"),
        ("{}", "must hold a JSON list"),
        ("[]", "must hold a JSON list"),
        ('[{"role": "system", "content": "x"}]', "prompt 0 is not a non-empty list"),
        ('[[{"role": "boss", "content": "x"}]]', "prompt 0, message 0"),
        ('[[{"role": "system", "content": 3}]]', "prompt 0, message 0"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path, content, says):
    path = tmp_path / "warm.json"
    path.write_text(content)
    with pytest.raises(ServeConfigError, match=says):
        load_known_prompts(path)


def test_a_bad_file_stops_the_server_with_one_line(tmp_path, model_dir):
    path = tmp_path / "warm.json"
    path.write_text("[1, 2]")
    cmd = [sys.executable, "-m", "promptstore", "serve", "--model", str(model_dir("llama"))]
    cmd += ["--store", str(tmp_path / "store"), "--port", "0", "--warm-prompts", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("promptstore serve: error: the warm prompts file") and "Traceback" not in r.stderr


def test_the_first_conversation_restores_the_warm_prompt(serve, model_dir, tmp_path):
    model = model_dir("llama")
    system = [{"role": "system", "content": SYSTEM}]
    path = tmp_path / "warm.json"
    path.write_text(json.dumps([system]))
    _, tokenizer = loaded(model)
    shared = len(shared_tokens(tokenizer, system, {}))
    server = serve(model, "--warm-prompts", str(path))
    messages = [*system, {"role": "user", "content": QUESTIONS[0]}]
    _, ids, cached = chat(server.client(), messages)
    assert cached >= shared - 1  # the first request of the first conversation
    assert ids == reference_reply(model, messages, 12)
    assert f"{shared} tokens prefilled and stored" in server.log()
    assert server.stop() == 0
    again = serve(model, "--warm-prompts", str(path), store=server.store)
    assert "0 tokens prefilled and stored, 1 found stored" in again.log()
    _, ids, cached = chat(again.client(), [*system, {"role": "user", "content": QUESTIONS[1]}])
    assert cached >= shared - 1
    assert ids == reference_reply(model, [*system, {"role": "user", "content": QUESTIONS[1]}], 12)


def test_a_prompt_the_template_cannot_render_is_skipped_not_fatal(tmp_path):
    """A template that raises on these messages: the prompt is skipped with a warning, the rest stored."""
    from promptstore import PromptStore
    from promptstore.serve.cache import StoreCache
    from promptstore.serve.known_prompts import store_known_prompts
    from promptstore.testing.models import tiny_model

    class Refusing:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def apply_chat_template(self, messages, **kwargs):
            if any(m["content"] == "refused" for m in messages):
                raise ValueError("this template takes no such message")
            return self.inner.apply_chat_template(messages, **kwargs)

    tok = demo_tokenizer(1024)
    model = tiny_model("llama", vocab_size=1024)
    with PromptStore.open(tmp_path / "store") as store:
        cache = StoreCache(store, model_id="m")
        cache.attach(model, Refusing(tok), None, ("m", None, None), prefill_step=64)
        line = store_known_prompts(
            cache, [[{"role": "system", "content": "refused"}], [{"role": "system", "content": SYSTEM}]], {}
        )
        assert "1 skipped" in line and "0 found stored" in line
        shared = shared_tokens(tok, [{"role": "system", "content": SYSTEM}], {})
        assert cache.spaces(cache.tenants[0])[0].restorable_length(shared) == len(shared)
