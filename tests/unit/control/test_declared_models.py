"""Declared models (``control/admin/declared.py``) and ``PUT /admin/models/{id}``
(``control/admin/updates.py``), in-process: the admin app on the fake cluster, a real registry behind
it. A Serve config update that changes hive-admin's args starts a new admin replica: here, a second
admin app on the same registry."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
import pytest
from pydantic import ValidationError

from hive_apps.control.admin import reconciler as reconciler_module
from hive_apps.control.admin.app import build
from hive_apps.control.admin.ingress import make_admin_app
from hive_apps.control.cluster import set_cluster
from hive_apps.core.devices import DeviceKind
from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.changes import spec_change
from hive_apps.core.state.records import ModelRecord, Origin
from tests.unit.control.test_admin_app import ADMIN, FIXTURES, NODES, SIM_MODEL, eventually, registry_on, sim_spec
from tests.unit.fake_cluster import FakeCluster
from tests.unit.helpers import replica_plan

# the policy of test_admin_app's settings, plus a model root (a folder outside it is refused)
SETTINGS = HiveSettings(admin_token="adm", auth_disabled=False, deploy_timeout_s=30, model_root=FIXTURES)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(reconciler_module, "POLL_S", 0.02)  # the fake cluster's engines start at once


class Hive:
    """One registry on a fake cluster, and admins started on it one after another, as Serve starts a
    new admin replica for each config update."""

    def __init__(self, cluster: FakeCluster, registry):
        self.cluster, self.registry = cluster, registry
        self.app = None
        self.client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def admin(self, models: list | None, retry_s: float | None = None):
        app = make_admin_app(self.cluster, SETTINGS, declared=models)
        app.state.admin.reconciler.apply_grace_s = 0
        if retry_s is not None:  # before the reconcile's first step (it starts once this test awaits)
            app.state.admin.declared.retry_s = app.state.admin.declared.retry_max_s = retry_s
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://hive", headers=ADMIN) as client:
                self.app, self.client = app, client
                await asyncio.wait_for(app.state.admin.declared.done.wait(), 60)  # the first plan imports transformers
                yield client
        finally:
            app.state.admin.close()
            await asyncio.sleep(0)

    async def record(self, model_id: str) -> ModelRecord | None:
        return await self.registry.get_model(model_id)

    async def ready(self, *model_ids: str) -> bool:
        """Whether every one of these models is ready within 5 s (the admin's loops run beside the test)."""
        for _ in range(100):
            records = [await self.record(m) for m in model_ids]
            if all(r is not None and r.status.value == "ready" for r in records):
                return True
            await asyncio.sleep(0.05)
        return False


@pytest.fixture
async def hive():
    cluster = FakeCluster(NODES)
    registry = await registry_on(cluster, SETTINGS)
    try:
        yield Hive(cluster, registry)
    finally:
        set_cluster(None)


def entries(report: dict) -> dict:
    return {e["model_id"] if e["model_id"] is not None else f"#{e['index']}": e for e in report["entries"]}


async def test_declared_models_are_deployed_at_start(hive):
    async with hive.admin([sim_spec("a", gpu="node-a:gpu0"), sim_spec("b", sleep_timeout=60)]) as client:
        report = (await client.get("/declared")).json()
        assert report["declared"] and report["done"]
        assert {m: e["outcome"] for m, e in entries(report).items()} == {"a": "deployed", "b": "deployed"}
        assert await hive.ready("a", "b")
        listed = {m["model_id"]: m for m in (await client.get("/models")).json()["models"]}
        assert {m: v["origin"] for m, v in listed.items()} == {"a": "declared", "b": "declared"}
        assert listed["a"]["replicas"]["r0"]["devices"] == ["node-a:gpu0"]
        assert set(hive.cluster.apps) == {"a", "b"}


async def test_a_changed_declaration_is_updated_in_place_or_replaced(hive):
    async with hive.admin([sim_spec("live", sleep_timeout=60), sim_spec("moved", gpu="node-a:gpu0")]):
        assert await hive.ready("live", "moved")
    live_before, moved_before = await hive.record("live"), await hive.record("moved")
    builds = hive.cluster.apps["live"].builds

    changed = [sim_spec("live", sleep_timeout=120, priority=3), sim_spec("moved", gpu="node-b:gpu0")]
    async with hive.admin(changed) as client:
        report = entries((await client.get("/declared")).json())
        assert report["live"]["outcome"] == "updated" and report["live"]["changed"] == ["sleep_timeout", "priority"]
        assert report["moved"]["outcome"] == "replaced" and report["moved"]["changed"] == ["gpu"]
        assert "gpu" in report["moved"]["message"]
        live = await hive.record("live")
        assert (live.spec.sleep_timeout, live.spec.priority) == (120, 3)
        assert live.plan == live_before.plan and live.created_at == live_before.created_at  # nothing restarted
        assert hive.cluster.apps["live"].builds == builds
        assert await hive.ready("moved")
        moved = await hive.record("moved")
        assert moved.plan.replicas[0].devices == ["node-b:gpu0"] != moved_before.plan.replicas[0].devices
        assert moved.origin is Origin.DECLARED
        gpus = {d["device"]["id"]: d for d in (await client.get("/gpus")).json()["devices"]}
        assert "moved/r0" not in gpus["node-a:gpu0"]["replicas"] and gpus["node-b:gpu0"]["replicas"] == ["moved/r0"]

    async with hive.admin(changed) as client:  # the same list again (an admin restart): nothing to do
        report = entries((await client.get("/declared")).json())
        assert {m: e["outcome"] for m, e in report.items()} == {"live": "unchanged", "moved": "unchanged"}
        assert (await hive.record("moved")).created_at == moved.created_at


async def test_a_removed_declaration_is_deleted_and_posted_models_stay(hive):
    async with hive.admin([sim_spec("a"), sim_spec("b")]) as client:
        r = await client.post("/models", params={"wait": "true"}, json=sim_spec("posted"))
        assert r.status_code == 200 and r.json()["origin"] == "api", r.text
        assert await hive.ready("a", "b")

    async with hive.admin([sim_spec("b")]) as client:
        report = (await client.get("/declared")).json()
        assert report["removed"] == ["a"] and entries(report)["b"]["outcome"] == "unchanged"
        assert await eventually(lambda: "a" not in hive.cluster.apps)
        assert await hive.record("a") is None
        assert (await hive.record("posted")).origin is Origin.API

    async with hive.admin([]) as client:  # an empty list (or none in the config): every declared model goes
        assert (await client.get("/declared")).json()["removed"] == ["b"]
        assert await eventually(lambda: set(hive.cluster.apps) == {"posted"})
        assert (await hive.record("posted")).status.value == "ready"

    async with hive.admin(None) as client:  # an admin built without a list reconciles nothing
        assert (await client.get("/declared")).json() == {"declared": False, "done": True, "entries": [],
                                                           "removed": []}


async def test_a_posted_model_the_list_names_is_adopted(hive):
    async with hive.admin([]) as client:
        assert (await client.post("/models", params={"wait": "true"}, json=sim_spec("p"))).status_code == 200
    async with hive.admin([sim_spec("p", routing="least_loaded")]) as client:
        e = entries((await client.get("/declared")).json())["p"]
        assert e["outcome"] == "adopted" and e["changed"] == ["routing"]
        rec = await hive.record("p")
        assert rec.origin is Origin.DECLARED and rec.spec.routing.value == "least_loaded"


async def test_bad_entries_are_reported_and_the_rest_proceed(hive):
    outside = sim_spec("outside", model="/srv/models/elsewhere")  # a folder outside HIVE_MODEL_ROOT: policy
    declared = [
        sim_spec("good"),
        sim_spec("zero", replicas=0),
        outside,
        "not a mapping",
        sim_spec("twice"), sim_spec("twice", replicas=2),
        sim_spec("nowhere", gpu="node-z:gpu9"),  # valid, but no such device yet: tried again later
        {"model": SIM_MODEL},  # names no model_id
    ]
    async with hive.admin(declared, retry_s=0.05) as client:
        report = entries((await client.get("/declared")).json())
        assert report["good"]["outcome"] == "deployed"
        assert report["zero"]["outcome"] == "error" and "replicas" in report["zero"]["message"]
        # exactly what POST answers for the same body
        posted = await client.post("/models", json=outside)
        assert posted.status_code == 422
        assert report["outside"]["outcome"] == "error"
        assert posted.json()["error"]["message"] in report["outside"]["message"]
        assert report["#3"]["outcome"] == "error" and "mapping" in report["#3"]["message"]
        assert [e["outcome"] for e in (await client.get("/declared")).json()["entries"][4:6]] == ["error", "error"]
        assert "declared 2 times" in report["twice"]["message"]
        assert report["nowhere"]["outcome"] == "retrying" and "node-z:gpu9" in report["nowhere"]["message"]
        assert report["#7"]["outcome"] == "error" and "model_id" in report["#7"]["message"]
        assert await hive.ready("good")
        assert (await client.get("/healthz")).status_code == 200
        assert {r.model_id for r in await hive.registry.list_models()} == {"good"}

        hive.cluster.add_node("node-z", "L4.L4.L4.L4.L4.L4.L4.L4.L4.L4")  # the device joins: a retry deploys it
        await hive.registry.sample_once()
        declared = hive.app.state.admin.declared
        assert await eventually(lambda: declared.report[6].outcome == "deployed")
        assert await hive.ready("nowhere")


async def test_an_invalid_entry_leaves_its_running_model_alone(hive):
    async with hive.admin([sim_spec("m", sleep_timeout=60)]):
        assert await hive.ready("m")
    async with hive.admin([sim_spec("m", sleep_timeout=-1)]) as client:
        e = entries((await client.get("/declared")).json())["m"]
        assert e["outcome"] == "error" and "left as it is" in e["message"]
        rec = await hive.record("m")
        assert rec.status.value == "ready" and rec.spec.sleep_timeout == 60


# --- PUT /admin/models/{id} ------------------------------------------------------------------------------
async def test_put_same_live_and_restart_changes(hive):
    async with hive.admin(None) as client:
        assert (await client.post("/models", params={"wait": "true"}, json=sim_spec("m", sleep_timeout=60))).status_code == 200
        before = await hive.record("m")

        r = await client.put("/models/m", json=sim_spec("m", sleep_timeout=60))
        assert r.status_code == 200 and r.json()["applied"] == "unchanged" and r.json()["changed"] == []
        assert (await hive.record("m")).version == before.version

        r = await client.put("/models/m", json=sim_spec("m", sleep_timeout=30, idle_timeout=600, keep_resident=True))
        assert r.status_code == 200 and r.json()["applied"] == "in_place", r.text
        assert r.json()["changed"] == ["sleep_timeout", "idle_timeout", "keep_resident"]
        now = await hive.record("m")
        assert (now.spec.sleep_timeout, now.spec.idle_timeout, now.spec.keep_resident) == (30, 600, True)
        assert now.plan == before.plan and now.plan_generation == before.plan_generation

        r = await client.put("/models/m", json=sim_spec("m", sleep_timeout=30, max_input_prompt_length=256))
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["field"] == "max_input_prompt_length" and "recreate=true" in err["message"]
        assert "idle_timeout" in err["live_fields"] and set(err["restart_fields"]) == {"max_input_prompt_length"}
        assert (await hive.record("m")).spec.max_input_prompt_length == 512  # refused: nothing changed

        r = await client.put("/models/m", params={"recreate": "true", "wait": "true"},
                             json=sim_spec("m", sleep_timeout=30, max_input_prompt_length=256))
        assert r.status_code == 200 and r.json()["applied"] == "recreated", r.text
        assert r.json()["status"] == "ready" and r.json()["changed"] == ["max_input_prompt_length", "idle_timeout",
                                                                         "keep_resident"]
        rec = await hive.record("m")
        assert rec.spec.max_input_prompt_length == 256 and rec.spec.idle_timeout is None
        assert rec.plan.replicas[0].settings.max_model_len < before.plan.replicas[0].settings.max_model_len


async def test_put_refusals(hive):
    async with hive.admin(None) as client:
        assert (await client.post("/models", params={"wait": "true"}, json=sim_spec("m", gpu="node-a:gpu0"))).status_code == 200
        r = await client.put("/models/m", json=sim_spec("other", gpu="node-a:gpu0"))
        assert r.status_code == 422 and r.json()["error"]["field"] == "model_id"
        r = await client.put("/models/nope", json=sim_spec("nope"))
        assert r.status_code == 404
        r = await client.put("/models/m", json=sim_spec("m", model="/srv/models/elsewhere"))  # the POST policy
        assert r.status_code == 422 and "HIVE_MODEL_ROOT" in r.json()["error"]["message"]
        r = await client.put("/models/m", json={**sim_spec("m"), "replicaz": 2})
        assert r.status_code == 422 and "unknown field" in r.json()["error"]["message"]
        # bounds that the running replicas do not fit are not a live change
        r = await client.put("/models/m", json=sim_spec("m", gpu="node-a:gpu0", max_replicas=3))
        assert r.status_code == 422  # (max_replicas cannot go with pins: the spec's own rule)
        # a recreate whose settings do not fit anywhere leaves the model as it was
        r = await client.put("/models/m", params={"recreate": "true"}, json=sim_spec("m", gpu="node-a:gpu7"))
        assert r.status_code == 404 and "node-a:gpu7" in r.json()["error"]["message"]
        rec = await hive.record("m")
        assert rec.status.value == "ready" and rec.spec.gpu == "node-a:gpu0"


async def test_put_bounds_in_place_only_around_what_runs(hive):
    async with hive.admin(None) as client:
        assert (await client.post("/models", params={"wait": "true"},
                                  json=sim_spec("s", replicas=2, max_replicas=3))).status_code == 200
        r = await client.put("/models/s", json=sim_spec("s", replicas=2, max_replicas=4, min_replicas=1))
        assert r.status_code == 200 and r.json()["applied"] == "in_place", r.text
        r = await client.put("/models/s", json=sim_spec("s", replicas=2))  # scaling off: 2 run, 2 wanted
        assert r.status_code == 200 and r.json()["changed"] == ["min_replicas", "max_replicas"]
        r = await client.put("/models/s", json=sim_spec("s", replicas=1, max_replicas=1))
        assert r.status_code == 409 and {"replicas", "max_replicas"} <= set(r.json()["error"]["restart_fields"])


async def test_put_deploys_a_failed_model_again(hive):
    async with hive.admin(None) as client:
        hive.cluster.start_mode["f"] = "fail"
        assert (await client.post("/models", params={"wait": "true"}, json=sim_spec("f"))).status_code == 422
        hive.cluster.start_mode["f"] = "ok"
        r = await client.put("/models/f", params={"wait": "true"}, json=sim_spec("f"))
        assert r.status_code == 200 and r.json()["applied"] == "deployed" and r.json()["status"] == "ready", r.text


# --- the pure parts -------------------------------------------------------------------------------------
def _record(spec: ModelSpec, **replica_kwargs) -> ModelRecord:
    from hive_apps.core.planning.types import Plan, ProfileSummary

    profile = ProfileSummary(architecture="Qwen3ForCausalLM", model_type="qwen3", path="/x", runner="generate",
                             dtype="bfloat16", num_params=1, weight_bytes=1, kv_bytes_per_token=1)
    rp = replica_plan(**replica_kwargs).model_copy(update={"device_kind": DeviceKind.GPU})
    return ModelRecord(model_id="m", spec=spec, plan=Plan(model_id="m", model="/x", engine=spec.engine.value,
                                                          profile=profile, replicas=[rp]))


def test_turning_sleep_on_or_off_needs_new_engines_where_vllm_sleeps_in_place():
    vllm = ModelSpec(model_id="m", model="/x", engine="vllm")
    rec = _record(vllm)  # planned without sleep mode
    assert "sleep_timeout" in spec_change(rec, vllm.model_copy(update={"sleep_timeout": 60})).restart
    asleep = _record(vllm.model_copy(update={"sleep_timeout": 60}), enable_sleep_mode=True)
    assert spec_change(asleep, vllm.model_copy(update={"sleep_timeout": 90})).restart == {}
    sim = ModelSpec(model_id="m", model="/x", engine="sim")
    assert spec_change(_record(sim), sim.model_copy(update={"sleep_timeout": 60})).restart == {}


def test_the_admins_args_are_checked_when_the_config_is_deployed():
    assert build({"models": [sim_spec("a"), "a bad entry: the admin reports it"]}) is not None
    assert build({}) is not None  # no models: none declared
    with pytest.raises(ValidationError, match="model"):
        build({"model": [sim_spec("a")]})  # a typo is not an empty list
    with pytest.raises(ValidationError, match="list"):
        build({"models": {"a": sim_spec("a")}})
