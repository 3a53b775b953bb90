"""The soak's hostile section: a `promptstore serve` holding ordinary chats while
the cases of promptstore.testing.hostile go in round-robin and /health is polled."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from .common import now

HOSTILE_LOAD_THREADS = 3  # threads holding ordinary conversations while the hostile requests go in
HOSTILE_TIMEOUT_S = 30.0  # every request's; a refusal takes milliseconds, a reply well under a second


def hostile(args, work: Path) -> dict:
    import threading

    import httpx

    from promptstore.testing.hostile import MAX_BODY_BYTES, catalogue, send, shape_problem
    from promptstore.testing.model_dir import write_model_dir
    from tests.serve.conftest import QUESTIONS, SYSTEM, Server

    started = now()
    model = write_model_dir(work / "hostile-model", "llama")
    server = Server(model, work / "hostile-store", work / "hostile-server.log", "--max-body-bytes", str(MAX_BODY_BYTES))
    cases = catalogue()
    answers, wrong, dropped, ordinary, health = Counter(), Counter(), Counter(), Counter(), Counter()
    counting = threading.Lock()  # the load threads share `ordinary`
    wrong_examples: list[str] = []
    deadline = now() + args.hostile_seconds  # set again once the server serves

    def conversations(seed: int) -> None:
        # Ordinary multi-turn chats: each turn carries the conversation so far, as a client's would.
        rng = random.Random(seed)
        with httpx.Client(trust_env=False, timeout=HOSTILE_TIMEOUT_S) as http:
            while now() < deadline:
                messages = [{"role": "system", "content": SYSTEM}]
                for _ in range(rng.randint(1, 4)):
                    if now() >= deadline:
                        break
                    messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
                    body = {"model": "default_model", "messages": messages, "max_tokens": 8, "temperature": 0}
                    try:
                        r = http.post(server.url + "/v1/chat/completions", json=body)
                        reply = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                        reply, failure = None, f"failed: {type(e).__name__}"
                    else:
                        failure = f"failed: status {r.status_code}"
                    with counting:
                        ordinary["answered" if reply is not None else failure] += 1
                    if reply is None:
                        break
                    messages.append({"role": "assistant", "content": reply})

    def attacks() -> None:
        i = 0
        while now() < deadline:
            case = cases[i % len(cases)]
            i += 1
            try:
                status, body, _ = send(server.url, case, timeout=HOSTILE_TIMEOUT_S)
            except (httpx.HTTPError, OSError) as e:
                dropped[f"{case.name}: {type(e).__name__}"] += 1
                continue
            answers[status] += 1
            problem = None if case.expects(status) else f"status {status}, not {case.status}"
            if problem is None and status >= 400:
                problem = shape_problem(case.path, status, body, case.field)
            if problem is not None:
                wrong[case.name] += 1
                if len(wrong_examples) < 10 and wrong[case.name] == 1:
                    wrong_examples.append(f"{case.name}: {problem}"[:300])

    def health_checks() -> None:
        with httpx.Client(trust_env=False, timeout=5) as http:
            while now() < deadline:
                try:
                    status = http.get(server.url + "/health").status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                health["checks"] += 1
                if status != 200:
                    health[f"lost: {status}"] += 1
                time.sleep(0.5)

    threads = [threading.Thread(target=conversations, args=(args.seed + k,)) for k in range(HOSTILE_LOAD_THREADS)]
    threads += [threading.Thread(target=attacks), threading.Thread(target=health_checks)]
    try:
        server.start()
        deadline = now() + args.hostile_seconds
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.hostile_seconds + 2 * HOSTILE_TIMEOUT_S)
        stuck = sum(t.is_alive() for t in threads)
        try:
            exit_code = server.stop()
        except AssertionError as e:  # it ignored SIGTERM (and was killed)
            exit_code = str(e).splitlines()[0]
    finally:
        server.kill()
    result = {
        "load_threads": HOSTILE_LOAD_THREADS,
        "run_seconds": args.hostile_seconds,
        "hostile_requests": sum(answers.values()) + sum(dropped.values()),
        "answers_by_status": dict(sorted(answers.items())),
        "wrong_answers": sum(wrong.values()),
        "wrong_examples": wrong_examples,
        "dropped": sum(dropped.values()),
        "dropped_kinds": dict(dropped),
        "health_checks": health["checks"],
        "health_lost": sum(v for k, v in health.items() if k != "checks"),
        "health_kinds": {k: v for k, v in health.items() if k != "checks"},
        "ordinary_answered": ordinary["answered"],
        "ordinary_failed": sum(v for k, v in ordinary.items() if k != "answered"),
        "ordinary_failure_kinds": {k: v for k, v in ordinary.items() if k != "answered"},
        "threads_stuck": stuck,
        "stop_exit_code": exit_code,
        "seconds": round(now() - started, 1),
    }
    print(
        f"  hostile: {result['hostile_requests']} hostile requests ({len(cases)} cases round-robin) answered "
        f"{result['answers_by_status']}, wrong answers={result['wrong_answers']}, dropped={result['dropped']} | "
        f"health checks {result['health_checks']}, lost={result['health_lost']} | ordinary turns answered "
        f"{result['ordinary_answered']}, failed={result['ordinary_failed']} | threads stuck={stuck}, "
        f"exit {exit_code} ({result['seconds']} s)",
        flush=True,
    )
    for line in wrong_examples:
        print(f"    wrong: {line}")
    for k, v in {**dropped, **result["health_kinds"], **result["ordinary_failure_kinds"]}.items():
        print(f"    x{v}: {k}")
    return result
