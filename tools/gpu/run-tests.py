"""Run a selection of the tests with MLX on the GPU and write a JSON summary of the run.

`make test-gpu` calls this on the GPU machine, after .gpu/w2 and .gpu/w4 are installed into
/tmp/site (docs/serve.md, "Serve tests on a GPU"):

    python3 tools/gpu/run-tests.py [options] -- PYTEST_ARGS...

Before pytest starts it checks that
  - MLX's default device is the GPU and computes there (else it stops with status 3; --allow-cpu
    lets it go on, to try this script on a machine without one);
  - a child process started the way the tests start `promptstore serve` (sys.executable, this
    environment, another working directory) imports mlx, mlx_lm, openai, anthropic and this
    checkout's promptstore: PYTHONPATH must carry /tmp/site and the repository (status 4 if not);
  - a child started as tests/conftest.py's run_isolated starts one (PYTHONPATH set to the
    repository alone) imports them too. Where the wheels live in /tmp/site it cannot, so for the
    run a .pth file in the interpreter's site-packages puts PYTHONPATH's entries back behind the
    repository; it is removed afterwards (--no-bridge leaves it out).

pytest runs with -v, -p no:cacheprovider, no plugins but pytest-timeout and hypothesis's (other
plugins installed in the image are not loaded), a per-test timeout (--timeout, signal method: a test that runs over fails and
the run goes on), and --junitxml. Past --budget seconds it gets SIGINT (it stops, tears the servers
down and still writes its report), 30 s later SIGKILL.

Into --out (default: $OUT where set, else bench-results/) it writes NAME.json, NAME.junit.xml and
NAME.log (all of pytest's output). The exit status is pytest's (0: all passed), 3/4 as above.
`--merge A.json B.json [--name test-gpu]` joins the summaries of two halves into bench-results/.
Standard library and mlx only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.util
import json
import os
import re
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMPORTS = "import mlx.core, mlx_lm, openai, anthropic, promptstore; print(promptstore.__file__)"
BRIDGE = "zz-promptstore-gpu-tests.pth"
# pytest -v's line for a test: its id (parameters may hold spaces), then its outcome once it ends
OUTCOME = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: |$)")
NODE = re.compile(r"^\S+::")
COLLECTED = re.compile(
    r"collected (?P<collected>\d+) items?(?: / (?P<deselected>\d+) deselected)?(?: / (?P<selected>\d+) selected)?"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allow-cpu", action="store_true", help="go on where MLX's default device is the CPU")
    ap.add_argument("--out", type=Path, default=None, help="folder for the results ($OUT, else bench-results)")
    ap.add_argument("--name", default="test-gpu", help="stem of the result files (default test-gpu)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a test may take (default 300)")
    ap.add_argument("--budget", type=float, default=0, help="seconds the whole run may take (0: no bound)")
    ap.add_argument("--commit", default="", help="the commit tested, where git cannot tell (no .git)")
    ap.add_argument("--no-bridge", action="store_true", help="no .pth file for run_isolated's children")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="join these runs' summaries into NAME.json")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: what pytest runs")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, (args.out or REPO / "bench-results") / f"{args.name}.json")
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    out = args.out or Path(os.environ.get("OUT") or REPO / "bench-results")
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{args.name}.{kind}" for kind in ("json", "junit.xml", "log")}
    for path in paths.values():
        path.unlink(missing_ok=True)

    summary: dict = {
        "target": args.name,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit(args.commit),
        "source_trees": {name: git_tree_hash(REPO / name) for name in ("promptstore", "tests")},
        "python": sys.version.split()[0],
    }
    summary.update(device())
    print(f"run-tests: mlx {summary['mlx_version']} on {summary['mlx_default_device']} ({summary['gpu']})")
    if not summary["on_gpu"]:
        why = f"MLX's default device is {summary['mlx_default_device']}, not a GPU that computes"
        if "gpu_error" in summary:
            why += f" ({summary['gpu_error']})"
        if not args.allow_cpu:
            print(
                "\n" + "!" * 78 + f"\nrun-tests: {why}: stopping (--allow-cpu to go on)\n" + "!" * 78, file=sys.stderr
            )
            return finish(summary, paths, error=why, status=3)
        print(f"run-tests: {why}; going on (--allow-cpu)")

    env = child_env()
    problem = check_children(env)
    if problem:
        print(f"run-tests: {problem}", file=sys.stderr)
        return finish(summary, paths, error=problem, status=4)
    bridge = None if args.no_bridge else bridge_for_isolated_children(env)
    summary["pth_bridge"] = str(bridge) if bridge else None

    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "pytest_timeout"]
    if importlib.util.find_spec("_hypothesis_pytestplugin"):  # as autoloading would, where it is there
        cmd += ["-p", "_hypothesis_pytestplugin"]
    cmd += [f"--timeout={args.timeout:g}", "--timeout-method=signal", f"--junitxml={paths['junit.xml']}"]
    cmd += pytest_args
    summary["pytest_command"] = cmd[1:]
    print("run-tests:", " ".join(cmd), flush=True)
    start = time.monotonic()
    try:
        status, stopped = run_pytest(cmd, env, paths["log"], args.budget)
    finally:
        if bridge:
            bridge.unlink(missing_ok=True)
    summary["seconds"] = round(time.monotonic() - start, 1)
    summary["budget_stop"] = stopped
    summary.update(results(paths["junit.xml"], paths["log"], stopped))
    return finish(summary, paths, status=status)


def commit(given: str) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        )
        if head.returncode == 0:
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return given or os.environ.get("GIT_COMMIT", "") or "unknown (no git here: pass COMMIT=...)"


def git_tree_hash(folder: Path) -> str | None:
    """The git tree id of `folder` as it is on disk, skipping what git ignores here (caches,
    compiled files): equal to `git rev-parse COMMIT:folder` where the files are that commit's,
    so a run on a machine without .git still names its code (files not in git make it differ)."""

    def tree(path: Path) -> bytes | None:
        entries = []
        for child in path.iterdir():
            if child.name in ("__pycache__", ".pytest_cache", ".hypothesis") or child.suffix == ".pyc":
                continue
            if child.is_symlink():
                mode, oid = b"120000", obj(b"blob", os.readlink(child).encode())
            elif child.is_dir():
                sub = tree(child)
                if sub is None:
                    continue
                mode, oid = b"40000", sub
            else:
                mode = b"100755" if os.access(child, os.X_OK) else b"100644"
                oid = obj(b"blob", child.read_bytes())
            key = child.name.encode() + (b"/" if mode == b"40000" else b"")
            entries.append((key, mode + b" " + child.name.encode() + b"\0" + oid))
        if not entries:
            return None
        return obj(b"tree", b"".join(entry for _, entry in sorted(entries)))

    def obj(kind: bytes, data: bytes) -> bytes:
        return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\0" + data).digest()

    oid = tree(folder) if folder.is_dir() else None
    return oid.hex() if oid else None


def device() -> dict:
    """MLX's default device, whether it computes there, the GPU's name (MLX, then nvidia-smi)."""
    import mlx.core as mx

    info: dict = {"mlx_version": mx.__version__, "mlx_default_device": str(mx.default_device())}
    try:
        info["mlx_device_info"] = {k: v for k, v in mx.device_info().items()}
    except Exception as e:  # only reported
        info["mlx_device_info"] = f"unavailable: {e!r}"
    try:
        import mlx_lm

        info["mlx_lm_version"] = mlx_lm.__version__
    except Exception as e:
        info["mlx_lm_version"] = f"unavailable: {e!r}"
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    if on_gpu:  # a GPU that is the default but cannot compute fails here, not in the first test
        try:
            # Exact in any precision (a float32 matmul on CUDA may run in TF32).
            on_gpu = (mx.ones((64, 64)) @ mx.ones((64, 64))).sum().item() == 64**3
        except Exception as e:
            on_gpu, info["gpu_error"] = False, repr(e)
    info["on_gpu"] = on_gpu
    info["nvidia_smi"] = smi = nvidia_smi()
    named = info["mlx_device_info"].get("device_name") if isinstance(info["mlx_device_info"], dict) else None
    if smi:
        info["gpu"] = smi.splitlines()[0].split(",")[0].strip()
    else:
        info["gpu"] = named if on_gpu and named else "none"
    return info


def nvidia_smi() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def child_env() -> dict:
    """This environment with the repository on PYTHONPATH and every entry absolute: the CLI tests
    run their children in a temporary folder."""
    entries = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in entries:
        entries.append(str(REPO))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(entries))


def check_children(env: dict) -> str | None:
    """Why a server the tests start would not import what it needs (None: it would)."""
    with tempfile.TemporaryDirectory() as elsewhere:
        done = subprocess.run(
            [sys.executable, "-c", IMPORTS], env=env, cwd=elsewhere, capture_output=True, text=True, timeout=300
        )
    if done.returncode != 0:
        return f"a child process cannot import what the tests need (PYTHONPATH={env['PYTHONPATH']}):\n{done.stderr[-2000:]}"
    where = Path(done.stdout.strip().splitlines()[-1]).resolve()
    if REPO not in where.parents:
        return f"a child process imports promptstore from {where}, not from this checkout {REPO}"
    print(f"run-tests: children import this checkout's promptstore (PYTHONPATH={env['PYTHONPATH']})")
    return None


def bridge_for_isolated_children(env: dict) -> Path | None:
    """tests/conftest.py's run_isolated sets PYTHONPATH to the repository alone; where mlx comes
    from PYTHONPATH (/tmp/site), such a child cannot import it. Then write a .pth file that puts
    PYTHONPATH's entries back, ahead of site-packages, for this run; returns it (None: not needed)."""
    isolated = dict(env, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", IMPORTS], env=isolated, cwd=REPO, capture_output=True, timeout=300)
    if done.returncode == 0:
        return None
    entries = [p for p in env["PYTHONPATH"].split(os.pathsep) if p and p != str(REPO)]
    line = (
        f"import sys; _e = [p for p in {entries!r} if p not in sys.path]; "
        "_i = next((i for i, p in enumerate(sys.path) if p.endswith(('site-packages', 'dist-packages'))), "
        "len(sys.path)); sys.path[_i:_i] = _e\n"
    )
    for folder in site.getsitepackages():
        path = Path(folder) / BRIDGE
        try:
            path.write_text(line)
        except OSError:
            continue
        check = subprocess.run([sys.executable, "-c", IMPORTS], env=isolated, cwd=REPO, capture_output=True)
        if check.returncode == 0:
            print(f"run-tests: {path} puts {entries} on run_isolated's children's sys.path for this run")
            return path
        path.unlink(missing_ok=True)
    print("run-tests: WARNING: children started with PYTHONPATH set to the repository alone cannot import mlx")
    return None


def run_pytest(cmd: list[str], env: dict, log_path: Path, budget: float) -> tuple[int, bool]:
    """pytest's exit status, and whether the budget stopped it; its output goes here and to the log."""
    env = dict(env, PYTHONUNBUFFERED="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    stopped = threading.Event()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def stop() -> None:
            if proc.poll() is None:
                stopped.set()
                print(f"\nrun-tests: over the budget of {budget:g} s: SIGINT to pytest", flush=True)
                proc.send_signal(signal.SIGINT)
                kill = threading.Timer(30, lambda: proc.poll() is None and proc.kill())
                kill.daemon = True
                kill.start()

        timer = threading.Timer(budget, stop) if budget > 0 else None
        if timer:
            timer.daemon = True
            timer.start()
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
            log.flush()
        status = proc.wait()
        if timer:
            timer.cancel()
    return status, stopped.is_set()


def results(junit: Path, log: Path, stopped: bool) -> dict:
    """Counts and test ids from the JUnit report; from pytest -v's lines where it wrote none.
    A test the budget's SIGINT stopped counts as interrupted (JUnit calls it passed), and the
    selected tests that never ran as not_run."""
    tests: dict[str, tuple[str, str, float]] = {}  # id -> (outcome, message, seconds)
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            if not case.get("name"):  # what pytest writes for a test that SIGINT stopped
                continue
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = node.get("message", "")
                    break
            tests[node_id(case)] = (outcome, message, float(case.get("time", 0)))
    else:
        for line in lines:
            m = OUTCOME.match(line)
            if m:
                outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
                tests[m[1]] = (outcome.get(m[2], m[2].lower()), "", 0.0)
    interrupted = None
    if stopped or not junit.exists():
        finished = {m[1] for m in map(OUTCOME.match, lines) if m}
        started = [line.rstrip() for line in lines if NODE.match(line) and not OUTCOME.match(line)]
        interrupted = next((t for t in reversed(started) if t not in finished), None)
        if interrupted:
            tests[interrupted] = (
                "interrupted",
                "stopped by the budget or killed",
                tests.get(interrupted, ("", "", 0))[2],
            )
    selected = None
    for line in lines:
        m = COLLECTED.search(line)
        if m:
            selected = int(m["selected"] or int(m["collected"]) - int(m["deselected"] or 0))
    kinds = ("passed", "failed", "error", "skipped", "interrupted")
    count = {k: sum(1 for o, _, _ in tests.values() if o == k) for k in kinds}
    skipped: dict[str, int] = {}
    for outcome, message, _ in tests.values():
        if outcome == "skipped":
            skipped[message[:200]] = skipped.get(message[:200], 0) + 1
    slowest = sorted(tests.items(), key=lambda kv: -kv[1][2])[:10]
    bad = ("failed", "error", "interrupted")
    return {
        "report": "junit" if junit.exists() else "pytest -v output (no JUnit report: pytest was killed)",
        "selected": selected,
        "tests": len(tests),
        **count,
        "not_run": max(0, selected - len(tests)) if selected is not None else None,
        "failed_ids": [k for k, (o, _, _) in tests.items() if o in bad],
        "failures": {k: m[:300] for k, (o, m, _) in tests.items() if o in bad},
        "skip_reasons": skipped,
        "slowest": [{"id": k, "seconds": round(t, 2)} for k, (_, _, t) in slowest if t >= 0.01],
    }


def node_id(case: ET.Element) -> str:
    """pytest's node id from a JUnit testcase: classname 'tests.serve.test_chat[.Class]', name."""
    parts = case.get("classname", "").split(".")
    for i in range(len(parts), 0, -1):
        path = Path(REPO, *parts[:i]).with_suffix(".py")
        if path.exists():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], case.get("name", "")])
    return f"{case.get('classname')}::{case.get('name')}"


def merge(parts: list[Path], target: Path) -> int:
    """One summary of several runs (the halves of `make test-gpu PART=A` and `PART=B`): counts,
    seconds and failures added up; the device, versions and code of the first, and where the
    parts differ in those, each part's under "parts"."""
    runs = [json.loads(p.read_text()) for p in parts]
    joined = dict(runs[0], target=target.stem, merged_from=[p.name for p in parts])
    for key in ("selected", "tests", "passed", "failed", "error", "skipped", "interrupted", "not_run", "seconds"):
        joined[key] = round(sum(run.get(key) or 0 for run in runs), 1)
    for key in ("failed_ids", "pytest_command"):
        joined[key] = [x for run in runs for x in run.get(key, [])]
    joined["failures"] = {k: v for run in runs for k, v in run.get("failures", {}).items()}
    joined["skip_reasons"] = {}
    for run in runs:
        for reason, n in run.get("skip_reasons", {}).items():
            joined["skip_reasons"][reason] = joined["skip_reasons"].get(reason, 0) + n
    joined["slowest"] = sorted((x for run in runs for x in run.get("slowest", [])), key=lambda x: -x["seconds"])[:10]
    joined["budget_stop"] = any(run.get("budget_stop") for run in runs)
    joined["exit_status"] = next((run["exit_status"] for run in runs if run.get("exit_status")), 0)
    same = ("commit", "source_trees", "gpu", "mlx_version", "on_gpu")
    if any(run.get(k) != runs[0].get(k) for run in runs for k in same):
        joined["parts"] = {p.name: {k: run.get(k) for k in (*same, "started")} for p, run in zip(parts, runs)}
        print(f'run-tests: the parts differ in code or device: see {target}\'s "parts"', file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(joined, indent=2, default=str) + "\n")
    kinds = ("passed", "failed", "error", "skipped", "interrupted", "not_run")
    counts = ", ".join(f"{joined[k]} {k}" for k in kinds if joined.get(k) or k in ("passed", "failed"))
    print(f"run-tests: {counts} of {joined['selected']} selected, in {joined['seconds']} s; wrote {target}")
    return joined["exit_status"]


def finish(summary: dict, paths: dict, status: int, error: str | None = None) -> int:
    summary["exit_status"] = status
    if error:
        summary["error"] = error
    paths["json"].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if "tests" in summary:
        kinds = ("passed", "failed", "error", "skipped", "interrupted", "not_run")
        counts = ", ".join(f"{summary[k]} {k}" for k in kinds if summary.get(k) or k in ("passed", "failed"))
        print(f"run-tests: {counts} of {summary['selected']} selected, in {summary['seconds']} s on {summary['gpu']}")
        for test_id in summary["failed_ids"]:
            print(f"run-tests: FAILED {test_id}")
    print(f"run-tests: wrote {paths['json']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
