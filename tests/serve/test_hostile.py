"""Hostile requests against a real server: every case of promptstore.testing.hostile
gets its status in its API's error shape, naming its field, and generated bodies get
200 or a 4xx (never a 5xx or a dropped connection), while ordinary requests go on."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import anthropic
import httpx
import openai
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from promptstore.testing import hostile
from promptstore.testing.hostile import BASE, CHAT, COMPLETIONS, COUNT_TOKENS, HELLO, MESSAGES, RESPONSES

from .api_clients import anthropic_client
from .conftest import chat, reference_reply

TIMEOUT_S = 30.0  # every request; an answer takes well under a second here
EXAMPLES = 120  # generated bodies per endpoint (200 before the suite made room for tests/vision)
MAX_TIMEOUTS = 3  # requests left unanswered before the property test gives up on the server
CLIENT_PATHS = (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES)  # the paths official clients send to


def openai_client(server) -> openai.OpenAI:
    http = httpx.Client(trust_env=False, timeout=TIMEOUT_S)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, http_client=http)


def via_client(server, case: hostile.Case) -> tuple[int, object]:
    """(status, JSON body) of a case sent through its API's official client: the base
    body's required fields as arguments, and the whole body again as extra_body (which
    wins), so the client sends the bad value as it is."""
    body = {**BASE[case.path], **case.body}
    try:
        if case.path in (MESSAGES, COUNT_TOKENS):
            with anthropic_client(server) as client:
                if case.path == MESSAGES:
                    # max_tokens as an argument stays small: the client would refuse a huge
                    # one itself (it estimates the time); extra_body sends the real one.
                    client.messages.create(model="m", max_tokens=4, messages=HELLO, extra_body=body, timeout=TIMEOUT_S)
                else:
                    client.messages.count_tokens(model="m", messages=HELLO, extra_body=body, timeout=TIMEOUT_S)
        else:
            with openai_client(server) as client:
                if case.path == CHAT:
                    client.chat.completions.create(model="m", messages=HELLO, extra_body=body)
                elif case.path == COMPLETIONS:
                    client.completions.create(model="m", prompt="", extra_body=body)
                else:
                    client.responses.create(model="m", input="", extra_body=body)
        return 200, None
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        try:
            return e.status_code, e.response.json()
        except ValueError:
            return e.status_code, None


def send(server, case: hostile.Case) -> tuple[int, object, float]:
    """A case through the official client where one can send it (a dict body with the
    usual headers), else through httpx or a raw socket."""
    if isinstance(case.body, dict) and not case.headers and not case.no_length and case.path in CLIENT_PATHS:
        started = time.perf_counter()
        status, body = via_client(server, case)
        return status, body, time.perf_counter() - started
    return hostile.send(server.url, case, timeout=TIMEOUT_S)


def judged(case: hostile.Case, status: int, body, seconds: float) -> list[str]:
    """What is wrong with a case's answer."""
    problems = []
    if not case.expects(status):
        problems.append(f"status {status}, not {case.status}: {json.dumps(body)[:300]}")
    elif status >= 400 and (problem := hostile.shape_problem(case.path, status, body, case.field)):
        problems.append(problem)
    if case.expects(413) and seconds >= 1.0:
        problems.append(f"answered in {seconds:.2f} s (a body over --max-body-bytes: under 1 s)")
    return problems


def serving_problem(server, client, expected: list[int]) -> str | None:
    """None while /health is 200 and an ordinary greedy request gets the reference reply."""
    if server.proc.poll() is not None:
        return f"the server exited ({server.proc.returncode})"
    try:
        if (health := server.health()) != 200:
            return f"/health {health}"
        _, ids, _ = chat(client, HELLO, max_tokens=4)
    except Exception as e:  # noqa: BLE001 - reported
        return f"the ordinary request failed: {type(e).__name__}: {e}"
    return None if ids == expected else f"the ordinary reply {ids} is not {expected}"


def test_every_hostile_case_gets_its_4xx_in_its_api_shape(serve, model_dir):
    model = model_dir("llama")
    server = serve(model, "--max-body-bytes", str(hostile.MAX_BODY_BYTES))
    client, expected = openai_client(server), reference_reply(model, HELLO, 4)
    assert serving_problem(server, client, expected) is None
    problems, lost = [], None
    for case in hostile.catalogue():
        try:
            problems += [f"{case.name}: {p}" for p in judged(case, *send(server, case))]
        except (httpx.HTTPError, OSError, openai.APIConnectionError, anthropic.APIConnectionError) as e:
            problems.append(f"{case.name}: no answer ({type(e).__name__}: {e})")
        # Once the server stops serving, later cases are still judged, but only the
        # case that broke it is blamed for that.
        if lost is None and (lost := serving_problem(server, client, expected)) is not None:
            problems.append(f"{case.name}: afterwards {lost}")
    errors = [line for line in server.log().splitlines() if "Error" in line][-20:]  # the access log says little
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems) + "\nserver log:\n" + "\n".join(errors)


# --- generated bodies ------------------------------------------------------------------------

# Fields each API reads (or a client may well send), any of which a body replaces.
FIELDS = {
    CHAT: "model messages max_tokens max_completion_tokens temperature top_p top_k min_p stop stream stream_options "
    "seed n logit_bias logprobs top_logprobs tools tool_choice response_format chat_template_kwargs adapters "
    "draft_model num_draft_tokens repetition_penalty repetition_context_size presence_penalty frequency_penalty "
    "xtc_probability xtc_threshold role_mapping user",
    COMPLETIONS: "model prompt max_tokens temperature top_p top_k stop stream seed n best_of echo suffix logit_bias "
    "logprobs presence_penalty frequency_penalty repetition_penalty user",
    MESSAGES: "model messages max_tokens system stop_sequences temperature top_p top_k stream tools tool_choice "
    "metadata thinking",
    COUNT_TOKENS: "model messages system tools tool_choice thinking",
    RESPONSES: "model input instructions max_output_tokens temperature top_p stream tools tool_choice "
    "previous_response_id text reasoning store user",
}
FIELDS = {path: names.split() for path, names in FIELDS.items()}
# Fields that scale the work: a generated value is invalid or at most 4 (never a
# valid large one, nor null, which would take the server's default length).
LIMITS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of"}

KEYS = st.sampled_from(["role", "content", "type", "text", "name", "function", "arguments"]) | st.text(max_size=6)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**70, -(2**70), 2**63, 2**63 - 1, 2**31, 10**12, -1, 0, 1]),
    st.floats(),  # NaN and infinities included: Python's json writes and reads them
    st.sampled_from([1e308, -1e308, 5e-324]),
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "\ud800", "default_model", "user", "assistant", "system", "tool", "text", "auto"]),
)
VALUES = st.recursive(LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(KEYS, c, max_size=3), max_leaves=8)
LIMIT_VALUES = st.one_of(
    st.integers(max_value=4),
    st.integers(min_value=10**12),
    st.just(2**70),
    st.floats().filter(lambda f: not 4 < f < 1e12),
    st.booleans(),
    st.text(max_size=8),
    st.lists(LEAVES, max_size=2),
    st.dictionaries(KEYS, LEAVES, max_size=2),
)
# Python reads no int of more than 4300 digits: json.loads raises ValueError.
LONG_INT = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": ' + b"1" * 5000 + b"}"


@st.composite
def one_field(draw, path: str) -> dict:
    """The base body with one field, known or not, replaced or added."""
    name = draw(st.sampled_from(FIELDS[path]) | st.text(min_size=1, max_size=10))
    return {**BASE[path], name: draw(LIMIT_VALUES if name in LIMITS else VALUES)}


@st.composite
def nested(draw, path: str) -> dict:
    """The base body with one key of its first message (or input item, or content
    block) replaced or added; for completions, one token id of the prompt."""
    value = draw(VALUES)
    if path == COMPLETIONS:
        return {**BASE[path], "prompt": [1, 40, value]}
    key = draw(KEYS)
    if draw(st.booleans()):
        item = {"role": "user", "content": "Hello there.", key: value}
    else:
        item = {
            "role": "user",
            "content": [{"type": "input_text" if path == RESPONSES else "text", "text": "Hi", key: value}],
        }
    return {**BASE[path], "input" if path == RESPONSES else "messages": [item]}


@st.composite
def not_utf8(draw, path: str) -> bytes:
    """The base body with a 0xff byte (never in UTF-8) and some junk put anywhere."""
    text = json.dumps(BASE[path]).encode()
    at = draw(st.integers(0, len(text)))
    return text[:at] + b"\xff" + draw(st.binary(max_size=8)) + text[at:]


def bodies(path: str):
    encoded = lambda s: s.map(lambda body: json.dumps(body).encode())  # noqa: E731
    fields, inner = encoded(one_field(path)), encoded(nested(path))
    raw = st.one_of(encoded(VALUES), not_utf8(path), st.binary(max_size=32), st.just(LONG_INT))  # VALUES: no object
    # A strategy named n times in one_of is drawn n times as often: most bodies differ
    # from a valid one in one field, where the server's checks have the most to miss.
    return st.one_of(fields, fields, fields, fields, inner, inner, raw)


def probe(server, path: str, found: dict[str, list[bytes]], answered: dict[int, int]) -> None:
    """EXAMPLES generated bodies sent to `path`; what went wrong goes into `found`
    (what -> the bodies), the statuses into `answered`."""
    timeouts = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # failures are gathered, not raised: nothing to shrink
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies(path))
    def one(content: bytes):
        nonlocal timeouts
        assert server.proc.poll() is None, f"the server exited:\n{server.log()[-3000:]}"
        assert timeouts < MAX_TIMEOUTS, f"the server stopped answering:\n{server.log()[-3000:]}"
        try:
            status, body, _ = hostile.send(server.url, hostile.Case("generated", path, content), timeout=TIMEOUT_S)
        except (httpx.HTTPError, OSError) as e:
            timeouts += isinstance(e, httpx.TimeoutException)
            found[f"{path}: no answer ({type(e).__name__})"].append(content)
            return
        answered[status] += 1
        if status != 200 and not 400 <= status < 500:
            found[f"{path}: status {status}: {json.dumps(body)[:120]}"].append(content)
        elif status >= 400 and (problem := hostile.shape_problem(path, status, body)):
            found[f"{path}: {status} not in shape: {problem[:120]}"].append(content)

    one()


def test_generated_bodies_get_200_or_a_4xx_in_shape_and_never_break_the_server(serve, model_dir):
    model = model_dir("llama")
    # --max-tokens 4: a body the server reads no length from generates 4 tokens at most.
    server = serve(model, "--max-tokens", "4")
    client, expected = openai_client(server), reference_reply(model, HELLO, 4)
    found: dict[str, list[bytes]] = defaultdict(list)
    answered: dict[int, int] = defaultdict(int)
    started = time.perf_counter()
    for path in FIELDS:
        probe(server, path, found, answered)
    seconds = time.perf_counter() - started
    lost = serving_problem(server, client, expected)
    report = [f"{what} (x{len(sent)}), e.g. {sent[0][:200]!r}" for what, sent in found.items()]
    assert not report and lost is None, (
        f"answers by status {dict(answered)} in {seconds:.0f} s; afterwards: {lost or 'still serving'}\n"
        + "\n".join(report)
    )
