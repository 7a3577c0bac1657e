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
from pathlib import Path

import httpx
import pytest
import ray

from tests.cluster.conftest import SIM_MODEL
from tests.harness import ADMIN_TOKEN, API_KEY, ROOT

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


def test_monitor_agent_process_reports_nvml_gpus_to_the_hive(clean, tmp_path):
    """`python -m hive_apps.monitor` (the DaemonSet's command) with a fake NVML showing two GPUs on
    node-a: GET /admin/gpus shows them under node-a's stable name, live, and the in-Ray monitor
    takes node-a back when the agent stops."""
    hive = clean
    readings = tmp_path / "gpus.json"
    gpus = [{"name": "NVIDIA A100-SXM4-80GB", "total": 80 * GIB, "used": 1 * GIB, "uuid": "GPU-a100-0"},
            {"name": "NVIDIA L40S", "total": 48 * GIB, "used": 0, "uuid": "GPU-l40s-1"}]
    readings.write_text(json.dumps(gpus))
    token = tmp_path / "token"
    token.write_text(ADMIN_TOKEN)  # today's samples endpoint takes the admin token
    env = {**os.environ, "FAKE_PYNVML_GPUS": str(readings),
           "PYTHONPATH": os.pathsep.join([str(FAKE_PYNVML), str(ROOT)])}
    env.pop("HIVE_MONITOR_TOKEN", None)
    agent = subprocess.Popen([sys.executable, "-m", "hive_apps.monitor", "--registry-url", hive.url,
                              "--token-file", str(token), "--node-name", "node-a", "--interval", "0.5"], env=env)
    try:
        def shown():
            got = hive.gpus()
            a0, a1 = got.get("node-a:gpu0"), got.get("node-a:gpu1")
            return got if a0 and a1 and a0["device"]["name"] == gpus[0]["name"] and a1["device"]["name"] == gpus[1]["name"] else None

        got = wait_for(shown, 30, "the agent's NVML GPUs never reached GET /admin/gpus")
        a0, a1 = got["node-a:gpu0"], got["node-a:gpu1"]
        assert a0["total_bytes"] == 80 * GIB and a0["used_bytes"] == 1 * GIB and a0["device"]["uuid"] == "GPU-a100-0"
        assert a1["total_bytes"] == 48 * GIB and a1["used_bytes"] == 0 and a1["device"]["kind"] == "gpu"
        assert a0["reserved_bytes"] == 0 and a0["free_bytes"] == 79 * GIB
        nodes = {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}
        assert nodes["node-a"]["source"] == "agent"

        gpus[1]["used"] = 5 * GIB  # another process takes memory on the L40S: the next reading shows it
        readings.write_text(json.dumps(gpus))
        wait_for(lambda: hive.gpus()["node-a:gpu1"]["used_bytes"] == 5 * GIB, 20, "a changed NVML reading never arrived")
        assert agent.poll() is None
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    wait_for(lambda: hive.gpus().get("node-a:gpu0", {}).get("device", {}).get("name") == "H100-80GB", 30,
             "the in-Ray monitor did not take node-a back after the agent stopped")


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
