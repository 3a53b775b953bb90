"""A request's timeline (perf_counter instants by name, written by the HTTP and
generation threads as it passes them): its phases in milliseconds, and once its
reply ends, its log line and its figures for /metrics."""

from __future__ import annotations

import logging
import time

from .tenants import PUBLIC

log = logging.getLogger("promptstore.serve")


def logged(request, ctx, responses, timeline: dict, busy_between, metrics, steps_between=None):
    """`responses` passed through as they come, the request's first token marked,
    and at the end (or when the client goes) its log line and metrics.
    busy_between: the generation thread's seconds in store calls between two instants;
    steps_between: mlx-lm's batch steps begun between two instants, and their seconds."""
    produced = 0
    try:
        for response in responses:
            if "first" not in timeline:
                timeline["first"] = time.perf_counter()
                first_token_out(ctx)
                if "restored_length" in timeline:
                    # A prompt with images, prefilled by the store before mlx-lm took it
                    # (serve/vision.py): mlx-lm counted that as cached; the fetch restored this.
                    ctx.prompt_cache_count = timeline["restored_length"]
            produced += 1
            yield response
    finally:
        first_token_out(ctx)  # or none will come
        timeline["done"] = time.perf_counter()
        prompt, restored = len(ctx.prompt), max(ctx.prompt_cache_count, 0)
        phases = request_phases(timeline, busy_between, steps_between)
        tenant = getattr(request, "tenant", PUBLIC)
        first = phases["ttft_ms"] / 1e3 if "ttft_ms" in phases else None
        metrics.served(tenant, prompt, restored, timeline.get("restored"), first, produced)
        metrics.asked(getattr(request, "retention", ()), getattr(request, "cache_key", None))
        ttft = f"{phases['ttft_ms']:.1f} ms" if "ttft_ms" in phases else "none"
        source = f" ({timeline['from_disk']} from disk, {timeline['plan']})" if "plan" in timeline else ""
        log.info(
            "request (%s): prompt %d tokens, restored %d%s, prefilled %d, TTFT %s, %d tokens generated; %s",
            tenant.label,
            prompt,
            restored,
            source,
            prompt - restored,
            ttft,
            produced,
            " ".join(f"{k}={v:.1f}" for k, v in phases.items() if k != "ttft_ms"),
        )


def first_token_out(ctx) -> None:
    """Mark the request whose GenerationContext this is as past its first token
    (the store's background work waits for no request past it)."""
    request = getattr(getattr(ctx, "prompt", None), "request", None)
    if request is not None:
        request.first_out = True


def request_phases(timeline: dict, busy_between, steps_between=None) -> dict[str, float]:
    """A request's timeline as milliseconds per phase (those it reached): reading and
    parsing its body, checking the prompt (HTTP thread), waiting for the generation thread, rendering and
    tokenizing, the store's fetch, waiting for requests being checked beside
    it (Arrivals), then prefill and the first token; `store_ms`
    is the generation thread's time in store calls (fetches, inserts) between
    arrival and the first token, this request's own fetch included.

    A text request's `prefill_first_ms` is split where the generation thread put
    its first token in its queue: `batch_ms` before (of which `steps_ms` in
    mlx-lm's batch steps, `steps` of them begun: its prompt's, and the decode
    steps of the batch it joins) and `out_ms` after, until its HTTP thread took it."""
    marks = ["arrived", "received", "checked", "queued", "tokenize", "fetch", "fetched", "gathered", "first"]
    names = [
        "read_ms",
        "check_ms",
        "handoff_ms",
        "queue_ms",
        "template_ms",
        "fetch_ms",
        "gather_ms",
        "prefill_first_ms",
    ]
    out = {}
    for (a, b), name in zip(zip(marks, marks[1:]), names):
        if a in timeline and b in timeline:
            out[name] = (timeline[b] - timeline[a]) * 1e3
    if "prefill" in timeline:  # a prompt with images, prefilled by the store (serve/vision.py)
        vision = [("fetched", "prefill", "wait_ms"), ("prefill", "embedded", "embed_ms")]
        vision += [("embedded", "prefilled", "prefill_ms"), ("prefilled", "first", "first_ms")]
        for a, b, name in vision:
            if a in timeline and b in timeline:
                out[name] = (timeline[b] - timeline[a]) * 1e3
        if "copies" in timeline:
            out["copy_ms"] = timeline["copies"] * 1e3
    if "put" in timeline and "first" in timeline and "gathered" in timeline:
        out["batch_ms"] = (timeline["put"] - timeline["gathered"]) * 1e3
        if steps_between is not None:
            begun, seconds = steps_between(timeline["gathered"], timeline["put"])
            out["steps_ms"], out["steps"] = seconds * 1e3, float(begun)
        out["out_ms"] = (timeline["first"] - timeline["put"]) * 1e3
    start = timeline.get("arrived", timeline.get("received"))
    if "first" in timeline and start is not None:
        out["ttft_ms"] = (timeline["first"] - start) * 1e3
        out["store_ms"] = busy_between(start, timeline["first"]) * 1e3
    return out
