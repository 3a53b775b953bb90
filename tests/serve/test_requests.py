"""Tenants and bad requests: API keys keep namespaces apart, and every bad
request gets a 4xx answer with a message while the server keeps serving."""

import httpx
import openai
import pytest

from .conftest import QUESTIONS, SYSTEM, api_keys_file, chat, reference_reply

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
