"""/metrics and /health of a real server. The metrics parse with prometheus_client's
own parser; after a miss, a hot hit, a restart and a cold hit the counters equal
what the responses reported; with API keys only the operator's key reads them and
a tenant's requests change nothing another tenant can read; --no-metrics is a 404;
/health says loading, warming (while serving) and ok."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from promptstore.errors import ServeConfigError
from promptstore.serve.metrics import MetricsAccess, load_metrics_key
from promptstore.serve.tenants import KeyRing, load_api_keys

from .conftest import QUESTIONS, SYSTEM, Server, api_keys_file
from .test_lifecycle import _fill

SALTS = {"key-alice": "salt-of-alice-7f3a", "key-bob": "salt-of-bob-91c2"}
OPERATOR = "operator-key-5d1e"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
SOURCES = ("hot", "cold", "remote", "computed")


@dataclass
class Usage:
    prompt: int
    cached: int
    completion: int


def complete(client, messages=MESSAGES, max_tokens: int = 6) -> Usage:
    r = client.chat.completions.create(model="default_model", messages=messages, max_tokens=max_tokens, temperature=0)
    return Usage(r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens)


def get(server: Server, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.get(server.url + path, headers=headers)


def scrape(server: Server, key: str | None = None) -> dict:
    """{(sample name, frozenset of labels): value}, parsed by prometheus_client's own parser."""
    r = get(server, "/metrics", key)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def written(server: Server, seconds: float = 30) -> dict:
    """A scrape once every stored node is on disk: mlx_lm.server stores a reply's
    tokens after the response is sent, so the last node may still be spilling
    when the client has its answer."""
    deadline = time.monotonic() + seconds
    while True:
        m = scrape(server)
        on_disk = value(m, "promptstore_disk_written_bytes_total") >= value(m, "promptstore_stored_bytes")
        if on_disk or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_counters_equal_what_the_responses_reported_across_a_restart(serve, model_dir):
    model = model_dir("llama")
    # After the restart, the hit is read from disk; write_through: every node goes to disk
    # (the default, admit, would keep the one-off's nodes in memory only).
    options = ("--warm-start", "false", "--cold-plan", "load", "--durability", "write_through")
    server = serve(model, *options)
    label = {"model": str(model.resolve())}
    miss, hot = complete(server.client()), complete(server.client())
    assert miss.cached == 0 and hot.cached > 0
    m = written(server)
    assert value(m, "promptstore_requests_total", **label) == 2
    assert value(m, "promptstore_request_hits_total", **label) == 1
    assert value(m, "promptstore_prompt_tokens_total", **label) == miss.prompt + hot.prompt
    restored = {s: value(m, "promptstore_restored_tokens_total", **label, source=s) for s in SOURCES}
    assert restored == {"hot": hot.cached, "cold": 0, "remote": 0, "computed": 0}
    assert value(m, "promptstore_prefilled_tokens_total", **label) == miss.prompt + hot.prompt - hot.cached
    assert value(m, "promptstore_generated_tokens_total", **label) == miss.completion + hot.completion
    assert value(m, "promptstore_time_to_first_token_seconds_count", **label) == 2
    assert value(m, "promptstore_restore_seconds_count", **label, tier="hot") == 1
    assert value(m, "promptstore_restore_seconds_count", **label, tier="cold") == 0
    assert value(m, "promptstore_restore_bytes_total", **label, tier="hot") > 0
    assert value(m, "promptstore_disk_written_bytes_total") >= value(m, "promptstore_stored_bytes") > 0
    assert value(m, "promptstore_quarantined_files_total") == 0
    assert ("promptstore_warm_start_nodes", frozenset()) not in m  # no warm start ran
    assert server.stop() == 0

    server = serve(model, *options, store=server.store)
    cold = complete(server.client())
    assert cold.cached > 0
    m = scrape(server)
    assert value(m, "promptstore_requests_total", **label) == 1  # a new process counts afresh
    restored = {s: value(m, "promptstore_restored_tokens_total", **label, source=s) for s in SOURCES}
    assert restored == {"hot": 0, "cold": cold.cached, "remote": 0, "computed": 0}
    assert value(m, "promptstore_restore_seconds_count", **label, tier="cold") == 1
    assert 0 < value(m, "promptstore_restore_bytes_total", **label, tier="cold") <= value(m, "promptstore_stored_bytes")
    read_back = value(m, "promptstore_disk_read_back_bytes_total")
    assert read_back == value(m, "promptstore_restore_bytes_total", **label, tier="cold")  # what the cold hit read
    assert value(m, "promptstore_admitted_total", reason="tick") == 0  # write_through admits nothing: it writes all
    assert value(m, "promptstore_write_amplification") == value(m, "promptstore_disk_written_bytes_total") / read_back
    assert get(server, "/health").json() == {"status": "ok", "model_loaded": True, "generation_restarts": 0}
    assert server.stop() == 0


def test_only_the_operators_key_reads_metrics_and_a_tenant_learns_nothing_of_another(serve, model_dir, tmp_path):
    model = model_dir("llama")
    keys = api_keys_file(tmp_path / "keys.json", SALTS)
    (tmp_path / "metrics.key").write_text(OPERATOR + "\n")
    server = serve(model, "--api-keys", str(keys), "--metrics-key-file", str(tmp_path / "metrics.key"))

    def seen_by(key: str) -> list:
        """All that a key's holder reads without a completion of its own."""
        models = get(server, "/v1/models", key).json()["data"]
        metrics = get(server, "/metrics", key)
        return [
            (metrics.status_code, metrics.text),
            get(server, "/health", key).json(),
            [m["id"] for m in models],
        ]

    before = seen_by("key-bob")
    alice = [complete(server.client("key-alice")) for _ in range(2)]
    assert alice[1].cached > 0
    assert seen_by("key-bob") == before  # alice's requests change nothing bob can read
    assert before[0][0] == 403 and "operator's key" in before[0][1]
    assert before[1] == {
        "status": "ok",
        "model_loaded": True,
        "generation_restarts": 0,
        "warm_start": {"done": True},
    }  # no figures
    for key in (None, "key-mallory", OPERATOR + "x"):
        assert get(server, "/metrics", key).status_code == 401
    assert get(server, "/metrics", "key-alice").status_code == 403

    m = scrape(server, OPERATOR)
    label = str(model.resolve())
    assert value(m, "promptstore_tenant_requests_total", model=label, tenant="tenant-1") == 2
    assert value(m, "promptstore_tenant_requests_total", model=label, tenant="tenant-2") == 0
    assert value(m, "promptstore_tenant_restored_tokens_total", model=label, tenant="tenant-1") == alice[1].cached
    assert value(m, "promptstore_tenant_restored_tokens_total", model=label, tenant="tenant-2") == 0
    text = get(server, "/metrics", OPERATOR).text
    assert not any(secret in text for secret in (*SALTS, *SALTS.values(), OPERATOR))
    assert server.stop() == 0


SHORT = [{"role": "user", "content": "Hello there."}]
WRONG_SHAPES = [
    ({"messages": "Hello there."}, 'messages must be a list, got a string "Hello there."'),
    ({"messages": []}, "messages must be a non-empty list, got an empty list"),
    ({"messages": ["Hello", 3]}, 'messages[0] must be an object, got a string "Hello"'),
    ({"messages": [{"content": "Hello"}]}, "messages[0].role is required"),
    ({"messages": [{"role": "wizard", "content": "Hello"}]}, "messages[0].role must be 'system', 'developer', 'user'"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content must be a string or a list, got 7"),
    (
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": [{"type": "text", "text": "hear"}, {"type": "audio", "audio": "AAAA"}]},
            ]
        },
        "messages[2].content[1].type must be 'text', 'image_url', 'input_image' or 'image', got a string \"audio\"",
    ),
    ({"messages": [{"role": "user", "content": ["Hello"]}]}, "messages[0].content[0] must be an object, got a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text must"),
    ({"messages": SHORT, "max_tokens": "12"}, 'max_tokens must be an integer, got a string "12"'),
    ({"messages": SHORT, "max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"messages": SHORT, "max_tokens": True}, "max_tokens must be an integer, got true"),
    ({"messages": SHORT, "max_completion_tokens": 0}, "max_completion_tokens must be at least 1, got 0"),
    ({"max_tokens": 4}, "messages is required"),
]


def test_requests_of_the_wrong_shape_get_a_400_naming_the_field_and_metrics_off_is_404(serve, model_dir):
    model = model_dir("llama")
    server = serve(model, "--no-metrics")
    with httpx.Client(trust_env=False, timeout=60) as http:
        for body, message in WRONG_SHAPES:
            r = http.post(server.url + "/v1/chat/completions", json=body)
            error = r.json()["error"]
            assert r.status_code == 400 and message in error["message"], (body, r.text)
            assert error["type"] == "invalid_request_error" and message.startswith(error["param"]), error
            assert "object has no attribute" not in r.text
        r = http.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": "4"})
        assert r.status_code == 400 and "max_tokens must be an integer" in r.json()["error"]["message"]
    client = server.client()  # the official client sends these shapes as they are
    with pytest.raises(openai.BadRequestError, match=r"content\[0\]\.type must be"):
        client.chat.completions.create(
            model="default_model",
            messages=[
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
            ],
            max_tokens=4,
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer"):
        client.chat.completions.create(model="default_model", messages=SHORT, max_tokens="4")
    assert complete(client, SHORT, 4).completion > 0  # still serving, and nothing was queued for the bad ones
    r = get(server, "/metrics")
    assert r.status_code == 404 and "--no-metrics" in r.json()["error"]["message"]
    assert server.stop() == 0


def test_health_says_loading_then_warming_while_serving_then_ok(model_dir, tmp_path):
    model = model_dir("llama")
    store = tmp_path / "store"
    _fill(model, store, nodes=3000, tokens=64)  # many small files: a warm start of a second or more
    # Nothing else at start (no warm-up, no heap to touch): the warm start outlasts the model's load.
    server = Server(
        model, store, tmp_path / "health.log", "--model-id", "m", "--no-kernel-warm-up", "--heap-reserve", "0"
    )
    server.launch()
    seen, served_while_warming = [], None
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(trust_env=False, timeout=10) as http:
            while time.monotonic() < deadline and (not seen or seen[-1][1]["status"] != "ok"):
                assert server.proc.poll() is None, server.log()[-3000:]
                try:
                    r = http.get(server.url + "/health")
                except httpx.TransportError:
                    time.sleep(0.02)  # not listening yet
                    continue
                if not seen or seen[-1] != (r.status_code, r.json()):
                    seen.append((r.status_code, r.json()))
                if r.json()["status"] == "warming" and served_while_warming is None:
                    served_while_warming = complete(server.client(), SHORT, 2)
                time.sleep(0.02)
        assert server.stop() == 0
    finally:
        server.kill()
    statuses = [body["status"] for _, body in seen]
    assert statuses == sorted(statuses, key=["loading", "warming", "ok"].index), seen  # never back
    assert all((code == 503) == (body["status"] == "loading") for code, body in seen), seen
    assert "warming" in statuses and served_while_warming is not None, seen
    warming = next(body for _, body in seen if body["status"] == "warming")
    assert warming["model_loaded"] and warming["warm_start"]["done"] is False
    done = seen[-1][1]
    assert done["status"] == "ok" and done["warm_start"]["done"] is True
    assert done["warm_start"]["nodes"] == done["warm_start"]["planned_nodes"] >= 3000  # splits add nodes


def test_the_metrics_key_is_the_operators_alone(tmp_path):
    keyring = KeyRing(load_api_keys(api_keys_file(tmp_path / "keys.json", SALTS)))
    (tmp_path / "tenant.key").write_text("key-bob")
    with pytest.raises(ServeConfigError, match="also a tenant's API key"):
        load_metrics_key(tmp_path / "tenant.key", keyring)
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ServeConfigError, match="must hold one key"):
        load_metrics_key(tmp_path / "empty.key", keyring)
    with pytest.raises(ServeConfigError, match="cannot read"):
        load_metrics_key(tmp_path / "absent.key", keyring)
    # With API keys and no operator key, nobody reads /metrics; without either, anyone.
    closed = MetricsAccess(True, None, keyring)
    assert [closed.refusal(a)[0] for a in (None, "Bearer key-alice", "Bearer x")] == [403, 403, 403]
    assert MetricsAccess(True, None, KeyRing(None)).refusal(None) is None


def test_a_tenants_key_as_the_metrics_key_is_one_line_and_status_2(model_dir, tmp_path):
    keys = api_keys_file(tmp_path / "keys.json", SALTS)
    (tmp_path / "metrics.key").write_text("key-alice")
    cmd = [sys.executable, "-m", "promptstore", "serve", "--model", str(model_dir("llama")), "--store", str(tmp_path)]
    cmd += ["--api-keys", str(keys), "--metrics-key-file", str(tmp_path / "metrics.key")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"promptstore serve: error: the key in {tmp_path / 'metrics.key'} is also a tenant's API key (--api-keys): "
        "give /metrics a key of its own"
    ]
