"""A request's phases from its timeline: every phase it reached, its TTFT from the
moment its headers were read (its body's reading counted), and the store's
prefill of a prompt with images in its own phases."""

from promptstore.serve.timeline import request_phases


def no_store_calls(a, b):
    return 0.0


def test_a_text_requests_phases_count_from_its_arrival():
    marks = dict(arrived=1.0, received=1.1, checked=1.15, queued=1.16, tokenize=1.2, fetch=1.21)
    marks.update(fetched=1.25, gathered=1.26, first=1.5)
    phases = request_phases(marks, no_store_calls)
    assert round(phases["read_ms"]) == 100 and round(phases["check_ms"]) == 50
    assert round(phases["prefill_first_ms"]) == 240
    assert round(phases["ttft_ms"]) == 500  # from arrival, not from the end of the body's reading
    assert "embed_ms" not in phases


def test_a_prompt_with_images_has_the_stores_prefill_phases():
    marks = dict(arrived=0.0, received=0.2, checked=0.3, queued=0.3, tokenize=0.31, fetch=0.31, fetched=0.32)
    marks.update(prefill=0.33, embedded=0.43, prefilled=0.53, first=0.56, copies=0.002)
    phases = request_phases(marks, no_store_calls)
    assert [round(phases[k]) for k in ("wait_ms", "embed_ms", "prefill_ms", "first_ms", "copy_ms")] == [
        10,
        100,
        100,
        30,
        2,
    ]
    assert round(phases["ttft_ms"]) == 560 and "prefill_first_ms" not in phases


def test_a_timeline_kept_before_arrivals_were_marked_counts_from_its_receipt():
    phases = request_phases(dict(received=2.0, checked=2.01, first=2.3), no_store_calls)
    assert round(phases["ttft_ms"]) == 300 and "read_ms" not in phases


def test_a_text_requests_wait_for_its_first_token_is_split_where_its_token_was_put():
    marks = dict(arrived=1.0, received=1.0, checked=1.0, queued=1.0, tokenize=1.0, fetch=1.0)
    marks.update(fetched=1.01, gathered=1.02, put=1.32, first=1.34)
    steps = [(1.0, 1.05), (1.1, 1.2), (1.25, 1.3), (1.32, 1.4)]  # the first began before, the last after

    def steps_between(a, b):
        return sum(1 for s, _ in steps if a <= s < b), sum(max(0.0, min(e, b) - max(s, a)) for s, e in steps)

    phases = request_phases(marks, no_store_calls, steps_between)
    assert round(phases["prefill_first_ms"]) == 320
    assert round(phases["batch_ms"]) == 300 and round(phases["out_ms"]) == 20
    assert phases["steps"] == 2 and round(phases["steps_ms"]) == 30 + 100 + 50
    del marks["put"]  # a request whose first token was never put (its client went first)
    assert "batch_ms" not in request_phases(marks, no_store_calls, steps_between)
