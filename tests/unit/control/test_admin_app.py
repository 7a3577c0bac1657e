"""The admin's request logic in-process: ``make_admin_app`` on the in-memory cluster, with a real
registry behind it and its own reconciler and loops running (the fake cluster's engines start at
once). What the cluster tier checked of the admin's HTTP shapes (4xx for bad specs and plans,
forged samples, tokens) runs here; real Serve stays there."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from hive_apps.control.admin.ingress import make_admin_app
from hive_apps.control.cluster import set_cluster
from hive_apps.control.registry.deployment import Registry
from hive_apps.core import names
from hive_apps.core.auth import node_monitor_token
from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import ModelRecord, ModelStatus, Reservation
from tests.unit.fake_cluster import FakeCluster

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs"
SIM_MODEL = str(FIXTURES / "Qwen__Qwen3-0.6B")
BIG_MODEL = str(FIXTURES / "meta-llama__Llama-3.1-70B")
MONITOR_SECRET = "mon-secret"
ADMIN = {"Authorization": "Bearer adm"}
SETTINGS = HiveSettings(admin_token="adm", monitor_token=MONITOR_SECRET, auth_disabled=False, deploy_timeout_s=30)
# the cluster tier's layout (tests/cluster/conftest.py), less its CPU-only head
NODES = {"node-a": "H100-80GB.H100-80GB", "node-b": "L4.L4.A10"}


@dataclass
class Admin:
    client: httpx.AsyncClient  # sends the admin token
    anonymous: httpx.AsyncClient
    registry: Registry
    cluster: FakeCluster
    app: FastAPI

    async def deploy(self, wait: bool = True, **spec) -> httpx.Response:
        return await self.client.post("/models", params={"wait": str(wait).lower()}, json=spec)

    async def gpus(self) -> dict[str, dict]:
        return {d["device"]["id"]: d for d in (await self.client.get("/gpus")).json()["devices"]}


async def registry_on(cluster: FakeCluster, settings: HiveSettings = SETTINGS) -> Registry:
    """A registry on ``cluster``, sampled once (its own loop stopped: tests sample when they mean to)."""
    set_cluster(cluster)  # the registry takes its seam from there
    registry = Registry.__new__(Registry)
    await registry.__init__(settings)
    registry._loop_task.cancel()
    cluster.serve(names.REGISTRY_APP, registry)
    await registry.sample_once()
    return registry


@asynccontextmanager
async def admin_on(cluster: FakeCluster, settings: HiveSettings = SETTINGS):
    """The admin app on ``cluster`` in front of a registry there, and clients of the app with and
    without the admin token."""
    registry = await registry_on(cluster, settings)
    app = make_admin_app(cluster, settings)
    app.state.admin.reconciler.apply_grace_s = 0  # the fake cluster's apps never flap after a build
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://hive", headers=ADMIN) as client, \
                httpx.AsyncClient(transport=transport, base_url="http://hive") as anonymous:
            yield Admin(client, anonymous, registry, cluster, app)
    finally:
        app.state.admin.close()
        await asyncio.sleep(0)  # the cancelled loops end
        set_cluster(None)


@pytest.fixture
async def admin():
    async with admin_on(FakeCluster(NODES)) as a:
        yield a


async def eventually(done, timeout_s: float = 5.0) -> bool:
    """Whether ``done()`` came true within the timeout (the admin's loops run beside the test)."""
    for _ in range(int(timeout_s / 0.05)):
        if done():
            return True
        await asyncio.sleep(0.05)
    return done()


def sim_spec(model_id: str, **kw) -> dict:
    return {"model_id": model_id, "model": SIM_MODEL, "engine": "sim", "max_input_prompt_length": 512,
            "max_output_prompt_length": 128, "vllm_kwargs": {"sim_tokens_per_s": 500}, **kw}


async def test_deploy_list_get_and_delete(admin):
    r = await admin.deploy(**sim_spec("m", gpu="node-a:gpu0"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["route"] == "/m" and body["status_url"] == "/admin/models/m"
    r0 = body["replicas"]["r0"]
    assert r0["devices"] == ["node-a:gpu0"] and r0["engine_start_s"] == 1.5  # the fake engine's
    assert admin.cluster.apps["m"].plan.replicas[0].devices == ["node-a:gpu0"]  # the reconciler built it
    gpu = (await admin.gpus())["node-a:gpu0"]
    assert gpu["reserved_bytes"] == r0["reservation_bytes"] > 0 and gpu["replicas"] == ["m/r0"]

    listed = (await admin.client.get("/models")).json()["models"]
    assert [(m["model_id"], m["status"]) for m in listed] == [("m", "ready")]
    assert (await admin.client.get("/models/m")).json()["replicas"]["r0"]["devices"] == ["node-a:gpu0"]

    r = await admin.client.delete("/models/m")
    assert r.status_code == 200 and r.json() == {"deleted": "m"}, r.text
    assert await eventually(lambda: "m" in admin.cluster.deleted)  # the app goes after the record
    assert (await admin.gpus())["node-a:gpu0"]["reserved_bytes"] == 0
    r = await admin.client.get("/models/m")
    assert r.status_code == 404 and r.json()["error"]["field"] == "model_id"
    r = await admin.client.delete("/models/m")
    assert r.status_code == 404 and "GET /admin/models lists them" in r.json()["error"]["message"]


async def test_a_deploy_without_wait_is_202_and_the_loops_make_it_ready(admin):
    r = await admin.deploy(wait=False, **sim_spec("later", gpu="node-b:gpu2"))
    assert r.status_code == 202 and r.json()["status"] == "deploying", r.text
    assert await eventually(lambda: admin.registry.book.records["later"].status is ModelStatus.READY)
    assert (await admin.client.get("/models/later")).json()["status"] == "ready"
    r = await admin.client.delete("/models")
    assert r.status_code == 200 and r.json() == {"deleted": ["later"]}, r.text


async def test_a_failed_deploy_is_a_422_and_leaves_nothing(admin):
    admin.cluster.start_mode["bad"] = "fail"
    r = await admin.deploy(**sim_spec("bad", gpu="node-b:gpu1"))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert "simulated engine start failure" in err["message"] and err["status_detail"]["status"] == "failed"
    assert "bad" not in admin.cluster.apps and (await admin.gpus())["node-b:gpu1"]["reserved_bytes"] == 0


async def test_a_new_admin_resumes_what_the_registry_records_and_sweeps_orphan_apps():
    """A record a previous admin left deploying reaches ready; a model app no record explains goes."""
    cluster = FakeCluster(NODES)
    registry = await registry_on(cluster)
    spec = ModelSpec(**sim_spec("left", gpu="node-a:gpu1"))
    outcome = cluster.handles[names.PLANNER_APP].target.plan(spec, await registry.capacities())
    record = ModelRecord(model_id="left", spec=spec, plan=outcome.plan)
    created = await registry.transition(t.Create(model_id="left", record=record, reservations=[
        Reservation.for_replica("left", rp) for rp in outcome.plan.replicas]))
    assert created.ok, created.message
    cluster.run_model_app("orphan", outcome.plan, None)
    app = make_admin_app(cluster, SETTINGS)
    app.state.admin.reconciler.apply_grace_s = 0
    try:
        assert await eventually(lambda: registry.book.records["left"].status is ModelStatus.READY), \
            registry.book.records["left"].message
        assert await eventually(lambda: "orphan" in cluster.deleted)
        assert "left" in cluster.apps
    finally:
        app.state.admin.close()
        set_cluster(None)


async def test_every_route_but_healthz_and_the_docs_needs_the_admin_token(admin):
    for method, path in (("GET", "/models"), ("GET", "/models/m"), ("POST", "/models"), ("DELETE", "/models"),
                         ("POST", "/plan"), ("GET", "/gpus"), ("GET", "/nodes"), ("GET", "/weights"),
                         ("GET", "/load"), ("POST", "/registry/reset"), ("POST", "/monitor-tokens"),
                         ("POST", "/models/m/sleep"), ("POST", "/models/m/wake"), ("GET", "/history"),
                         ("PUT", "/models/m"), ("GET", "/declared"), ("POST", "/adapters"), ("GET", "/adapters"),
                         ("GET", "/adapters/a"), ("DELETE", "/adapters/a")):
        r = await admin.anonymous.request(method, path, json={})
        assert r.status_code == 401 and "HIVE_ADMIN_TOKEN" in r.json()["error"]["message"], (method, path, r.text)
    r = await admin.anonymous.get("/models", headers={"Authorization": "Bearer not-adm"})
    assert r.status_code == 401
    r = await admin.anonymous.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok" and "registry" in r.json()
    assert (await admin.anonymous.get("/docs")).status_code == 200
    page = await admin.anonymous.get("/")
    assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
    assert "content-security-policy" in page.headers
    paths = (await admin.anonymous.get("/openapi.json")).json()["paths"]
    assert {"/models", "/models/{model_id}", "/plan", "/gpus", "/nodes", "/weights", "/registry/samples",
            "/monitor-tokens", "/registry/reset", "/load", "/healthz", "/models/{model_id}/sleep",
            "/models/{model_id}/wake", "/history", "/declared", "/adapters", "/adapters/{model_id}"} == set(paths)


async def test_gpus_and_nodes_list_what_the_registry_sampled(admin):
    gpus = await admin.gpus()
    assert set(gpus) == {"node-a:gpu0", "node-a:gpu1", "node-b:gpu0", "node-b:gpu1", "node-b:gpu2"}
    assert gpus["node-a:gpu0"]["device"]["name"] == "H100-80GB" and gpus["node-a:gpu0"]["total_bytes"] == 80 * 2**30
    assert gpus["node-b:gpu2"]["device"]["name"] == "A10"
    assert all(d["free_bytes"] + d["used_bytes"] == d["total_bytes"] and d["reserved_bytes"] == 0 for d in gpus.values())
    r = await admin.client.get("/nodes")
    assert r.status_code == 200, r.text
    nodes = {n["node_name"]: n for n in r.json()["nodes"]}
    assert set(nodes) == {"node-a", "node-b"}
    assert nodes["node-b"]["host_total_bytes"] == 64 * 2**30 and len(nodes["node-b"]["devices"]) == 3
    assert "weights_disk" in nodes["node-a"]


async def test_monitor_tokens_are_issued_only_where_the_secret_is_set(admin):
    r = await admin.client.post("/monitor-tokens", json={"node_name": "node-b"})
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store", r.text
    assert r.json() == {"node_name": "node-b", "token": node_monitor_token(MONITOR_SECRET, "node-b")}
    async with admin_on(FakeCluster(NODES), SETTINGS.model_copy(update={"monitor_token": None})) as bare:
        r = await bare.client.post("/monitor-tokens", json={"node_name": "node-b"})
        assert r.status_code == 409 and "no HIVE_MONITOR_TOKEN" in r.json()["error"]["message"], r.text


async def test_plan_dry_run_reserves_nothing(admin):
    """From tests/cluster/test_sim_hive.py."""
    before = {k: v["reserved_bytes"] for k, v in (await admin.gpus()).items()}
    r = await admin.client.post("/plan", json=sim_spec("what-if", gpu="node-b:gpu2"))
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["replicas"][0]["devices"] == ["node-b:gpu2"]
    text = (await admin.client.post("/plan", params={"format": "text"}, json=sim_spec("what-if", gpu="node-b:gpu2"))).text
    assert "node-b:gpu2" in text and "max_num_seqs" in text
    assert {k: v["reserved_bytes"] for k, v in (await admin.gpus()).items()} == before
    assert (await admin.client.get("/models/what-if")).status_code == 404
    r = await admin.client.post("/plan", params={"format": "yaml"}, json=sim_spec("what-if"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "format"


async def test_bad_requests_get_clear_4xx(admin):
    """From tests/cluster/test_sim_hive.py."""
    r = await admin.deploy(**sim_spec("Bad_Id"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "model_id"
    r = await admin.deploy(**sim_spec("hive-x"))
    assert r.status_code == 422 and "reserved" in r.json()["error"]["message"]
    r = await admin.deploy(**{**sim_spec("x1"), "replicaz": 2})
    assert r.status_code == 422 and "unknown field" in r.json()["error"]["message"]
    r = await admin.deploy(**sim_spec("x2", gpu="node-z:gpu9"))
    assert r.status_code == 404 and "node-z:gpu9" in r.json()["error"]["message"]
    r = await admin.deploy(**sim_spec("x3", model="/no/such/model"))
    assert r.status_code == 422 and "/no/such/model" in r.json()["error"]["message"]
    assert (await admin.deploy(**sim_spec("dup"))).status_code == 200
    r = await admin.deploy(**sim_spec("dup"))
    assert r.status_code == 409 and r.json()["error"]["field"] == "model_id"
    assert (await admin.anonymous.get("/models")).status_code == 401
    assert (await admin.client.get("/models/nope")).status_code == 404
    # nothing but "dup" holds memory
    held = {rep for d in (await admin.gpus()).values() for rep in d["replicas"]}
    assert held == {"dup/r0"}


def spec(model_id: str, **kw) -> dict:
    return {"model_id": model_id, "model": SIM_MODEL, "engine": "sim", "max_input_prompt_length": 512,
            "max_output_prompt_length": 128, **kw}


async def test_tensor_parallel_group_must_share_a_node(admin):
    """From tests/cluster/test_placement.py."""
    r = await admin.client.post("/plan", json=spec("tp-bad", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=1))
    assert r.status_code == 422 and "node" in r.json()["error"]["message"]


async def test_invalid_combinations_are_4xx(admin):
    """From tests/cluster/test_placement.py."""
    cases = [
        (spec("x", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=3), 422, "replicas"),
        (spec("x", gpu="node-a:gpu0", replicas=2), 422, "replicas"),
        (spec("x", gpu="node-a:gpu7"), 404, "node-a:gpu7"),
        (spec("x", engine="vllm", gpu="node-a:gpu0"), 422, "simulated"),
        (spec("x", model=BIG_MODEL, gpu="node-b:gpu0"), 422, "GiB"),
    ]
    for body, status, needle in cases:
        r = await admin.client.post("/plan", json=body)
        assert r.status_code == status and needle in r.json()["error"]["message"], (body, r.text)


async def test_forged_samples_are_refused_and_the_monitor_token_opens_only_samples(admin):
    """From tests/cluster/test_hardening.py."""
    agent = {"Authorization": f"Bearer {node_monitor_token(MONITOR_SECRET, 'node-b')}"}
    gpu = {"id": "node-b:gpu0", "node_id": "x", "node_name": "node-b", "kind": "gpu", "index": 0, "name": "L4",
           "total_bytes": 80 * 2**30, "used_bytes": 0}
    sample = {"node_id": "x", "node_name": "node-b", "host_total_bytes": 2**36, "host_used_bytes": 2**34,
              "cpu_count": 8, "devices": [{**gpu, "total_bytes": 1200 * 2**40}]}
    post = admin.anonymous.post
    r = await post("/registry/samples", json=sample, headers=agent)
    assert r.status_code == 422 and "1 TiB" in r.json()["error"]["message"]
    r = await post("/registry/samples", json={**sample, "devices": [gpu, {**gpu, "id": "node-b:gpu1"}]}, headers=agent)
    assert r.status_code == 422 and "twice" in r.json()["error"]["message"]
    r = await post("/registry/samples", json={**sample, "devices": [gpu]}, headers=agent)  # one 80 GB "L4" on an L4, L4, A10 node
    assert r.status_code == 422 and "sample refused: devices" in r.json()["error"]["message"]
    r = await post("/registry/samples", json={**sample, "node_name": "node-a", "devices": []}, headers=agent)
    assert r.status_code == 403 and "speaks for node 'node-b'" in r.json()["error"]["message"]
    r = await post("/registry/samples", json=sample, headers={"Authorization": f"Bearer {MONITOR_SECRET}"})
    assert r.status_code == 401 and "issue-token" in r.json()["error"]["message"]  # the secret is no agent token
    assert (await admin.anonymous.get("/models", headers=agent)).status_code == 401
    assert (await post("/models", json={}, headers=agent)).status_code == 401
    assert (await post("/monitor-tokens", json={"node_name": "node-a"}, headers=agent)).status_code == 401


# --- the status page's actions and history (issue 31) ----------------------------------------------
async def test_sleep_now_and_wake_now(admin):
    assert (await admin.deploy(**sim_spec("m", gpu="node-a:gpu0", sleep_timeout=3600))).status_code == 200
    assert (await admin.deploy(**sim_spec("awake", gpu="node-a:gpu1"))).status_code == 200
    assert (await admin.client.get("/models/m")).json()["can_sleep"] is True

    r = await admin.client.post("/models/m/sleep")
    assert r.status_code == 202 and r.json()["status"] == "sleeping", r.text
    assert await eventually(lambda: not admin.registry.book.records["m"].resident)
    body = (await admin.client.get("/models/m")).json()
    assert body["status"] == "sleeping" and body["sleep_mode"] == "parked" and "operator" in body["sleep_reason"]
    assert body["slept_at"] is not None and str(int(body["slept_at"])) not in body["message"], body["message"]
    assert (await admin.gpus())["node-a:gpu0"]["reserved_bytes"] == 0
    r = await admin.client.post("/models/m/sleep")
    assert r.status_code == 409 and "is sleeping" in r.json()["error"]["message"], r.text

    r = await admin.client.post("/models/m/wake")
    assert r.status_code == 202 and r.json()["status"] == "waking", r.text
    assert await eventually(lambda: admin.registry.book.records["m"].status is ModelStatus.READY)
    body = (await admin.client.get("/models/m")).json()
    assert body["last_wake"]["how"] == "parked" and body["slept_at"] is None and body["resident"] is True
    assert (await admin.client.post("/models/m/wake")).json()["status"] == "ready"  # awake: stays as it is

    r = await admin.client.post("/models/awake/sleep")
    assert r.status_code == 422 and "sleep_timeout" in r.json()["error"]["message"], r.text
    for path in ("/models/nope/sleep", "/models/nope/wake"):
        r = await admin.client.post(path)
        assert r.status_code == 404 and r.json()["error"]["field"] == "model_id", (path, r.text)


async def test_history_counts_requests_keeps_memory_and_survives_a_new_admin(admin):
    from hive_apps.control.admin.history import HISTORY_KEY, HistoryKeeper
    from hive_apps.serving.engine.protocol import EngineLoad

    assert (await admin.deploy(**sim_spec("m", gpu="node-a:gpu0"))).status_code == 200
    keeper = admin.app.state.admin.history
    assert await eventually(lambda: keeper.history is not None)  # its first turn read the KV
    admin.cluster.loads["m"] = EngineLoad(requests_total=10, running=3, waiting=1, max_num_seqs=8)
    await keeper.sample()
    admin.cluster.loads["m"] = EngineLoad(requests_total=40, running=1, max_num_seqs=8)
    await keeper.sample()
    r = await admin.client.get("/history")
    assert r.status_code == 200, r.text
    h = r.json()
    pts = h["models"]["m"]
    assert sum(p["requests"] for p in pts) >= 30 and max(p["running"] for p in pts) == 3
    assert max(p["waiting"] for p in pts) == 1 and pts[-1]["capacity"] > 0 and pts[-1]["resident"] is True
    gpu0 = h["devices"]["node-a:gpu0"][-1]
    assert gpu0["reserved_bytes"] > 0 and gpu0["total_bytes"] == 80 * 2**30
    assert h["restarts"] == [] and h["keep_s"] >= 3600

    await keeper.store()
    assert (SETTINGS.state_namespace, HISTORY_KEY) in admin.cluster.kv
    other = HistoryKeeper(admin.cluster, SETTINGS, admin.app.state.admin.lifecycle, tick_s=3600)
    task = asyncio.get_running_loop().create_task(other.run())
    try:
        assert await eventually(lambda: other.history is not None)
        again = other.view()
        assert again["since"] == h["since"] and len(again["restarts"]) == 1
        assert sum(p["requests"] for p in again["models"]["m"]) >= 30
    finally:
        task.cancel()
