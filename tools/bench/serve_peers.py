"""The servers bench_serve.py runs side by side: mlx_lm.server, vllm-mlx and
promptstore serve, each a process on a free loopback port with its own
caching settings, and the one streamed request they all answer."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI

from promptstore.snapshots.page_cache import resident_bytes

START_DEADLINE_S = 300.0
REQUEST_TIMEOUT_S = 600.0
MLX_LM, VLLM_MLX, PROMPTSTORE = "mlx_lm.server", "vllm-mlx", "promptstore serve"
PEERS = (MLX_LM, VLLM_MLX)


@dataclass
class Setup:
    """What every server of one run shares: the model, the budget, the environment."""

    python: str  # the project's python
    model: Path
    budget_bytes: int  # memory for cached prompts, the same for every server
    answer_tokens: int
    env: dict
    work: Path  # this run's folder: stores, caches, HOMEs and logs
    serve_args: list[str]
    vllm_python: str | None  # None: vllm-mlx is not run
    vllm_pythonpath: str
    warm_prompts: list[list[dict]] | None = None  # vllm-mlx's and promptstore's --warm-prompts, where they apply
    group: int = 1  # ranks of a sharded run under mlx.launch (tensor parallel); 1: one process
    group_backend: str = "ring"


def build(name: str, s: Setup) -> Server:
    """The server `name` with its best caching settings on `s`'s model and budget."""
    common = ["--max-tokens", str(s.answer_tokens)]
    mlx_args = ["--model", str(s.model), "--prompt-cache-size", "1000", "--prompt-cache-bytes", str(s.budget_bytes)]
    if name == MLX_LM:
        cmd = [s.python, "-m", "mlx_lm", "server", *mlx_args, *common]
        return Server(name, cmd, s.env, s.work / "mlx_lm.log", "default_model", group=_group(s))
    if name == PROMPTSTORE:
        # --prompt-cache-bytes is also promptstore's hot-tier budget (--hot-bytes' default).
        store = ["--store", str(s.work / "store")]
        if s.warm_prompts:  # the same file format as vllm-mlx's
            path = s.work / "promptstore-warm-prompts.json"
            path.write_text(json.dumps(s.warm_prompts))
            store += ["--warm-prompts", str(path)]
        cmd = [s.python, "-m", "promptstore", "serve", *mlx_args, *common, *store, *s.serve_args]
        return Server(name, cmd, s.env, s.work / "promptstore.log", "default_model", group=_group(s))
    if name == VLLM_MLX:
        return vllm_server(s, common)
    raise ValueError(f"unknown server {name!r}")


def vllm_server(s: Setup, common: list[str], cache: bool = True) -> Server:
    """vllm-mlx 0.6.0 with continuous batching, its memory-aware prefix cache at
    the budget, its SSD tier, and its warm prompts where given. Its HOME is the
    run's own (it saves its prefix cache there at SIGTERM), and requests name
    the model by the model directory, exactly."""
    home, ssd = s.work / ("vllm-home" if cache else "vllm-home-no-cache"), s.work / "vllm-ssd"
    home.mkdir(exist_ok=True)
    ssd.mkdir(exist_ok=True)
    env = {k: v for k, v in s.env.items() if k != "PYTHONPATH"}
    env |= {"HOME": str(home)} | ({"PYTHONPATH": s.vllm_pythonpath} if s.vllm_pythonpath else {})
    cmd = [s.vllm_python, "-m", "vllm_mlx.cli", "serve", str(s.model), "--continuous-batching"]
    if cache:
        # Its SSD tier's default cap (10 GB) is under the cuda profile's pressure workload.
        cmd += ["--cache-memory-mb", str(max(1, s.budget_bytes >> 20)), "--ssd-cache-dir", str(ssd)]
        cmd += ["--ssd-cache-max-gb", "32"]
    else:
        cmd += ["--disable-prefix-cache"]
    cmd += [*common, "--offline"]
    if s.warm_prompts and cache:
        path = s.work / "vllm-warm-prompts.json"
        path.write_text(json.dumps(s.warm_prompts))
        cmd += ["--warm-prompts", str(path)]
    log = s.work / ("vllm-mlx.log" if cache else "reference-vllm-mlx.log")
    return Server(VLLM_MLX, cmd, env, log, str(s.model), cwd=s.work)


def reference_server(name: str, s: Setup) -> Server:
    """`name`'s software with no prompt cache, so every request is a full prefill
    (vllm-mlx's own, since its replies' text differs from mlx-lm's: it keeps a
    reply's leading space)."""
    if name == VLLM_MLX:
        server = vllm_server(s, ["--max-tokens", str(s.answer_tokens)], cache=False)
    else:
        cmd = [s.python, "-m", "mlx_lm", "server", "--model", str(s.model), "--prompt-cache-size", "0"]
        cmd += ["--max-tokens", str(s.answer_tokens)]
        server = Server(MLX_LM, cmd, s.env, s.work / "reference.log", group=_group(s))
    server.name = f"{server.name}, no cache"
    return server


# What mlx.launch runs on each rank (it runs a script, not `python -m`).
LAUNCHED = {
    "mlx_lm": "from mlx_lm.server import main\nmain()\n",
    "promptstore": "import sys\nfrom promptstore.cli import main\nsys.exit(main())\n",
}


def _group(s: Setup) -> tuple[int, str, Path] | None:
    """(ranks, backend, a folder for the scripts mlx.launch runs) of a sharded run, None alone."""
    return (s.group, s.group_backend, s.work) if s.group > 1 else None


def launched(cmd: list[str], group: tuple[int, str, Path], first_port: int) -> list[str]:
    """`python -m MODULE ARGS` as mlx.launch starting it on each rank of `group`."""
    ranks, backend, folder = group
    python, module, args = cmd[0], cmd[2], cmd[3:]
    if module == "mlx_lm":  # `python -m mlx_lm server ...`: the script is the server's main
        args = args[1:]
    script = folder / f"launch_{module}.py"
    script.write_text(LAUNCHED[module])
    launcher = [python, "-c", "from mlx._distributed_utils.launch import main; main()", "--backend", backend]
    launcher += ["-n", str(ranks), "--starting-port", str(first_port), "--python", python, "--"]
    return [*launcher, str(script), *args]


def _free_ports(n: int) -> int:
    """The first of `n` consecutive loopback ports free now (the ring takes first + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for port in range(first, first + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError("no run of free loopback ports")


def _said_path(path: str) -> str:
    """A path as a result file says it: relative to the repository where it lies
    inside it (the results speak of the project, not of the machine)."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


def vllm_missing(python: str | None, pythonpath: str) -> str | None:
    """Why vllm-mlx cannot run from `python`, or None when it imports."""
    if not python:
        return "no python given"
    found = python if os.path.sep in python else None
    if found and not Path(found).exists():
        return f"{_said_path(found)} does not exist (make peers installs it)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHONPATH": pythonpath} if pythonpath else {}
    try:
        r = subprocess.run(
            [python, "-c", "import vllm_mlx, mlx_lm; print(vllm_mlx.__version__, mlx_lm.__version__)"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"{python}: {e}"
    if r.returncode != 0:
        return f"{python} cannot import vllm_mlx: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


class Server:
    """A server process on a free loopback port."""

    def __init__(
        self, name: str, cmd: list[str], env: dict, log: Path, model: str = "default_model", cwd=None, group=None
    ):
        self.name, self.cmd, self.env, self.log, self.model, self.cwd = name, cmd, env, log, model, cwd
        self.group = group  # (ranks, backend, folder): started sharded under mlx.launch
        self.proc = None
        self.port = 0
        self.starts = 0

    def start(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.starts += 1
        with open(self.log, "a") as log:
            log.write(f"\n==== bench: start {self.starts} ====\n")
            log.flush()
            cmd = [*self.cmd, "--host", "127.0.0.1", "--port", str(self.port)]
            if self.group is None:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, cwd=self.cwd)
            else:  # its own session (stop and kill reach every rank); a stdin that never ends, or it spins
                cmd = launched(cmd, self.group, _free_ports(self.group[0]))
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=log,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
        deadline = time.monotonic() + START_DEADLINE_S
        with httpx.Client(trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if http.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                self.kill()
                raise RuntimeError(f"{self.name} did not start; see {self.log}")
        # One untimed request unrelated to the workload: first-call costs are not a cache's.
        ask(self, [{"role": "user", "content": "Warm up."}], 4)
        return self

    def client(self) -> OpenAI:
        http = httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S)
        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, http_client=http)

    def stop(self) -> int:
        """SIGTERM: the server may save what it holds (a group: to every rank, since
        mlx.launch passes no signal on)."""
        if self.group is None:
            self.proc.send_signal(signal.SIGTERM)
        else:
            for pid in _session(self.proc.pid):
                if pid != self.proc.pid:
                    os.kill(pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        """SIGKILL: nothing is saved but what was on disk already."""
        if self.proc and self.proc.poll() is None:
            if self.group is None:
                self.proc.kill()
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def storage_reads(self) -> dict[str, int]:
        """What this process has read from storage so far (Linux): bytes through
        read calls that reached the disk, and major page faults."""
        out = {}
        try:
            for line in Path(f"/proc/{self.proc.pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    out["read_bytes"] = int(line.split()[1])
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out["major_faults"] = int(fields[9])  # majflt: field 12 of stat, the 10th after the name
        except (OSError, IndexError, ValueError):
            pass
        return out

    def health(self) -> dict | str:
        try:
            with httpx.Client(trust_env=False, timeout=5) as http:
                r = http.get(f"http://127.0.0.1:{self.port}/health")
            return r.json() if "json" in r.headers.get("content-type", "") else r.text[:200]
        except (httpx.HTTPError, ValueError) as e:
            return f"no answer: {e}"

    def resident(self) -> dict[str, int]:
        """Bytes in the page cache of each file this process maps (Linux)."""
        return {path: resident_bytes(path) or 0 for path in mapped_files(self.proc.pid)}

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


def _session(sid: int) -> list[int]:
    """The processes of session `sid` (Linux): a launcher and its ranks."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # the session id: field 6 of stat, the 4th after the name
            pids.append(int(stat.parent.name))
    return pids


def ask(server: Server, messages: list[dict], max_tokens: int, client: OpenAI | None = None) -> dict:
    """One streamed greedy chat completion: TTFT, tokens, cached, reply. TTFT is
    the first chunk that carries text (vllm-mlx streams an empty chunk first).
    A client made here is made before the clock starts: an application keeps its
    client, and making one (its HTTP pool, its TLS context) takes 17 ms on 2 CPU
    cores, none of it the server's."""
    client = client or server.client()
    started = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta and ttft is None:
            ttft = time.perf_counter() - started
        text += delta or ""
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details if usage else None
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - started,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": details.cached_tokens if details else None,  # None: the server does not say
        "completion_tokens": usage.completion_tokens if usage else None,
        "reply": text,
    }


def mapped_files(pid: int) -> list[str]:
    """The regular files a process maps (its libraries among them)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6}
    return sorted(p for p in paths if p.startswith("/") and not p.startswith(("/dev/", "/proc/", "/sys/")))


# promptstore serve's log: per-request timelines, inserts, spills, starts and stops.
TIMELINE = re.compile(
    r"request \((?P<tenant>[^)]*)\): prompt (?P<prompt>\d+) tokens, restored (?P<restored>\d+)"
    r"(?: \((?P<disk>\d+) from disk, (?P<plan>\w+)\))?.*?; (?P<phases>.*)$"
)
INSERT = re.compile(r"(?P<at>\d\d:\d\d:\d\d,\d+).*insert: (?P<held>\d+) tokens, (?P<new>\d+) new; (?P<phases>.*)$")
# A finished reply's store: forwards run over replies whose tokens do not round-trip the
# template (n forwards, the replies and tokens they stored), or none at all where they do.
REPLY_FORWARDS = re.compile(
    r"reply forwards: n=(?P<n>\d+) replies=(?P<replies>\d+) tokens=(?P<tokens>\d+) ms=(?P<ms>[0-9.]+)"
)
REPLY_NO_FORWARD = re.compile(r"reply stored without a forward: tokens=(?P<tokens>\d+)")
SPILL_FAILED = re.compile(r"spill of [0-9a-f]+ failed")
STARTUP = re.compile(
    r"warm start|GPU runtime libraries|kernel warm-up|model identity|Starting httpd|store closed|bench:"
)
# vllm-mlx's log: where each request's cache came from.
VLLM_FETCH = re.compile(
    r"\[cache_fetch\] request=\S+ (?P<kind>HIT|MISS) prompt_tokens=(?P<prompt>\d+)(?: cached=(?P<c>\d+))?"
)
VLLM_SSD = re.compile(r"\[ssd_promote\] request=\S+ .*")
VLLM_PERSIST = re.compile(
    r"\[cache_persist\] (?:SAVED|LOADED|loaded|no index).*|\[lifespan\] (?:Warm-up done|No prefix).*"
)


def phases(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split() if "=" in kv)}


def promptstore_log(text: list[str]) -> dict:
    """promptstore serve's per-request timelines (restored tokens, from disk,
    the plan, milliseconds per phase), its inserts, its reply stores (the
    forwards run, and the replies stored with none: their tokens), refused
    spills and the lines about starting and stopping, from its log. A log
    without reply-store lines (a server before them) gives none of them."""
    timelines, inserts, forwards, without = [], [], [], []
    for line in text:
        if m := TIMELINE.search(line):
            row = {"prompt": int(m["prompt"]), "restored": int(m["restored"]), "from_disk": int(m["disk"] or 0)}
            timelines.append(row | {"plan": m["plan"]} | phases(m["phases"]))
        elif m := INSERT.search(line):
            inserts.append({"at": m["at"], "tokens": int(m["held"]), "new": int(m["new"])} | phases(m["phases"]))
        elif m := REPLY_FORWARDS.search(line):
            forwards.append({k: int(m[k]) for k in ("n", "replies", "tokens")} | {"ms": float(m["ms"])})
        elif m := REPLY_NO_FORWARD.search(line):
            without.append(int(m["tokens"]))
    return {
        "timelines": timelines,
        "inserts": inserts,
        "reply_forwards": forwards,
        "replies_without_forward": without,
        "spills_refused": sum(1 for line in text if SPILL_FAILED.search(line)),
        "starts_and_stops": [line for line in text if STARTUP.search(line)],
    }


def vllm_log(text: list[str]) -> dict:
    """vllm-mlx's cache per request (hit or miss, cached tokens), its SSD
    promotions and its saves and loads, from its log."""
    fetches = [
        {"hit": m["kind"] == "HIT", "prompt": int(m["prompt"]), "cached": int(m["c"] or 0)}
        for line in text
        if (m := VLLM_FETCH.search(line))
    ]
    return {
        "fetches": fetches,
        "ssd_promotions": [m[0] for line in text if (m := VLLM_SSD.search(line))],
        "persistence": [m[0] for line in text if (m := VLLM_PERSIST.search(line))],
    }
