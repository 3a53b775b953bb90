"""`promptstore serve` of a vision-language model: images through the three APIs
(official SDKs), every reply equal to a full prefill's, cached tokens right, bad
images refused naming the part, and image prompts restored after a restart."""

import base64
import functools

import httpx
import mlx.core as mx
import pytest

from promptstore.vision import VisionModel

from ..serve.api_clients import anthropic_client
from ..serve.conftest import REQUEST_TIMEOUT_S, chat, serve  # noqa: F401 - the fixture
from .conftest import SYSTEM, encoded, picture

QUESTION = "What is in this picture? Answer briefly."


def data_url(seed: int, fmt: str = "PNG") -> str:
    kind = {"PNG": "png", "JPEG": "jpeg"}[fmt]
    return f"data:image/{kind};base64,{base64.b64encode(encoded(picture(seed), fmt)).decode()}"


def openai_messages(*urls: str, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "text", "text": "Look at this:"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": question})
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


@functools.cache
def reference_model(folder) -> VisionModel:
    return VisionModel.load(folder)


def reference(folder, messages: list[dict], n: int = 12) -> tuple[list[int], int]:
    """(greedy tokens of a full prefill, the end of the prompt's last image), computed here with no store."""
    model = reference_model(folder)
    library = [
        dict(m, content=[_library_part(p) for p in m["content"]]) if isinstance(m["content"], list) else m
        for m in messages
    ]
    prompt = model.prompt(library)
    cache = model.make_cache()
    logits = model.forward(prompt, cache, 0, model.embed(prompt, 0))[:, -1]
    decoder, out = model.decoder(prompt), []
    eos = set(model.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<end_of_turn>"]) or [])
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        if token in eos:
            break
        logits = decoder(mx.array([[token]]), cache=cache)[:, -1]
    return out, prompt.spans[-1].end


def _library_part(part: dict) -> dict:
    if part["type"] == "image_url":
        return {"type": "image", "image": part["image_url"]["url"]}
    return part


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_chat_completions_with_images(serve, vision_dirs, family):  # noqa: F811
    folder = vision_dirs[family]
    server = serve(folder)
    client = server.client()
    one = openai_messages(data_url(1))
    want, image_end = reference(folder, one)
    text, ids, cached = chat(client, one)
    assert ids == want and cached == 0
    # The same prompt again: restored past the image (all but its last token).
    text_again, ids_again, cached = chat(client, one)
    assert ids_again == want and cached > image_end
    # Another image after the same text shares nothing past the image. A model of
    # window layers restores only where a state was stored: this prompt stores one
    # where it leaves the first (the image's start), which a third image then shares.
    for seed in (2, 3):
        other = openai_messages(data_url(seed))
        want_other, _ = reference(folder, other)
        _, ids_other, cached_other = chat(client, other)
        assert ids_other == want_other and cached_other < image_end - 1
    assert cached_other > 0
    # The next turn of the first chat restores the image and the reply.
    three = [*one, {"role": "assistant", "content": text}, {"role": "user", "content": "And its corners?"}]
    want_three, _ = reference(folder, three)
    _, ids_three, cached_three = chat(client, three)
    assert ids_three == want_three and cached_three > image_end
    # A text request to the same model is served as for a text model.
    assert chat(client, [{"role": "user", "content": "Hello there"}])[1]
    metrics = httpx.get(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    assert "promptstore_vision_encoder_skipped_total{model=" in metrics
    skipped = [line for line in metrics.splitlines() if line.startswith("promptstore_vision_encoder_skipped_total")]
    assert float(skipped[0].split()[-1]) >= 2


def test_messages_and_responses_apis_take_images(serve, vision_dirs):  # noqa: F811
    folder = vision_dirs["qwen2_vl"]
    server = serve(folder)
    png = base64.b64encode(encoded(picture(5), "PNG")).decode()
    messages = openai_messages(f"data:image/png;base64,{png}")
    want, image_end = reference(folder, messages)
    claude = anthropic_client(server)
    blocks = [
        {"type": "text", "text": "Look at this:"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": QUESTION},
    ]
    for attempt in range(2):
        reply = claude.messages.create(
            model="default_model",
            system=SYSTEM,
            max_tokens=12,  # recent SDKs send no temperature: the server's default is greedy
            messages=[{"role": "user", "content": blocks}],
        )
        assert reply.usage.output_tokens == len(want)
        if attempt:
            assert reply.usage.cache_read_input_tokens > image_end
    openai = server.client()
    response = openai.responses.create(
        model="default_model",
        instructions=SYSTEM,
        max_output_tokens=12,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look at this:"},
                    {"type": "input_image", "image_url": f"data:image/png;base64,{png}"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
    )
    assert response.usage.input_tokens_details.cached_tokens > image_end
    assert response.usage.output_tokens == len(want)
    # Every API's reply is the same text: one prompt, rendered alike.
    assert response.output_text == reply.content[0].text


def test_bad_images_get_a_400_naming_the_part(serve, vision_dirs, tmp_path):  # noqa: F811
    allowed = tmp_path / "pictures"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(encoded(picture(8), "PNG"))
    (tmp_path / "secret.png").write_bytes(encoded(picture(9), "PNG"))
    server = serve(vision_dirs["qwen2_vl"], "--allowed-image-folder", str(allowed), "--max-images", "2")
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:

        def ask(*urls):
            body = {"model": "default_model", "messages": openai_messages(*urls), "max_tokens": 4}
            return http.post(server.url + "/v1/chat/completions", json=body)

        cases = [
            (("https://example.com/cat.png",), "remote image URLs are refused"),
            (("data:image/png;base64,AAAA",), "not an image"),
            (("data:text/plain;base64,aGVsbG8=",), "not an image"),
            ((f"file://{tmp_path / 'secret.png'}",), "outside the folders"),
            ((data_url(1), data_url(2), data_url(3)), "more than 2 images"),
        ]
        for urls, says in cases:
            r = ask(*urls)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert says in error["message"] and error["param"].startswith("messages[1].content["), error
        assert ask(f"file://{allowed / 'a.png'}").status_code == 200
        blocks = [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]
        r = http.post(
            server.url + "/v1/messages",
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]},
        )
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content.0.source.type")
        assert server.health() == 200  # nothing stopped the server


def test_image_prompts_survive_a_restart(serve, vision_dirs, tmp_path):  # noqa: F811
    folder = vision_dirs["qwen2_vl"]
    store = tmp_path / "kept"
    messages = openai_messages(data_url(11), data_url(12))
    want, image_end = reference(folder, messages)
    first = serve(folder, store=store)
    assert chat(first.client(), messages)[1] == want
    assert first.stop() == 0
    second = serve(folder, store=store)
    _, ids, cached = chat(second.client(), messages)
    assert ids == want and cached > image_end
    # The restarted server processed neither image: the store's hit covers both.
    assert processed_images(second) == 0
    # A next turn with a new image processes that one alone.
    three = [*messages, {"role": "assistant", "content": "Two pictures."}]
    three.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(13)}}]})
    want_three, _ = reference(folder, three)
    _, ids_three, cached_three = chat(second.client(), three)
    assert ids_three == want_three and cached_three > image_end
    assert processed_images(second) == 1


def processed_images(server) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    lines = [line for line in metrics.splitlines() if line.startswith("promptstore_vision_images_processed_total")]
    assert lines, "no promptstore_vision_images_processed_total in /metrics"
    return float(lines[0].split()[-1])
