"""A server killed mid-stream, clients that disconnect, and many clients at once."""

import signal
import threading

from .conftest import QUESTIONS, SYSTEM, chat, reference_reply, rendered_length, store_problems


def test_sigkill_mid_stream_then_restart_hits_and_replies_equal(serve, model_dir):
    model = model_dir("llama")
    # sync: an insert returns once on disk, and the turn's insert runs before the
    # next request is served, so the first turn is on disk when the second streams.
    server = serve(model, "--durability", "sync")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    text, _, _ = chat(server.client(), messages)
    messages += [{"role": "assistant", "content": text}]
    previous = rendered_length(model, messages)
    messages += [{"role": "user", "content": QUESTIONS[1]}]
    stream = server.client().chat.completions.create(
        model="default_model", messages=messages, max_tokens=400, temperature=0, stream=True
    )
    next(iter(stream))
    server.proc.kill()  # SIGKILL while the reply streams
    server.proc.wait(timeout=60)
    stream.close()

    server = serve(model, store=server.store)
    _, ids, cached = chat(server.client(), messages)
    assert ids == reference_reply(model, messages, 12)
    assert cached >= previous
    assert server.stop() == 0
    assert store_problems(server.store, clean_close=False) == {}


def test_client_disconnecting_mid_stream_leaves_the_server_serving(serve, model_dir):
    model = model_dir("llama")
    server = serve(model)
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    for _ in range(2):
        stream = client.chat.completions.create(
            model="default_model", messages=messages, max_tokens=2000, temperature=0, stream=True
        )
        next(iter(stream))
        stream.close()
    assert server.health() == 200
    _, ids, cached = chat(client, messages)
    assert ids == reference_reply(model, messages, 12)
    assert cached > 0
    assert server.stop(signal.SIGINT) == 0  # as Ctrl-C: the store is closed cleanly too
    assert store_problems(server.store) == {}


def test_eight_concurrent_clients_get_the_sequential_replies(serve, model_dir):
    model = model_dir("llama")
    client = serve(model).client()
    systems = [SYSTEM, "You answer questions about the weather and the tides, briefly."]
    conversations = [
        [{"role": "system", "content": systems[i % 2]}, {"role": "user", "content": QUESTIONS[i % 4]}] for i in range(8)
    ]
    results: dict[int, list] = {}
    errors = []

    def talk(i: int) -> None:
        try:
            messages = list(conversations[i])
            turns = []
            for turn in range(2):
                text, ids, _ = chat(client, messages)
                turns.append((list(messages), ids))
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[turn]}]
            results[i] = turns
        except Exception as e:  # reported below, with the others
            errors.append(repr(e))

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 8
    for i, turns in results.items():
        for messages, ids in turns:
            assert ids == reference_reply(model, messages, 12), f"conversation {i}"
