"""A real hive on a local multi-node Ray cluster, deployed from serve_configs/hive.yaml.

Each node is a real raylet (``ray.cluster_utils.Cluster``); simulated GPUs come from the
``ray-hive/sim-gpus`` label exactly as in production. The base config goes through the
dashboard's REST API like ``serve deploy`` does. Never ``ray stop`` here: it would kill
every Ray process on the machine.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from hive_apps.ops.serve_env import SERVE_ENV

ROOT = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "test-admin-token"
API_KEY = "test-api-key"
OTHER_API_KEY = "test-api-key-2"  # a second client (per-key shares, e.g. of a sleeping model's hold slots)
MONITOR_TOKEN = "test-monitor-token"
SIM_MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")  # a config the planner knows


# Ports the tests' hives listen on (proxy, dashboard, edge): outside the kernel's ephemeral range
# (32768-60999), where Ray's processes and every outgoing connection take ports of their own at any
# moment, and outside Ray's worker ports (10002-19999); never one handed out before in this run (two
# port-0 binds in a row may return the same port: the edge once took the proxy's, and a whole tier failed).
TEST_PORTS = range(20000, 29000)
_given: set[int] = set()


def free_port() -> int:
    for port in random.sample(TEST_PORTS, len(TEST_PORTS)):
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


@dataclass
class Hive:
    url: str
    cluster: object
    config: dict
    dashboard_url: str
    edge_url: str = ""  # the edge (HIVE_EDGE_PORT): HAProxy carrying /v1 and /<id>/v1 straight to engines
    admin: httpx.Client = field(init=False)
    api: httpx.Client = field(init=False)

    def __post_init__(self):
        self.admin = httpx.Client(base_url=f"{self.url}/admin", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=600)
        self.api = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def deploy(self, wait: bool = True, **spec) -> httpx.Response:
        return self.admin.post("/models", params={"wait": str(wait).lower()}, json=spec)

    def gpus(self) -> dict[str, dict]:
        return {d["device"]["id"]: d for d in self.admin.get("/gpus").json()["devices"]}

    def deploy_base_config(self) -> None:
        """What `serve deploy serve_configs/hive.yaml` does: PUT the config to the dashboard."""
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        ServeSubmissionClient(self.dashboard_url).deploy_applications(self.config)

    def serve_apps(self) -> set[str]:
        from ray import serve

        return set(serve.status().applications)

    def wait_app_gone(self, name: str, timeout: float = 60.0) -> set[str]:
        """Serve's apps once ``name`` is gone or ``timeout`` passed: a deleted model's app goes after
        its record (its router drains for 30 s behind Serve's HAProxy ingress)."""
        deadline = time.time() + timeout
        while name in (apps := self.serve_apps()) and time.time() < deadline:
            time.sleep(0.5)
        return apps


def start_hive(nodes: list[dict], head_labels: dict[str, str] | None = None, env: dict[str, str] | None = None) -> Hive:
    """Start a cluster (head + ``nodes``), deploy the hive config, and wait for /admin/healthz."""
    import ray
    import ray.serve  # noqa: F401  (before the update below: see there)
    from ray.cluster_utils import Cluster

    # The cluster's processes start from this environment. The test process itself is a client,
    # not a Serve replica: Serve read its settings when it was imported above, so it keeps its
    # defaults and the tests' synchronous handle calls (``.remote().result()``) get a router loop.
    os.environ.update({
        "RAY_AUTH_MODE": "disabled",
        "HIVE_ADMIN_TOKEN": ADMIN_TOKEN,
        "HIVE_API_KEYS": f"{API_KEY},{OTHER_API_KEY}",
        "HIVE_MONITOR_TOKEN": MONITOR_TOKEN,
        "HIVE_MONITOR_INTERVAL_S": "0.5",
        "HIVE_DEPLOY_TIMEOUT_S": "600",
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "hive_apps.serving.request_ids.proxy_middlewares",
        "RAY_metrics_report_interval_ms": "2000",  # Ray's default 10 s would make the metrics test wait
        **SERVE_ENV,  # Serve's settings as every hive runs them (hive_apps/ops/serve_env.py)
        "HIVE_WEIGHTS_CACHE": tempfile.mkdtemp(prefix="hive-weights-"),  # never the user's own cache
        "HIVE_EDGE_PORT": str(free_port()),
        **(env or {}),
    })
    dashboard_port, http_port = free_port(), free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": True,
            "dashboard_port": dashboard_port,
            "labels": {"ray-hive/node": "head", **(head_labels or {})},
        },
    )
    for node in nodes:
        cluster.add_node(num_cpus=1, **node)
    ray.init(address=cluster.address, logging_level="WARNING")

    config = yaml.safe_load((ROOT / "serve_configs" / "hive.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    hive = Hive(url=f"http://127.0.0.1:{http_port}", cluster=cluster, config=config,
                dashboard_url=f"http://127.0.0.1:{dashboard_port}", edge_url=f"http://127.0.0.1:{os.environ['HIVE_EDGE_PORT']}")
    deadline = time.time() + 60
    while True:  # the dashboard's REST API answers a few seconds after the head is up
        try:
            hive.deploy_base_config()
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1)
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            r = hive.admin.get("/healthz", timeout=5)
            if r.status_code == 200 and r.json()["registry"]["devices"] >= len(nodes) + 1:
                return hive
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the hive did not become healthy within 180 s")


def stop_hive(hive: Hive) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        hive.cluster.shutdown()


def edge_warm(hive: Hive, model_id: str, prefix: str = "") -> None:
    """Until the edge sends ``model_id``'s requests straight to its engine: each gateway replica declines
    (the Serve path answers) until its replica set has learnt the engine's port, one load poll after the
    first request it sees; the kernel spreads connections over the replicas' edges, so several in a row."""
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    direct, deadline = 0, time.time() + 30
    while direct < 10:
        r = httpx.post(f"{hive.edge_url}{prefix}/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        direct = direct + 1 if r.headers.get("x-hive-edge") == "1" else 0
        assert time.time() < deadline, "the edge never routed the model itself"
        time.sleep(0.1)


def openai_clients(hive: Hive, model_id: str, async_: bool = False) -> list:
    """OpenAI SDK clients for /v1 and for the model's own /<model_id>/v1."""
    import openai

    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return [cls(base_url=f"{hive.url}/v1", api_key=API_KEY), cls(base_url=f"{hive.url}/{model_id}/v1", api_key=API_KEY)]


def run_example(hive: Hive, script: str, *args: str, timeout: float = 120, **env: str) -> str:
    """Run examples/<script> as a user would (a subprocess talking HTTP to ``hive``); its stdout."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "HIVE_URL": hive.url, "HIVE_ADMIN_TOKEN": ADMIN_TOKEN, "HIVE_API_KEY": API_KEY, **env})
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def scrape_metrics(hive: Hive) -> str:
    """Every node's Prometheus text from Ray's metrics agents (a node that does not answer is left out)."""
    texts = []
    for node in [hive.cluster.head_node, *hive.cluster.worker_nodes]:
        try:
            texts.append(httpx.get(f"http://127.0.0.1:{node.metrics_export_port}/metrics", timeout=10).text)
        except httpx.HTTPError:
            pass
    return "\n".join(texts)
