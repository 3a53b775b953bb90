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
