"""The registry as the one owner of model state and the admin's reconciler, run against an
in-memory cluster (tests/unit/fake_cluster.py): every step of deploy, heal and delete, and
kills of the admin or the registry between any two of them."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from hive_apps.control.admin.lifecycle import Lifecycle
from hive_apps.control.admin.reconciler import POLL_S, Reconciler
from hive_apps.control.cluster import AppState, set_cluster
from hive_apps.control.registry.deployment import Registry
from hive_apps.core import names
from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import ModelRecord, ModelStatus, Reservation, ReservationState, load_stored
from tests.unit.fake_cluster import FakeCluster
from tests.unit.helpers import ManualClock, recorded_publisher

MODEL = str(Path(__file__).resolve().parents[2] / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")
SETTINGS = HiveSettings(auth_disabled=True, deploy_timeout_s=30, heal_backoff_max_s=60)


class Hive:
    """A registry and a reconciler on a fake cluster, stepped by hand."""

    def __init__(self, cluster: FakeCluster):
        self.cluster = cluster
        self.clock = ManualClock()  # the registry's, the reconciler's and the lifecycle's wall time
        self.publisher = recorded_publisher()  # the registry's metrics (a test may pass its own backend)
        set_cluster(cluster)
        self.reconciler = self.new_reconciler()

    def new_reconciler(self, apply_grace_s: float = 0) -> Reconciler:
        """A reconciler (as a new admin replica builds one) on this hive's clock."""
        return Reconciler(self.cluster, SETTINGS, Lifecycle(self.cluster, SETTINGS, self.clock),
                          apply_grace_s=apply_grace_s, clock=self.clock)

    async def start_registry(self, settings: HiveSettings = SETTINGS) -> Registry:
        """A registry replica: a new one reads everything back from the KV."""
        reg = Registry.__new__(Registry)
        await reg.__init__(settings, clock=self.clock, publisher=self.publisher)
        reg._loop_task.cancel()  # the tests sample when they mean to
        self.cluster.serve(names.REGISTRY_APP, reg)
        self.registry = reg
        return reg

    async def sample(self) -> None:
        await self.registry.sample_once()

    async def deploy(self, model_id: str, **spec) -> ModelRecord:
        spec = ModelSpec(**{"model_id": model_id, "model": MODEL, "engine": "sim", "max_input_prompt_length": 256,
                            "max_output_prompt_length": 64, **spec})
        outcome = await self.reconciler.planner.plan.remote(spec, await self.registry.capacities())
        assert outcome.plan is not None, outcome.error
        record = ModelRecord(model_id=model_id, spec=spec, plan=outcome.plan)
        result = await self.registry.transition(t.Create(model_id=model_id, record=record,
                                                reservations=[Reservation.for_replica(model_id, rp) for rp in outcome.plan.replicas]))
        assert result.ok, result.message
        return result.record

    async def step(self, model_id: str) -> float | None:
        return await self.reconciler.step(model_id, await self.registry.get_model(model_id))

    async def settle(self, model_id: str, max_steps: int = 20) -> ModelRecord | None:
        """Step until the model needs nothing more (or is waiting on time)."""
        for _ in range(max_steps):
            delay = await self.step(model_id)
            if delay is None or delay > 1:
                break
        return await self.registry.get_model(model_id)

    def reserved(self, model_id: str) -> dict[str, Reservation]:
        return {r.key: r for r in self.registry.ledger.of_model(model_id)}


@pytest.fixture
async def hive():
    h = Hive(FakeCluster({"node-a": "H100-80GB.H100-80GB", "node-b": "L4.L4"}))
    await h.start_registry()
    await h.sample()
    yield h
    set_cluster(None)


async def test_deploy_reaches_ready_with_active_reservations(hive):
    rec = await hive.deploy("m", gpu="node-a:gpu0")
    assert rec.status is ModelStatus.DEPLOYING and hive.reserved("m")["m/r0"].state is ReservationState.PENDING
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and rec.ready_at is not None
    assert rec.engine_start_s == {"r0": 1.5}
    assert hive.reserved("m")["m/r0"].state is ReservationState.ACTIVE
    assert hive.cluster.apps["m"].builds == 1


async def test_what_vllm_loaded_is_kept_and_compared_with_the_plan(hive):
    """vLLM trusts the plan's KV size and measures nothing: the engine's own reading of its weights
    is kept per replica, and a term off the plan shows in the model's drift (issue #24)."""
    from hive_apps.control.admin.schemas import ModelStatusResponse

    rec = await hive.deploy("m", gpu="node-a:gpu0")
    planned = rec.plan.replicas[0].memory.weights
    hive.cluster.loaded["m", 0] = [{"weights_bytes": planned * 3 // 2, "cuda_graph_bytes": None}]
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and rec.loaded["r0"][0].weights_bytes == planned * 3 // 2
    again = ModelRecord.model_validate_json(rec.model_dump_json())  # kept across a registry restart
    status = ModelStatusResponse.of(again, None)
    assert status.replicas["r0"].loaded[0].weights_bytes == planned * 3 // 2
    assert "+50%" in status.drift["r0 weights"] and "cuda_graphs" not in " ".join(status.drift)


async def test_engine_start_failure_leaves_nothing(hive):
    hive.cluster.start_mode["bad"] = "fail"
    await hive.deploy("bad", gpu="node-b:gpu0")
    rec = await hive.settle("bad")
    assert rec.status is ModelStatus.FAILED and "simulated engine start failure" in rec.message
    assert hive.reserved("bad") == {} and "bad" not in hive.cluster.apps
    # and it can be deployed again under the same id
    hive.cluster.start_mode["bad"] = "ok"
    await hive.deploy("bad", gpu="node-b:gpu0")
    assert (await hive.settle("bad")).status is ModelStatus.READY


async def test_deploy_past_its_deadline_fails_and_frees(hive):
    hive.cluster.start_mode["slow"] = "hang"
    await hive.deploy("slow", gpu="node-b:gpu1")
    assert await hive.step("slow") == 0.0  # app built
    assert (await hive.registry.get_model("slow")).status is ModelStatus.DEPLOYING
    # the deadline counts from the build, after the weights were fetched onto the node
    hive.clock.advance(SETTINGS.deploy_timeout_s + 1)
    rec = await hive.settle("slow")
    assert rec.status is ModelStatus.FAILED and "not ready within" in rec.message
    assert hive.reserved("slow") == {} and "slow" not in hive.cluster.apps


class PutModel(t.Transition):
    """A message the registry's table does not list."""


async def test_stale_or_illegal_transitions_are_refused(hive):
    rec = await hive.deploy("m", gpu="node-a:gpu0")
    await hive.step("m")
    fresh = await hive.registry.get_model("m")
    stale = await hive.registry.transition(t.Started(model_id="m", version=rec.version))
    assert not stale.ok and stale.status_code == 409 and "changed" in stale.message
    illegal = await hive.registry.transition(t.Heal(model_id="m", version=fresh.version, replacements=[]))
    assert not illegal.ok and "starts only from degraded" in illegal.message
    unknown = await hive.registry.transition(PutModel(model_id="m"))
    assert not unknown.ok and unknown.status_code == 400


async def test_node_lost_during_deploy_heals_elsewhere(hive):
    hive.cluster.kill_node("node-a")  # two single-H100 nodes instead, so the replicas land apart
    hive.cluster.add_node("node-c", "H100-80GB")
    hive.cluster.add_node("node-d", "H100-80GB")
    await hive.sample()
    await hive.deploy("m", replicas=2)
    rec = await hive.registry.get_model("m")
    lost_node = rec.plan.replicas[1].node_name
    await hive.step("m")  # app built
    hive.cluster.kill_node(lost_node)
    await hive.sample()
    rec = await hive.registry.get_model("m")
    assert set(rec.lost_replicas) == {"r1"} and set(hive.reserved("m")) == {"m/r0"}
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY, rec.message
    assert all(rp.node_name != lost_node for rp in rec.plan.replicas)
    assert set(hive.reserved("m")) == {"m/r0", "m/r1"}
    assert all(r.state is ReservationState.ACTIVE for r in hive.reserved("m").values())


async def test_deploy_whose_every_replica_died_fails(hive):
    await hive.deploy("m", gpu="node-b:gpu0")
    await hive.step("m")
    hive.cluster.kill_node("node-b")
    await hive.sample()
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.FAILED and "died during the deploy" in rec.message
    assert hive.reserved("m") == {} and "m" not in hive.cluster.apps


async def test_node_lost_during_heal_ends_healed_never_ready_with_a_gap(hive):
    """The lost update: a second node dies while the first heal is in flight."""
    hive.cluster.add_node("node-c", "H100-80GB")
    await hive.sample()
    await hive.deploy("m", replicas=2)
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY
    first = rec.plan.replicas[0].node_name
    hive.cluster.kill_node(first)
    await hive.sample()
    assert (await hive.registry.get_model("m")).status is ModelStatus.DEGRADED
    await hive.step("m")  # heal: replacement placed
    healing = await hive.registry.get_model("m")
    assert healing.status is ModelStatus.HEALING
    await hive.step("m")  # replacement app built
    before_loss = await hive.registry.get_model("m")
    # the node of the replacement dies before the reconciler saw it start
    hive.cluster.kill_node(before_loss.plan.replicas[0].node_name)
    await hive.sample()
    stale = await hive.registry.transition(t.Started(model_id="m", version=before_loss.version, engine_start_s={}))
    assert not stale.ok  # the healer's copy is stale: it cannot overwrite the loss
    mid = await hive.registry.get_model("m")
    assert mid.status is ModelStatus.HEALING and set(mid.lost_replicas) == {"r0"} and mid.healing_replicas == [1]
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and rec.lost_replicas == {}
    alive = {n.labels["ray-hive/node"] for n in hive.cluster.nodes() if n.alive}
    assert {rp.node_name for rp in rec.plan.replicas} <= alive
    assert set(hive.reserved("m")) == {"m/r0", "m/r1"}


async def test_pinned_replicas_are_not_moved(hive):
    await hive.deploy("p", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2)
    await hive.settle("p")
    hive.cluster.kill_node("node-b")
    await hive.sample()
    rec = await hive.settle("p")
    assert rec.status is ModelStatus.DEGRADED and "pinned replicas are not replaced" in rec.message
    assert set(hive.reserved("p")) == {"p/r0"}


async def test_failed_heals_back_off_exponentially(hive):
    await hive.deploy("m")
    await hive.settle("m")
    node = (await hive.registry.get_model("m")).plan.replicas[0].node_name
    hive.cluster.kill_node(node)
    await hive.sample()
    hive.cluster.start_mode["m"] = "fail"
    waits, generations = [], []
    for _ in range(3):
        rec = await hive.settle("m")
        assert rec.status is ModelStatus.DEGRADED and rec.healing_replicas == []
        waits.append(round(rec.next_heal_at - hive.clock()))
        generations.append(hive.cluster.apps["m"].generations[0])
        hive.clock.advance(waits[-1])
    assert waits == [2, 4, 8] and rec.heal_attempts == 3
    assert len(set(generations)) == 3, "each new placement is a new version for Serve, even on the same device"
    assert "self-healing failed (attempt 3" in rec.message
    hive.cluster.start_mode["m"] = "ok"
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and rec.heal_attempts == 0


async def test_delete_during_deploy_builds_nothing_or_removes_it(hive):
    await hive.deploy("early")
    await hive.registry.transition(t.Delete(model_id="early"))
    await hive.settle("early")
    assert await hive.registry.get_model("early") is None and "early" not in hive.cluster.apps
    assert hive.reserved("early") == {}

    await hive.deploy("late")
    await hive.step("late")  # the app is built, not yet ready
    await hive.registry.transition(t.Delete(model_id="late"))
    await hive.settle("late")
    assert await hive.registry.get_model("late") is None and "late" not in hive.cluster.apps
    assert hive.reserved("late") == {}


async def test_node_lost_during_delete(hive):
    await hive.deploy("m", gpu="node-b:gpu1")
    await hive.settle("m")
    await hive.registry.transition(t.Delete(model_id="m"))
    hive.cluster.kill_node("node-b")
    await hive.sample()
    assert (await hive.registry.get_model("m")).status is ModelStatus.DELETING
    await hive.settle("m")
    assert await hive.registry.get_model("m") is None and hive.reserved("m") == {} and "m" not in hive.cluster.apps


async def test_admin_restart_mid_deploy_and_mid_heal(hive):
    await hive.deploy("m", replicas=2)
    await hive.step("m")  # app built; then this admin dies
    hive.reconciler = hive.new_reconciler()
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and hive.cluster.apps["m"].builds == 1

    hive.cluster.kill_node(rec.plan.replicas[1].node_name)
    await hive.sample()
    await hive.step("m")  # heal placed; the admin dies before building the app
    assert (await hive.registry.get_model("m")).status is ModelStatus.HEALING
    hive.reconciler = hive.new_reconciler()
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and hive.cluster.apps["m"].builds == 2


async def test_registry_restart_mid_deploy_keeps_record_reservations_and_locks(hive):
    await hive.deploy("m", gpu="node-a:gpu1")
    await hive.step("m")
    assert await hive.registry.acquire_start_lock(["node-a:gpu1"], "m/r0", 600)
    before = await hive.registry.get_model("m")
    await hive.start_registry()  # the registry replica was killed and came back
    await hive.sample()
    assert (await hive.registry.get_model("m")) == before
    assert hive.reserved("m")["m/r0"].state is ReservationState.PENDING
    assert not await hive.registry.acquire_start_lock(["node-a:gpu1"], "other/r0", 600)  # still held
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY and hive.cluster.apps["m"].builds == 1


async def test_concurrent_retries_of_a_failed_id_admit_one(hive):
    hive.cluster.start_mode["retry"] = "fail"
    await hive.deploy("retry", gpu="node-a:gpu0")
    assert (await hive.settle("retry")).status is ModelStatus.FAILED
    hive.cluster.start_mode["retry"] = "ok"
    spec = ModelSpec(model_id="retry", model=MODEL, engine="sim", gpu="node-a:gpu0",
                     max_input_prompt_length=256, max_output_prompt_length=64)
    plan = (await hive.reconciler.planner.plan.remote(spec, await hive.registry.capacities())).plan
    record = ModelRecord(model_id="retry", spec=spec, plan=plan)
    outcomes = await asyncio.gather(*(
        hive.registry.transition(t.Create(model_id="retry", record=record, reservations=[Reservation.for_replica("retry", plan.replicas[0])]))
        for _ in range(8)))
    assert sorted(o.ok for o in outcomes) == [False] * 7 + [True]
    assert {o.status_code for o in outcomes if not o.ok} == {409}
    assert len(hive.reserved("retry")) == 1
    assert (await hive.settle("retry")).status is ModelStatus.READY


async def test_reset_rebooks_only_models_that_hold_memory(hive):
    hive.cluster.start_mode["gone"] = "fail"
    await hive.deploy("gone", gpu="node-b:gpu0")
    await hive.settle("gone")
    await hive.deploy("kept", gpu="node-b:gpu1")
    await hive.settle("kept")
    await hive.deploy("leaving", gpu="node-a:gpu0")
    await hive.settle("leaving")
    await hive.registry.transition(t.Delete(model_id="leaving"))
    await hive.registry.reset()
    assert set(hive.registry.ledger.reservations) == {"kept/r0"}
    assert hive.registry.ledger.reservations["kept/r0"].state is ReservationState.ACTIVE


async def test_node_rejoining_under_the_same_name_loses_its_old_replicas(hive):
    await hive.deploy("m")
    rec = await hive.settle("m")
    node, old_id = rec.plan.replicas[0].node_name, rec.plan.replicas[0].node_id
    hive.cluster.kill_node(node)
    hive.cluster.add_node(node, "H100-80GB.H100-80GB" if node == "node-a" else "L4.L4")  # same name, new node
    await hive.sample()
    rec = await hive.registry.get_model("m")
    assert "r0" in rec.lost_replicas, "a replica on the old node must count as lost"
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.READY
    assert rec.plan.replicas[0].node_id != old_id


async def test_orphan_model_apps_are_removed_and_user_apps_kept(hive):
    rec = await hive.deploy("m", gpu="node-a:gpu0")
    hive.cluster.run_model_app("orphan", rec.plan, None)
    hive.cluster.apps["users-own"] = hive.cluster.apps["orphan"].__class__(plan=rec.plan, deployments={"Ingress": "HEALTHY"})
    await hive.step("m")
    removed = await hive.reconciler.sweep(await hive.registry.list_models())
    assert removed == ["orphan"]
    assert set(hive.cluster.apps) == {"m", "users-own"}


async def test_watch_answers_at_once_on_a_change(hive):
    version = (await hive.registry.watch(-1, 0)).version
    waiter = asyncio.create_task(hive.registry.watch(version, 30))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    t0 = time.monotonic()
    await hive.deploy("m", gpu="node-a:gpu0")
    view = await asyncio.wait_for(waiter, 1)
    assert time.monotonic() - t0 < 0.25 and view.version > version
    assert [r.model_id for r in view.models] == ["m"]


async def test_corrupt_stored_record_is_quarantined(hive):
    await hive.deploy("good", gpu="node-a:gpu0")
    ns = SETTINGS.state_namespace
    hive.cluster.kv[(ns, "model/bad")] = b'{"model_id": "bad", "not": "a record"}'
    hive.cluster.kv[(ns, "model/old")] = (await hive.registry.get_model("good")).model_copy(
        update={"model_id": "old"}).model_dump_json().replace('"schema_version":1', '"schema_version":99').encode()
    await hive.start_registry()
    assert [r.model_id for r in await hive.registry.list_models()] == ["good"]
    assert (ns, "quarantine/model/bad") in hive.cluster.kv and (ns, "quarantine/model/old") in hive.cluster.kv


async def test_a_rebuild_is_not_judged_on_serve_status_from_before_it(hive):
    """Serve's status lags a rebuild: a broken status right after building is not yet a failure."""
    hive.reconciler = hive.new_reconciler(apply_grace_s=3)
    hive.cluster.start_mode["m"] = "fail"
    await hive.deploy("m", gpu="node-a:gpu0")
    await hive.step("m")  # built
    assert await hive.step("m") == POLL_S and (await hive.registry.get_model("m")).status is ModelStatus.DEPLOYING
    hive.registry.book.records["m"].applied_at -= 3
    rec = await hive.settle("m")
    assert rec.status is ModelStatus.FAILED


async def test_a_restarted_registry_answers_followers_at_once(hive):
    await hive.deploy("m", gpu="node-a:gpu0")
    seen = (await hive.registry.watch(-1, 0)).version
    await hive.start_registry()  # the registry replica was killed and came back
    t0 = time.monotonic()
    view = await hive.registry.watch(seen, 5)
    assert time.monotonic() - t0 < 0.5 and [r.model_id for r in view.models] == ["m"]


async def test_a_delete_ends_the_record_and_its_reservations_before_the_app_goes(hive, monkeypatch):
    """Removing a model's app can take 30 s behind Serve's HAProxy ingress (its router is the
    app's ingress and stays reachable that long while load balancers deregister it): the engines
    go first, then the record and its reservations, then the app."""
    await hive.deploy("m", gpu="node-a:gpu0")
    assert (await hive.settle("m")).status is ModelStatus.READY
    seen = {}
    delete_app = hive.cluster.delete_app

    def slow_delete_app(name: str) -> None:
        seen.update(engines=[rp.index for rp in hive.cluster.apps[name].plan.replicas],
                    record="m" in hive.registry.book.records, reserved=hive.reserved("m"))
        delete_app(name)

    monkeypatch.setattr(hive.cluster, "delete_app", slow_delete_app)
    await hive.registry.transition(t.Delete(model_id="m"))
    await hive.settle("m")
    assert seen == {"engines": [], "record": False, "reserved": {}}
    assert "m" not in hive.cluster.apps and hive.cluster.deleted == ["m"]



async def test_removing_an_app_waits_until_serve_no_longer_lists_it(hive, monkeypatch):
    """Serve's delete only asks (a blocking one held a seam thread for the 30 s an ingress replica
    drains behind HAProxy); the reconciler polls until the app is gone, so a new deploy of the
    same id never meets the old app."""
    await hive.deploy("m", gpu="node-a:gpu0")
    await hive.settle("m")
    app_states, draining = hive.cluster.app_states, [3]  # Serve lists it 3 more times after the delete

    def app_states_while_draining() -> dict[str, AppState]:
        states = app_states()
        if "m" in hive.cluster.deleted and draining[0]:
            draining[0] -= 1
            states["m"] = AppState(status="DELETING", deployments={names.ROUTER_DEPLOYMENT: "HEALTHY"})
        return states

    monkeypatch.setattr("hive_apps.control.admin.reconciler.POLL_S", 0.01)
    monkeypatch.setattr(hive.cluster, "app_states", app_states_while_draining)
    await hive.registry.transition(t.Delete(model_id="m"))
    assert await hive.step("m") is None  # one step: engines, record, app
    assert draining == [0] and hive.cluster.deleted == ["m"]


async def test_a_record_todays_policy_refuses_keeps_running_with_a_warning(hive, tmp_path, caplog):
    """A narrowed setting (here HIVE_MODEL_ROOT) or a stricter ModelSpec after an upgrade (here a spec
    field it no longer knows) never deletes a running model: its record is read back as it was
    deployed, and its status and the log say why today's policy would refuse it."""
    ns = SETTINGS.state_namespace
    await hive.deploy("m", gpu="node-a:gpu0")
    await hive.deploy("old", gpu="node-b:gpu0")
    for model_id in ("m", "old"):
        assert (await hive.settle(model_id)).status is ModelStatus.READY
    stored = json.loads(hive.cluster.kv[(ns, "model/old")])
    stored["spec"]["a_field_from_before"] = True
    hive.cluster.kv[(ns, "model/old")] = json.dumps(stored).encode()
    booked = {**hive.reserved("m"), **hive.reserved("old")}
    narrowed = SETTINGS.model_copy(update={"model_root": tmp_path})  # the deployed folder is outside the root now
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        await hive.start_registry(narrowed)
    await hive.sample()
    m, old = await hive.registry.get_model("m"), await hive.registry.get_model("old")
    assert m.status is old.status is ModelStatus.READY and m.spec.model == MODEL
    assert "HIVE_MODEL_ROOT" in m.policy_warning and m.message.startswith(m.policy_warning)
    assert "a_field_from_before" in old.policy_warning and old.message.startswith(old.policy_warning)
    assert f"m: {m.policy_warning}" in caplog.text
    assert {**hive.reserved("m"), **hive.reserved("old")} == booked
    assert not any(k.startswith("quarantine/") for _, k in hive.cluster.kv)
    assert await hive.reconciler.sweep(await hive.registry.list_models()) == []
    assert {"m", "old"} <= set(hive.cluster.apps)


async def test_a_record_that_does_not_parse_is_quarantined_with_its_reservations(hive):
    ns = SETTINGS.state_namespace
    await hive.deploy("bad", gpu="node-a:gpu0")
    await hive.settle("bad")
    hive.cluster.kv[(ns, "model/bad")] = b'{"model_id": "bad", "not": "a record"}'
    await hive.start_registry()
    assert await hive.registry.get_model("bad") is None and (ns, "quarantine/model/bad") in hive.cluster.kv
    assert hive.reserved("bad") == {} and (ns, "reservation/bad/r0") not in hive.cluster.kv


async def test_reservations_an_older_registry_stored_apart_move_into_their_records(hive, caplog):
    """An older registry kept each reservation under its own ``reservation/`` key, written after the
    record: a restart folds them into their records (measured use, state and age kept), releases what
    a crash between those writes left behind, and deletes the old keys."""
    ns = SETTINGS.state_namespace
    await hive.deploy("m", gpu="node-a:gpu0")
    assert (await hive.settle("m")).status is ModelStatus.READY
    await hive.registry.report_usage("m/r0", 5 * 2**30)
    hive.cluster.start_mode["f"] = "fail"
    await hive.deploy("f", gpu="node-b:gpu0")
    stale = hive.reserved("f")["f/r0"].model_copy()
    assert (await hive.settle("f")).status is ModelStatus.FAILED
    booked = {k: r.model_dump() for k, r in hive.reserved("m").items()}
    for key in [k for n, k in hive.cluster.kv if n == ns and k.startswith("model/")]:  # the older layout
        stored = load_stored(hive.cluster.kv[(ns, key)])
        hive.cluster.kv[(ns, key)] = stored.record.model_dump_json().encode()
        for r in stored.reservations:
            hive.cluster.kv[(ns, "reservation/" + r.key)] = r.model_dump_json().encode()
    # a crash between the failed deploy's record and its reservation's delete; a record gone before it
    hive.cluster.kv[(ns, "reservation/f/r0")] = stale.model_dump_json().encode()
    hive.cluster.kv[(ns, "reservation/x/r0")] = stale.model_copy(update={"model_id": "x"}).model_dump_json().encode()
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        await hive.start_registry()
    assert {k: r.model_dump() for k, r in hive.reserved("m").items()} == booked
    assert booked["m/r0"]["measured_bytes"] == 5 * 2**30 and booked["m/r0"]["state"] == ReservationState.ACTIVE
    assert set(hive.registry.ledger.reservations) == {"m/r0"}
    assert "released reservation f/r0: its record (failed) does not hold it" in caplog.text
    assert "released reservation x/r0: no record of its model" in caplog.text
    assert not [k for n, k in hive.cluster.kv if k.startswith("reservation/")]
    assert [r.key for r in load_stored(hive.cluster.kv[(ns, "model/m")]).reservations] == ["m/r0"]
    assert load_stored(hive.cluster.kv[(ns, "model/f")]).reservations == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        await hive.start_registry()  # and again: nothing left to move or release
    assert {k: r.model_dump() for k, r in hive.reserved("m").items()} == booked and caplog.text == ""


async def test_a_retiring_replica_whose_node_dies_is_not_healed_back(hive):
    hive.cluster.kill_node("node-a")  # two single-H100 nodes instead, so the replicas land apart
    hive.cluster.add_node("node-c", "H100-80GB")
    hive.cluster.add_node("node-d", "H100-80GB")
    await hive.sample()
    await hive.deploy("m", replicas=2, max_replicas=2, min_replicas=1)
    rec = await hive.settle("m")
    gone = rec.plan.replicas[1]
    assert rec.status is ModelStatus.READY and rec.plan.replicas[0].node_name != gone.node_name
    assert (await hive.registry.transition(t.Retire(model_id="m", version=rec.version, index=gone.index))).ok
    hive.cluster.kill_node(gone.node_name)
    await hive.sample()
    rec = await hive.settle("m")
    assert [rp.index for rp in rec.plan.replicas] == [0] and rec.status is ModelStatus.READY
    assert rec.lost_replicas == {} and rec.retiring == [] and set(hive.reserved("m")) == {"m/r0"}
    assert [rp.index for rp in hive.cluster.apps["m"].plan.replicas] == [0]


async def _before_crash(hive: Hive, transition: str) -> t.Transition | None:
    """Bring model m to where ``transition`` starts; return that transition's message."""
    if transition == "create":
        return None
    await hive.deploy("m", gpu="node-a:gpu0")
    if transition == "started":
        await hive.step("m")  # its app is built
    elif transition == "deleted":
        await hive.settle("m")
        await hive.registry.transition(t.Delete(model_id="m"))
    version = (await hive.registry.get_model("m")).version
    return t.BY_NAME[transition](model_id="m", version=version,
                                 **({"reason": "engine start failed"} if transition == "fail" else {}))


@pytest.mark.parametrize("writes", [0, 1, 2])
@pytest.mark.parametrize("transition", ["create", "started", "fail", "deleted"])
async def test_a_crash_in_the_middle_of_a_change_leaves_record_and_reservations_agreeing(hive, caplog, transition,
                                                                                          writes):
    """The registry dies after ``writes`` KV writes of one change: restarted, it holds the model's record
    and reservations as they were before the change or as the change left them, never a mix (a record
    deploying without its booking, a booking its record already let go), and it releases nothing to
    make them agree."""
    msg = await _before_crash(hive, transition)

    def state() -> tuple:
        rec = hive.registry.book.records.get("m")
        return rec and rec.model_dump(), {k: r.model_dump() for k, r in hive.reserved("m").items()}

    before = state()
    hive.cluster.writes_left = writes
    try:
        if msg is None:
            await hive.deploy("m", gpu="node-a:gpu0")
        else:
            await hive.registry.transition(msg)
    except ConnectionError:  # the registry died here; what it held in memory is the change's end
        pass
    after = state()
    assert after != before
    hive.cluster.writes_left, hive.cluster.died = None, False
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        await hive.start_registry()
    assert state() in (before, after)
    assert "released reservation" not in caplog.text
