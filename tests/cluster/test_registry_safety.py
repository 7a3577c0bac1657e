"""Reservations under concurrency, start locks on shared devices, and node death."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve

from tests.cluster.conftest import SIM_MODEL

pytestmark = pytest.mark.cluster

GIB = 2**30


def small_spec(model_id: str, gpu: str, **kw) -> dict:
    """A fixed-size replica (explicit KV and batch), so a known number fit on one device."""
    return {"model_id": model_id, "model": SIM_MODEL, "engine": "sim", "gpu": gpu,
            "max_input_prompt_length": 256, "max_output_prompt_length": 64,
            "vllm_kwargs": {"max_num_seqs": 8, "max_num_batched_tokens": 2048,
                            "kv_cache_memory_bytes": 3 * GIB, **kw}}


def test_fifty_concurrent_deploys_never_oversubscribe(clean):
    hive = clean
    device = "node-b:gpu2"  # an A10, 24 GiB
    budget = int(0.9 * hive.gpus()[device]["total_bytes"])
    oversubscribed = []

    def deploy(i: int):
        r = hive.deploy(wait=False, **small_spec(f"race-{i}", device))
        state = hive.gpus()[device]
        if state["reserved_bytes"] > budget:
            oversubscribed.append(state["reserved_bytes"])
        return r

    with ThreadPoolExecutor(max_workers=50) as pool:
        answers = list(pool.map(deploy, range(50)))
    codes = [r.status_code for r in answers]
    accepted = [r for r in answers if r.status_code == 202]
    assert set(codes) <= {202, 409, 422}, codes
    assert 1 <= len(accepted) < 50
    for r in answers:
        if r.status_code != 202:
            assert "available" in r.json()["error"]["message"] or "short by" in r.json()["error"]["message"]
    final = hive.gpus()[device]
    assert not oversubscribed and final["reserved_bytes"] <= budget
    per_replica = accepted[0].json()["replicas"]["r0"]["reservation_bytes"]
    assert final["reserved_bytes"] == per_replica * len(accepted)
    assert len(accepted) == len(final["replicas"])
    # whoever lost the race left no record and no app behind
    listed = {m["model_id"] for m in hive.admin.get("/models").json()["models"]}
    assert listed == {r.json()["model_id"] for r in accepted}


def test_engines_sharing_a_device_start_one_at_a_time(clean):
    hive = clean
    device = "node-a:gpu1"
    for name in ("share-a", "share-b"):
        r = hive.deploy(wait=False, **small_spec(name, device, sim_start_delay_s=2))
        assert r.status_code == 202, r.text
    deadline = time.time() + 120
    while {hive.admin.get(f"/models/{n}").json()["status"] for n in ("share-a", "share-b")} != {"ready"}:
        assert time.time() < deadline
        time.sleep(0.5)
    windows = sorted(
        (info["start_began"], info["start_ended"])
        for info in (serve.get_deployment_handle("engine-r0", app_name=n).info.remote().result() for n in ("share-a", "share-b"))
    )
    (a0, a1), (b0, b1) = windows
    assert a1 - a0 >= 2 and b1 - b0 >= 2
    assert b0 >= a1, f"starts overlapped: {windows}"
    assert sorted(hive.gpus()[device]["replicas"]) == ["share-a/r0", "share-b/r0"]


def add_sim_node(hive, name: str, gpus: str):
    """Join a node with simulated GPUs and wait until the registry lists them."""
    node = hive.cluster.add_node(num_cpus=1, labels={"ray-hive/node": name, "ray-hive/sim-gpus": gpus})
    deadline = time.time() + 60
    while f"{name}:gpu0" not in hive.gpus():
        assert time.time() < deadline, f"{name} never reached the registry"
        time.sleep(0.5)
    return node


def test_dead_node_releases_reservations_and_shows_lost_replicas(clean):
    hive = clean
    node = add_sim_node(hive, "node-c", "L4")
    assert hive.deploy(**small_spec("doomed", "node-c:gpu0")).status_code == 200
    assert hive.deploy(**small_spec("survivor", "node-b:gpu1")).status_code == 200
    registry = serve.get_app_handle("hive-registry")
    assert len(registry.reservations.remote("doomed").result()) == 1

    hive.cluster.remove_node(node)
    t0 = time.time()
    while registry.reservations.remote("doomed").result():
        assert time.time() - t0 < 30, "reservation of a dead node's replica not released within 30 s"
        time.sleep(0.5)
    status = hive.admin.get("/models/doomed").json()
    assert status["status"] == "degraded" and "r0" in status["lost_replicas"]
    assert "node-c:gpu0" not in hive.gpus()
    assert hive.admin.get("/models/survivor").json()["status"] == "ready"
    assert len(registry.reservations.remote("survivor").result()) == 1


def test_replica_lost_with_its_node_is_replaced_elsewhere(clean):
    hive = clean
    node = add_sim_node(hive, "node-d", "H200")
    # auto placement with the performance policy takes the H200
    r = hive.deploy(model_id="phoenix", model=SIM_MODEL, engine="sim", vllm_kwargs={"sim_tokens_per_s": 1000})
    assert r.status_code == 200, r.text
    assert r.json()["replicas"]["r0"]["devices"] == ["node-d:gpu0"]

    hive.cluster.remove_node(node)
    deadline = time.time() + 90
    seen = set()
    while True:
        status = hive.admin.get("/models/phoenix").json()
        seen.add(status["status"])
        if status["status"] == "ready" and status["replicas"]["r0"]["devices"] != ["node-d:gpu0"]:
            break
        assert time.time() < deadline, f"not healed: {status}"
        time.sleep(0.5)
    assert "healing" in seen or "degraded" in seen
    new_device = status["replicas"]["r0"]["devices"][0]
    assert hive.gpus()[new_device]["replicas"] == ["phoenix/r0"] or "phoenix/r0" in hive.gpus()[new_device]["replicas"]
    out = hive.api.post("/v1/chat/completions", json={"model": "phoenix", "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": "back?"}]})
    assert out.status_code == 200, out.text


def test_simulated_gpu_memory_follows_engines_and_drift_shows(clean):
    hive = clean
    r = hive.deploy(**small_spec("exact", "node-a:gpu0"))
    assert r.status_code == 200, r.text
    reserved = r.json()["replicas"]["r0"]["reservation_bytes"]
    r = hive.deploy(**small_spec("greedy", "node-a:gpu1", sim_memory_factor=1.2))
    assert r.status_code == 200, r.text
    deadline = time.time() + 20
    while True:
        gpus = hive.gpus()
        greedy = hive.admin.get("/models/greedy").json()
        if gpus["node-a:gpu1"]["used_bytes"] > 0 and greedy["drift"]:
            break
        assert time.time() < deadline, (gpus["node-a:gpu1"], greedy)
        time.sleep(0.5)
    assert gpus["node-a:gpu0"]["used_bytes"] == reserved and gpus["node-a:gpu0"]["foreign_bytes"] == 0
    assert gpus["node-a:gpu1"]["used_bytes"] == int(reserved * 1.2)
    assert gpus["node-a:gpu1"]["reserved_bytes"] == int(reserved * 1.2)  # the overrun counts against the GPU
    assert "+20%" in greedy["drift"]["r0"]
    assert hive.admin.get("/models/exact").json()["drift"] == {}


def test_standalone_agent_pushes_over_http(clean):
    """The agent with node-b's own token (from the CLI, as an operator issues it) reports node-b's
    devices; it cannot report another node, nor devices node-b's Ray monitor does not see."""
    import subprocess
    import sys

    from tests.harness import ADMIN_TOKEN, MONITOR_TOKEN

    hive = clean
    issued = subprocess.run([sys.executable, "-m", "hive_apps.ops.monitor", "issue-token", "--node-name", "node-b"],
                            env={**os.environ, "HIVE_MONITOR_TOKEN": MONITOR_TOKEN}, capture_output=True, text=True,
                            timeout=60)
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "HIVE_MONITOR_TOKEN"}

    def agent_cmd(node: str, sim_gpus: str, secret: str = token) -> list[str]:
        return [sys.executable, "-m", "hive_apps.ops.monitor", "--registry-url", hive.url, "--token", secret,
                "--node-name", node, "--sim-gpus", sim_gpus]

    def run_once(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cmd, "--once"], env=env, capture_output=True, text=True, timeout=60)

    bad = run_once(*agent_cmd("nowhere", "L4", ADMIN_TOKEN))  # operators may push any node Ray knows
    assert bad.returncode == 1 and "no alive Ray node is named 'nowhere'" in bad.stderr
    other = run_once(*agent_cmd("node-a", "H100-80GB.H100-80GB"))
    assert other.returncode == 1 and "speaks for node 'node-b'" in other.stderr
    lie = run_once(*agent_cmd("node-b", "H200"))  # one H200 where node-b's Ray monitor sees L4, L4, A10
    assert lie.returncode == 1 and "sample refused: devices" in lie.stderr
    agent = subprocess.Popen(agent_cmd("node-b", "L4.L4.A10") + ["--interval", "0.5"], env=env)
    try:
        deadline = time.time() + 30
        while {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}["node-b"]["source"] != "agent":
            assert time.time() < deadline, "the agent's reading never reached the registry"
            time.sleep(0.5)
        assert {"node-b:gpu0", "node-b:gpu1", "node-b:gpu2"} <= set(hive.gpus())
        nodes = {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}
        assert nodes["node-b"]["host_total_bytes"] > 0
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    deadline = time.time() + 30
    while {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}["node-b"]["source"] != "ray-monitor":
        assert time.time() < deadline, "the Ray monitor did not take over after the agent stopped"
        time.sleep(0.5)
    assert hive.gpus()["node-b:gpu0"]["device"]["name"] == "L4"


def test_host_ram_is_tracked_per_node(clean):
    hive = clean
    nodes = {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}
    assert {"head", "node-a", "node-b"} <= set(nodes)
    head = nodes["head"]
    assert head["devices"] == ["head:cpu"] and 0 < head["host_used_bytes"] < head["host_total_bytes"]
    assert nodes["node-a"]["devices"] == ["node-a:gpu0", "node-a:gpu1"]
    r = hive.deploy(model_id="ram-user", model=SIM_MODEL, engine="sim", gpu="head:cpu",
                    max_input_prompt_length=256, max_output_prompt_length=64)
    assert r.status_code == 200, r.text
    held = {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}["head"]["host_reserved_bytes"]
    assert held == r.json()["replicas"]["r0"]["reservation_bytes"]


def test_node_dying_while_a_heal_is_in_flight_ends_healed(clean):
    """The lost update of the old admin: when a heal's replacement came up it read the record,
    asked the engines for their start times and wrote the whole record back as 'ready', erasing
    a loss the registry recorded meanwhile: 'ready' with a replica gone, never healed again.
    Here the replacement's node dies the moment its engine is healthy: the model must end ready
    on a live node (the bug ended 'ready' on the dead one for good)."""
    from ray import serve

    hive = clean
    first = add_sim_node(hive, "node-e", "H200")
    second = add_sim_node(hive, "node-f", "H200")
    r = hive.deploy(model_id="lazarus", model=SIM_MODEL, engine="sim",
                    vllm_kwargs={"sim_tokens_per_s": 1000, "sim_start_delay_s": 2})
    assert r.status_code == 200, r.text
    start_node = r.json()["replicas"]["r0"]["devices"][0].split(":")[0]
    nodes = {"node-e": first, "node-f": second}
    hive.cluster.remove_node(nodes.pop(start_node))
    dead = {start_node}
    deadline = time.time() + 60
    while True:  # the heal places the replacement on the other H200 node
        status = hive.admin.get("/models/lazarus").json()
        target = status["replicas"]["r0"]["devices"][0].split(":")[0]
        if status["status"] == "healing" and target in nodes:
            break
        assert time.time() < deadline, f"no heal began: {status}"
        time.sleep(0.05)
    while True:  # ... and its node dies as soon as Serve reports the replacement healthy
        app = serve.status().applications.get("lazarus")
        if app is not None and app.deployments.get("engine-r0") and app.deployments["engine-r0"].status == "HEALTHY":
            hive.cluster.remove_node(nodes.pop(target))
            dead.add(target)
            break
        assert time.time() < deadline, "the replacement never became healthy"
        time.sleep(0.02)
    # Until Ray reports the node dead (about a second), the hive may still record the replacement
    # 'ready' there: the fault is a 'ready' on the dead node that stays, i.e. is never healed again.
    deadline = time.time() + 120
    seen = []
    while True:
        status = hive.admin.get("/models/lazarus").json()
        placed = {d.split(":")[0] for d in status["replicas"]["r0"]["devices"]}
        seen.append((round(time.time(), 1), status["status"], sorted(placed)))
        if status["status"] == "ready" and not placed & dead:
            break
        assert time.time() < deadline, f"not healed (a 'ready' on a dead node never healed again?): {status}; " \
                                       f"seen {seen[-5:]}"
        time.sleep(0.2)
    assert not status["lost_replicas"]
    out = hive.api.post("/v1/chat/completions", json={"model": "lazarus", "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": "alive?"}]})
    assert out.status_code == 200, out.text


def test_a_model_is_routable_on_v1_as_soon_as_it_is_ready(clean):
    hive = clean
    r = hive.deploy(wait=False, **small_spec("prompt", "node-b:gpu0", sim_start_delay_s=2))
    assert r.status_code == 202, r.text
    body = {"model": "prompt", "max_tokens": 1, "messages": [{"role": "user", "content": "now?"}]}
    deadline = time.time() + 120
    while True:
        out = hive.api.post("/v1/chat/completions", json=body)
        if out.status_code == 200:
            answered = time.time()
            break
        assert out.status_code == 404, out.text
        assert time.time() < deadline
        time.sleep(0.02)
    ready_at = hive.admin.get("/models/prompt").json()["ready_at"]
    lag_ms = (answered - ready_at) * 1000
    print(f"\n[figure] /v1 answered {lag_ms:.0f} ms after the registry recorded 'ready' (request time included)")
    assert lag_ms < 1000
