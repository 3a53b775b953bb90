"""Tenants and bad requests: API keys keep namespaces apart, and every bad
request gets a 4xx answer with a message while the server keeps serving."""

import time

import httpx
import openai
import pytest

from .conftest import QUESTIONS, SYSTEM, api_keys_file, chat, reference_reply, rendered_length

SALTS = {"key-alice": "salt-of-alice-7f3a", "key-bob": "salt-of-bob-91c2"}


def test_two_api_keys_never_hit_each_other(serve, model_dir, tmp_path):
    model = model_dir("llama")
    server = serve(model, "--api-keys", str(api_keys_file(tmp_path / "keys.json", SALTS)))
    alice, bob = server.client("key-alice"), server.client("key-bob")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    _, ids, cached = chat(alice, messages)
    assert cached == 0 and ids == reference_reply(model, messages, 12)
    assert chat(alice, messages)[2] > 0  # alice hits her own
    _, ids, cached = chat(bob, messages)
    assert cached == 0 and ids == reference_reply(model, messages, 12)  # 0 hits across tenants
    assert chat(bob, messages)[2] > 0
    with pytest.raises(openai.AuthenticationError, match="API key"):
        chat(server.client("key-mallory"), messages)
    with httpx.Client(trust_env=False, timeout=30) as http:  # no Authorization header at all
        r = http.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert http.get(server.url + "/v1/models").status_code == 401
        assert http.get(server.url + "/health").status_code == 200
    assert server.stop() == 0


def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(serve, model_dir):
    model = model_dir("llama")
    server = serve(model, "--max-prompt-tokens", "64")
    client = server.client()
    short = [{"role": "user", "content": "Hello there."}]

    def still_serving():
        assert server.health() == 200
        _, ids, _ = chat(client, short, max_tokens=4)
        assert ids == reference_reply(model, short, 4)

    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="someone/other-model", messages=short, max_tokens=4)
    still_serving()
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.post(
            server.url + "/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        models = http.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(model.resolve())]
    still_serving()
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        chat(client, [{"role": "user", "content": " ".join(QUESTIONS * 4)}])
    still_serving()
    for prompt, message in (
        ([1, 2, 512], "outside the vocabulary"),
        ([5, -1], "outside the vocabulary"),
        ([], "empty"),
        ([[1, 2]], "list of token ids"),
        ([1] * 65, "at most 64"),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model="default_model", prompt=prompt, max_tokens=4)
        still_serving()
    # Token ids within the vocabulary are a prompt like any other.
    tokens = [1, 40, 41, 42, 43]
    r = client.completions.create(model="default_model", prompt=tokens, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(tokens) and r.choices[0].text is not None
    assert (
        client.completions.create(
            model="default_model", prompt=tokens, max_tokens=4
        ).usage.prompt_tokens_details.cached_tokens
        == 4
    )


def test_max_tokens_past_the_context_is_refused_or_capped_and_the_reply_says_which(serve, model_dir):
    model = model_dir("llama-ctx64")  # a context of 64 positions
    server = serve(model, "--max-tokens-limit", "24")
    messages = [{"role": "user", "content": "Hello there."}]
    prompt = rendered_length(model, messages) + 1  # with the generation prompt's tokens, at least
    with httpx.Client(trust_env=False, timeout=60) as http:
        r = http.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "at most 64 (the model's context)" in r.json()["error"]["message"]
        body = {"messages": messages, "max_tokens": 60, "temperature": 0}
        r = http.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["X-Max-Tokens-Capped"] == "60 -> 24 (--max-tokens-limit)"
        assert r.json()["usage"]["completion_tokens"] <= 24
        r = http.post(server.url + "/v1/responses", json={"input": "Hello there.", "max_output_tokens": 60})
        assert r.status_code == 200 and r.headers["X-Max-Tokens-Capped"].startswith("60 -> 24")
    quiet = serve(model, store=server.store)  # no limit: the context caps what the prompt leaves
    with httpx.Client(trust_env=False, timeout=60) as http:
        r = http.post(quiet.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 64})
        assert r.status_code == 200, r.text
        capped = r.headers["X-Max-Tokens-Capped"]
        assert capped.startswith("64 -> ") and "the model's context of 64 less the prompt" in capped
        assert r.json()["usage"]["completion_tokens"] <= 64 - prompt
        small = {"messages": messages, "max_tokens": 4}
        assert "X-Max-Tokens-Capped" not in http.post(quiet.url + "/v1/chat/completions", json=small).headers


def test_a_10_mb_prompt_is_refused_before_it_is_tokenized(serve, model_dir):
    """Within the default body limit (32 MiB), but past the prompt limit: counted
    in pieces, it is refused long before the 15-24 s a whole tokenization took."""
    server = serve(model_dir("llama"), "--max-prompt-tokens", "256")
    text = "Hello there, how are you? " * 400_000
    with httpx.Client(trust_env=False, timeout=60) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
            ("/v1/completions", {"prompt": text, "max_tokens": 2}),
            ("/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
        ):
            started = time.monotonic()
            r = http.post(server.url + path, json=body)
            assert r.status_code == 400 and "more than 256 tokens" in r.text, r.text[:300]
            assert time.monotonic() - started < 2.0  # reading 10 MB included
        assert http.get(server.url + "/health").status_code == 200
