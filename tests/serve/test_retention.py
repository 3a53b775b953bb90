"""Retention on a real `promptstore serve`, through the official SDKs: Anthropic's
cache_control ttl per marked block and per request, OpenAI's prompt_cache_retention
and prompt_cache_key on chat completions and responses. What the store kept is read
from /metrics and, after a clean stop, from the store's own records (a retained
node's class and time are written with it); in_memory leaves nothing on disk.
Expiry itself is tested against a controlled clock in tests/store/test_retention.py."""

from __future__ import annotations

import time

import anthropic
import openai
import pytest

from promptstore import PromptStore

from .api_clients import anthropic_client, conversation_length
from .conftest import QUESTIONS, SYSTEM
from .test_metrics import scrape, value

MAX_TOKENS = 6
WAIT_S = 60.0


def settled(server, name: str, at_least: float, **labels) -> dict:
    """A scrape once `name` reaches `at_least` (a reply's insert runs after its
    response is sent), or the last one after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        m = scrape(server)
        if value(m, name, **labels) >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def records(store_path) -> list:
    """(start, end, retention, keep_until, file) of every node of the store."""
    with PromptStore.open(store_path) as store:
        return sorted(
            (n.start, n.end, n.record.retention, n.record.keep_until, n.record.file)
            for ns in store.index.namespaces()
            for n in store.index.iter_nodes(ns)
        )


def test_cache_control_ttls_keep_each_marked_prefix_for_its_ttl(serve, model_dir):
    """The system block marked 1h, the question marked with no ttl (5m): the prefix
    to the system block's end is kept an hour, the rest of the prompt five
    minutes, the reply by the budgets alone; each mark is a node boundary."""
    model = model_dir("llama")
    server = serve(model)
    client = anthropic_client(server)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    question = [{"type": "text", "text": QUESTIONS[0], "cache_control": {"type": "ephemeral"}}]
    client.messages.create(
        model="default_model", max_tokens=MAX_TOKENS, system=system, messages=[{"role": "user", "content": question}]
    )
    m = settled(server, "promptstore_retained_nodes", 1, retention="1h")
    assert value(m, "promptstore_retention_requests_total", model=server_model(m), retention="1h") == 1
    assert value(m, "promptstore_retention_requests_total", model=server_model(m), retention="5m") == 1
    assert value(m, "promptstore_retained_nodes", retention="5m") >= 1
    assert server.stop() == 0

    system_end = conversation_length(model, [{"role": "system", "content": SYSTEM}])
    question_end = conversation_length(
        model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    )
    nodes = records(server.store)
    now = time.time()
    assert {end for _, end, *_ in nodes} >= {system_end, question_end}
    for _, end, retention, keep_until, file in nodes:
        assert file is not None
        if end <= system_end:
            assert retention == "1h" and keep_until > now + 300
        elif end <= question_end:
            assert retention == "5m" and keep_until > now
        else:
            assert retention is None and keep_until is None  # the reply: nobody marked it


def server_model(samples: dict) -> str:
    """The model label of the server's request metrics."""
    return next(dict(labels)["model"] for name, labels in samples if name == "promptstore_requests_total")


def test_the_requests_own_cache_control_keeps_prompt_and_reply(serve, model_dir):
    server = serve(model_dir("llama"))
    client = anthropic_client(server)
    client.messages.create(
        model="default_model",
        max_tokens=MAX_TOKENS,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        cache_control={"type": "ephemeral", "ttl": "1h"},
    )
    settled(server, "promptstore_retention_requests_total", 1, model=model_label(server), retention="1h")
    assert server.stop() == 0
    nodes = records(server.store)
    assert len(nodes) >= 2 and all(retention == "1h" for _, _, retention, _, _ in nodes)


def model_label(server) -> str:
    return server_model(scrape(server))


def test_prompt_cache_retention_24h_is_written_with_its_time_and_in_memory_never_is(serve, model_dir, tmp_path):
    model = model_dir("llama")
    server = serve(model, store=tmp_path / "kept")
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    client.chat.completions.create(
        model="default_model",
        messages=messages,
        max_tokens=MAX_TOKENS,
        prompt_cache_retention="24h",
        prompt_cache_key="librarian",
    )
    label = model_label(server)
    m = settled(server, "promptstore_retained_nodes", 1, retention="24h")
    assert value(m, "promptstore_retention_requests_total", model=label, retention="24h") == 1
    assert value(m, "promptstore_prompt_cache_key_requests_total", model=label) == 1
    assert server.stop() == 0
    nodes = records(server.store)
    assert nodes and all(r == "24h" and until > time.time() + 3600 and file for _, _, r, until, file in nodes)

    # in_memory, on a server that writes every node as it is stored (write_through, its default).
    server = serve(model, store=tmp_path / "private")
    client = server.client()
    client.responses.create(
        model="default_model",
        instructions=SYSTEM,
        input=QUESTIONS[2],
        max_output_tokens=MAX_TOKENS,
        prompt_cache_retention="in_memory",
    )
    r = client.responses.create(  # the next request restores it from memory
        model="default_model", instructions=SYSTEM, input=QUESTIONS[2], max_output_tokens=MAX_TOKENS
    )
    assert r.usage.input_tokens_details.cached_tokens > 0
    label = model_label(server)
    m = settled(server, "promptstore_retention_requests_total", 1, model=label, retention="none")
    assert value(m, "promptstore_retention_requests_total", model=label, retention="in_memory") == 1
    assert value(m, "promptstore_retained_nodes", retention="in_memory") >= 1
    assert value(m, "promptstore_disk_files_written_total") == 0
    assert server.stop() == 0
    assert not list((server.store / "cold").rglob("*.safetensors"))


BAD_OPENAI = [
    ({"prompt_cache_retention": "2h"}, "prompt_cache_retention", "prompt_cache_retention must be 'in_memory' or '24h'"),
    ({"prompt_cache_retention": 24}, "prompt_cache_retention", "prompt_cache_retention must be"),
    ({"prompt_cache_key": 7}, "prompt_cache_key", "prompt_cache_key must be a string"),
    ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key", "prompt_cache_key must be at most 1024 characters"),
    ({"prompt_cache_key": ""}, "prompt_cache_key", "prompt_cache_key must be a non-empty string"),
]


def test_bad_retention_fields_get_a_400_naming_the_field(serve, model_dir):
    server = serve(model_dir("llama"))
    client = server.client()
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    for change, param, message in BAD_OPENAI:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="default_model", messages=messages, max_tokens=2, extra_body=change)
        assert refused.value.body["param"] == param and message in refused.value.body["message"], refused.value.body
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="default_model", input=QUESTIONS[0], max_output_tokens=2, extra_body=change)
        assert refused.value.body["param"] == param and message in refused.value.body["message"], refused.value.body
    anthropic_ = anthropic_client(server)
    bad_block = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_.messages.create(model="default_model", max_tokens=2, system=bad_block, messages=messages)
    said = refused.value.body["error"]["message"]
    assert said == "system.0.cache_control.ttl must be '5m' or '1h', got a string \"2h\"", said
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_.messages.create(
            model="default_model", max_tokens=2, messages=messages, cache_control={"type": "ephemeral", "ttl": 3600}
        )
    assert refused.value.body["error"]["message"] == "cache_control.ttl must be '5m' or '1h', got 3600"
    m = scrape(server)
    assert value(m, "promptstore_requests_total", model=server_model(m)) == 0  # refused before anything ran
