"""The generation thread survives any one request: a request that fails inside
generation fails alone, a loop that fails anyway is started again (its requests
in flight fail with it, later ones are served), and after too many failures in
a row it stops for good, /health says so and the server exits for a supervisor.
In process, with the server's own generator and a real model and store."""

from __future__ import annotations

import time

import pytest
from mlx_lm import server as mlx_server

from promptstore import PromptStore
from promptstore.errors import GenerationFailed
from promptstore.serve.apis.chat import ChatRequest
from promptstore.serve.checks import StoreRequest
from promptstore.serve.loop import RESTARTS, StoreResponseGenerator
from promptstore.serve.options import build_parser, store_settings
from promptstore.serve.provider import StoreModelProvider
from promptstore.serve.server import store_cache
from promptstore.serve.tenants import KeyRing

from .conftest import QUESTIONS, SYSTEM, reference_reply

MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]


@pytest.fixture
def generator(model_dir, tmp_path):
    """A started StoreResponseGenerator over a real store (closed at the end)."""
    args = build_parser().parse_args(["--model", str(model_dir("llama")), "--store", str(tmp_path / "store")])
    store = PromptStore.open(args.store, **store_settings(args))
    keyring = KeyRing(None)
    cache = store_cache(store, args, keyring)  # as the server makes it
    gen = StoreResponseGenerator(StoreModelProvider(args, cache), cache, keyring)
    deadline = time.monotonic() + 120
    while not gen.model_provider.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gen.model_provider.ready
    yield gen
    gen.stop_and_join()
    store.close()


def reply(gen, messages=MESSAGES, stop=()) -> list[int]:
    """Greedy tokens of a chat request sent straight to the generator (no door)."""
    chat = ChatRequest("default_model", messages, None, 6, list(stop), False, {"temperature": 0.0})
    request = StoreRequest(**vars(chat.completion_request()))
    ctx, responses = gen.generate(request, chat.generation_arguments(gen.cli_args))
    try:
        return [r.token for r in responses]
    finally:
        ctx.stop()


def test_a_request_that_fails_in_generation_fails_alone(generator, model_dir):
    with pytest.raises((TypeError, ValueError)):  # a stop word that is not a string, past the door
        reply(generator, stop=[123])
    assert generator.health()[0] == 200 and not generator.restarts
    assert reply(generator) == reference_reply(model_dir("llama"), MESSAGES, 6)


def test_a_failed_loop_fails_its_requests_and_starts_again(generator, model_dir, monkeypatch):
    real = mlx_server.BatchGenerator.next
    failures = iter([RuntimeError("a fault in a batch step")])

    def next_step(self):
        fault = next(failures, None)
        if fault is not None:
            raise fault
        return real(self)

    monkeypatch.setattr(mlx_server.BatchGenerator, "next", next_step)
    with pytest.raises(GenerationFailed, match="a fault in a batch step") as failed:
        reply(generator)
    assert failed.value.status == 500
    status, body = generator.health()
    assert status == 200 and body["generation_restarts"] == 1
    assert reply(generator) == reference_reply(model_dir("llama"), MESSAGES, 6)


def test_too_many_failures_stop_generation_and_the_server_exits(generator, monkeypatch):
    exits = []
    monkeypatch.setattr(generator, "exit_for_supervisor", lambda: exits.append(time.monotonic()))

    def next_step(self):
        raise RuntimeError("a fault in every batch step")

    monkeypatch.setattr(mlx_server.BatchGenerator, "next", next_step)
    for _ in range(RESTARTS + 1):
        with pytest.raises(GenerationFailed):
            reply(generator)
    status, body = generator.health()
    assert status == 503 and body["exiting"] and "every batch step" in body["error"]
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)  # the generation thread says why before it asks to exit
    assert len(exits) == 1
    with pytest.raises(GenerationFailed, match="generation stopped"):
        reply(generator)
