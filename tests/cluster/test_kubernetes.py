"""What the Kubernetes deployment relies on, on the local cluster: the VRAM-monitor agent as its
own process reading (simulated) NVML, and plain Ray work beside a serving hive."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
import ray

from tests.cluster.conftest import SIM_MODEL
from tests.harness import API_KEY, MONITOR_TOKEN, ROOT

pytestmark = pytest.mark.cluster

FAKE_PYNVML = ROOT / "tests" / "fixtures" / "fake_pynvml"
GIB = 2**30


def wait_for(check, timeout: float, what: str):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.time() < deadline, what
        time.sleep(0.5)


def test_monitor_agent_process_pushes_with_its_nodes_token(clean, tmp_path):
    """`python -m hive_apps.ops.monitor` (the DaemonSet's command) with a token file, as the DaemonSet
    runs it: node-a's token, issued by POST /admin/monitor-tokens, reports node-a (its view wins,
    /admin/nodes says "agent") and the in-Ray monitor takes node-a back when the agent stops. NVML
    GPUs that node-a's Ray monitor does not see are refused (422), node-b's token cannot report
    node-a (403), and the hive's secret itself is no agent token (401)."""
    hive = clean
    r = hive.admin.post("/monitor-tokens", json={"node_name": "node-a"})
    assert r.status_code == 200, r.text
    token = tmp_path / "token"
    token.write_text(r.json()["token"] + "\n")
    readings = tmp_path / "gpus.json"
    readings.write_text(json.dumps([{"name": "NVIDIA A100-SXM4-80GB", "total": 80 * GIB, "used": 1 * GIB},
                                    {"name": "NVIDIA L40S", "total": 48 * GIB, "used": 0}]))
    env = {**os.environ, "FAKE_PYNVML_GPUS": str(readings),
           "PYTHONPATH": os.pathsep.join([str(FAKE_PYNVML), str(ROOT)])}
    env.pop("HIVE_MONITOR_TOKEN", None)
    base = [sys.executable, "-m", "hive_apps.ops.monitor", "--registry-url", hive.url, "--token-file", str(token),
            "--node-name", "node-a"]

    def once(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(base + ["--once", *args], env=env, capture_output=True, text=True, timeout=60)

    lied = once()  # NVML GPUs on a node whose Ray pod sees two simulated H100s
    assert lied.returncode == 1 and "HTTP 422" in lied.stderr and "sample refused: devices" in lied.stderr, lied.stderr
    assert hive.gpus()["node-a:gpu0"]["device"]["name"] == "H100-80GB"

    readings.write_text("[]")  # no NVML GPUs: the agent reports node-a's simulated GPUs, as its Ray monitor does
    agent = subprocess.Popen(base + ["--sim-gpus", "H100-80GB.H100-80GB", "--interval", "0.5"], env=env)
    try:
        wait_for(lambda: {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}["node-a"]["source"]
                 == "agent", 30, "the agent's reading of node-a never reached the registry")
        assert hive.gpus()["node-a:gpu0"]["device"]["name"] == "H100-80GB"
        assert agent.poll() is None
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    wait_for(lambda: {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}["node-a"]["source"]
             == "ray-monitor", 30, "the in-Ray monitor did not take node-a back after the agent stopped")

    token.write_text(hive.admin.post("/monitor-tokens", json={"node_name": "node-b"}).json()["token"])
    other = once("--sim-gpus", "H100-80GB.H100-80GB")
    assert other.returncode == 1 and "HTTP 403" in other.stderr and "speaks for node 'node-b'" in other.stderr
    token.write_text(MONITOR_TOKEN)
    secret = once("--sim-gpus", "H100-80GB.H100-80GB")
    assert secret.returncode == 1 and "HTTP 401" in secret.stderr and "issue-token" in secret.stderr


@ray.remote(num_cpus=1)
def square(x: int) -> tuple[int, str]:
    return x * x, ray.get_runtime_context().get_node_id()


def readme_job_entrypoint() -> str:
    """The `ray job submit` command of manifests/README.md, so the documented command is what runs."""
    text = (ROOT / "manifests" / "README.md").read_text()
    m = re.search(r'ray job submit --address \S+ -- python -c \\\n\s+"([^"]+)"', text)
    assert m, "manifests/README.md no longer has the ray job submit example"
    return f'{sys.executable} -c "{m.group(1)}"'  # this venv's python: the job's PATH may not have it


def test_plain_ray_tasks_and_a_job_run_beside_a_serving_model(clean):
    """The seed's 'general Ray tasks on the same cluster': @ray.remote CPU tasks and a submitted job
    run while a sim model answers requests; all succeed and no reservation moves."""
    hive = clean
    r = hive.deploy(model_id="sim-beside", model=SIM_MODEL, engine="sim", gpu="node-b:gpu0",
                    max_input_prompt_length=512, max_output_prompt_length=128,
                    vllm_kwargs={"sim_tokens_per_s": 200})
    assert r.status_code == 200, r.text
    before = {d: s["reserved_bytes"] for d, s in hive.gpus().items()}
    assert before["node-b:gpu0"] > 0

    answers, errors, stop = [], [], threading.Event()

    def chat():
        with httpx.Client(base_url=f"{hive.url}/v1", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
            while not stop.is_set():
                try:
                    resp = c.post("/chat/completions", json={"model": "sim-beside", "max_tokens": 8,
                                                             "messages": [{"role": "user", "content": "hi"}]})
                    (answers if resp.status_code == 200 else errors).append(resp.status_code)
                except httpx.HTTPError as e:
                    errors.append(repr(e))

    clients = [threading.Thread(target=chat) for _ in range(3)]
    for t in clients:
        t.start()
    try:
        results = ray.get([square.remote(i) for i in range(24)], timeout=120)
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient(hive.dashboard_url)
        job = jobs.submit_job(entrypoint=readme_job_entrypoint())
        wait_for(lambda: jobs.get_job_status(job) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED), 120,
                 "the submitted job did not finish")
        logs = jobs.get_job_logs(job)
        assert jobs.get_job_status(job) == JobStatus.SUCCEEDED, logs
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=60)

    assert [v for v, _ in results] == [i * i for i in range(24)]
    assert len({node for _, node in results}) >= 2, "tasks should spread over the cluster's CPU nodes"
    assert "328350" in logs
    assert answers and not errors, errors[:5]
    assert {d: s["reserved_bytes"] for d, s in hive.gpus().items()} == before
    assert hive.admin.get("/models/sim-beside").json()["status"] == "ready"
