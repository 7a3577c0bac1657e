"""The hive's Prometheus metrics: values computed from the registry's state, series that go to 0
when their subject goes, lifecycle events from transitions, and the Grafana dashboard's names."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from hive_apps.core.state.ledger import Ledger
from hive_apps.core.state.transitions import Delete, Sleep, Wake
from hive_apps.ops import metrics
from hive_apps.serving.engine.base import WARM_UP_SAMPLED, WARM_UP_TOKENS
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.engine.sim_engine import SimEngine
from tests.unit.control.test_controller import hive  # noqa: F401  (the registry + reconciler on a fake cluster)
from tests.unit.core.test_ledger import GIB, gpu, res
from tests.unit.helpers import Recorder, recorded_publisher, replica_plan, routing
from tests.unit.serving.test_engine_http import CHAT, FakeHandle, engine

DASHBOARD = Path(__file__).resolve().parents[3] / "manifests" / "grafana-dashboard.json"


@pytest.fixture
def recorded() -> Recorder:
    """Stands in for Ray's metric objects; a test passes ``recorded_publisher(recorded)`` to what it builds."""
    return Recorder()


def memory(rec: Recorder, device: str, kind: str, node: str = "a") -> float | None:
    return rec.gauge("hive_gpu_memory_bytes", node=node, device=device, gpu="H100-80GB", kind=kind)


def test_device_memory_kinds():
    led = Ledger(budget_fraction=0.9)
    led.update_node("id-a", [gpu("a", 0), gpu("a", 1)])
    led.reserve([res("m", ["a:gpu0"], 20), res("n", ["a:gpu0"], 5, replica=1)])
    led.activate("m")  # its engine came up; n/r1 still starting: it explains no use yet
    led.update_node("id-a", [gpu("a", 0, used=30 * GIB), gpu("a", 1)])
    states = led.states()
    states[0].dormant_bytes = 7 * GIB  # a sleeping model's last plan put a replica here
    got = {dict(s.tags)["kind"]: s.value for s in metrics.device_samples(states, led.reservations.values())
           if dict(s.tags)["device"] == "a:gpu0"}
    assert got == {"total": 80 * GIB, "used": 30 * GIB, "reserved": 25 * GIB, "resident": 20 * GIB,
                   "foreign": 10 * GIB, "dormant": 7 * GIB, "free": 50 * GIB,
                   "available": int(0.9 * 80 * GIB) - 25 * GIB - 10 * GIB}


def test_a_series_whose_subject_went_away_goes_to_zero(recorded):
    p = recorded_publisher(recorded)
    p.gauges("models", [metrics.sample("hive_model_replicas", 2, model="a"),
                        metrics.sample("hive_model_replicas", 1, model="b")])
    p.gauges("models", [metrics.sample("hive_model_replicas", 3, model="a")])
    assert recorded.gauge("hive_model_replicas", model="a") == 3
    assert recorded.gauge("hive_model_replicas", model="b") == 0
    with pytest.raises(ValueError):
        metrics.sample("hive_model_replicas", 1, model="a", replica="r0")  # tags are checked


async def test_the_registry_publishes_devices_models_and_lifecycle(hive, recorded):  # noqa: F811
    hive.publisher = recorded_publisher(recorded)
    await hive.start_registry()  # a registry replica that publishes there (it reads the empty KV back)
    await hive.sample()
    await hive.deploy("m", gpu="node-a:gpu0", sleep_timeout=600)
    await hive.sample()
    reserved = hive.reserved("m")["m/r0"].bytes_per_device
    g = lambda kind: recorded.gauge("hive_gpu_memory_bytes", node="node-a", device="node-a:gpu0",  # noqa: E731
                                    gpu="H100-80GB", kind=kind)
    assert g("reserved") == reserved and g("resident") == 0, "a starting engine is reserved, not resident"
    assert recorded.gauge("hive_model_status", model="m", status="deploying") == 1

    rec = await hive.settle("m")
    await hive.sample()
    assert g("resident") == reserved
    assert recorded.gauge("hive_model_status", model="m", status="ready") == 1
    assert recorded.gauge("hive_model_status", model="m", status="deploying") == 0
    assert recorded.gauge("hive_model_planned_seqs", model="m") == rec.plan.replicas[0].settings.max_num_seqs > 0
    assert recorded.total("hive_deploy_seconds", model="m") == pytest.approx(rec.ready_at - rec.created_at)
    assert recorded.total("hive_engine_start_seconds", model="m") == 1.5  # the fake cluster's engine start

    out = await hive.registry.transition(Sleep(model_id="m", version=rec.version, reason="evicted to make room for x"))
    assert out.ok, out.message
    assert recorded.total("hive_sleeps", model="m", reason="evicted") == 1
    assert recorded.total("hive_evictions", model="m") == 1
    await hive.settle("m")  # drained and parked
    await hive.sample()
    assert recorded.gauge("hive_model_status", model="m", status="sleeping") == 1
    assert recorded.gauge("hive_model_planned_seqs", model="m") == 0
    assert g("dormant") == reserved and g("reserved") == 0, "a parked model's memory is dormant, not reserved"

    await hive.registry.transition(Wake(model_id="m"))
    woke = await hive.settle("m")
    assert woke.status.value == "ready" and woke.last_wake is not None
    assert recorded.total("hive_wakes", model="m", outcome="ok", how="parked") == 1
    assert recorded.total("hive_wakes", model="m", outcome="ok", how="level1") == 0
    assert recorded.total("hive_wake_seconds", model="m", how="parked") == pytest.approx(woke.last_wake.total_s)

    await hive.registry.transition(Delete(model_id="m"))
    await hive.settle("m")
    await hive.sample()
    assert await hive.registry.get_model("m") is None
    assert recorded.gauge("hive_model_status", model="m", status="ready") == 0, "a deleted model's series go to 0"
    assert g("reserved") == 0 and g("resident") == 0


async def test_retries_failovers_and_replica_gauges_from_a_replica_set(recorded):
    from hive_apps.serving.routing.replica_set import ReplicaSet

    engines = [await engine(i, max_num_seqs=4, sim_tokens_per_s=2000) for i in range(2)]
    rs = ReplicaSet("sim-model", {i: FakeHandle(e) for i, e in enumerate(engines)}, [e.replica for e in engines], 8,
                    **routing(publisher=recorded_publisher(recorded)))
    published = []
    rs.on_refresh = lambda s: published.append(metrics.replica_samples("sim-model", s.replica_views(), s.loads, s.devices))
    rs.start()
    for _ in range(100):
        if all(rs.endpoints.values()):
            break
        await asyncio.sleep(0.05)
    rs._poller.cancel()
    assert published and {dict(s.tags)["replica"] for s in published[-1]} == {"r0", "r1"}
    healthy = {dict(s.tags)["replica"]: s.value for s in published[-1] if s.metric == "hive_replica_healthy"}
    assert healthy == {"r0": 1, "r1": 1}

    for view in rs.views.values():
        view.engine_running = view.engine_waiting = 0
    await engines[0].http.stop()  # r0 (the tie-break pick) refuses: the request goes to r1
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                           body=json.dumps(CHAT).encode())
    start, _ = await rs.call(req, CHAT)
    assert start.status == 200
    assert recorded.total("hive_retries", model="sim-model") == 1
    assert recorded.total("hive_failovers", model="sim-model") == 1
    assert recorded.total("hive_replica_failures", model="sim-model", replica="r0") == 1
    rs.close()
    await engines[1].http.stop()


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def test_every_metric_the_dashboard_names_is_exported_and_every_metric_is_drawn():
    named = {n for e in dashboard_exprs() for n in re.findall(r"\bray_hive_[a-z_]+", e)}
    assert named, "the dashboard names hive metrics"
    assert named <= metrics.exported_names(), f"not exported: {named - metrics.exported_names()}"
    drawn = {d.name for d in metrics.DEFS.values() if d.exported() & named}
    assert drawn == set(metrics.DEFS), f"defined but on no panel: {set(metrics.DEFS) - drawn}"


def test_the_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert {"x", "y", "w", "h"} <= set(g) and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['id']} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"])
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    variables = {v["name"] for v in dash["templating"]["list"]}
    # "$1" in label_replace is a regex group, not a variable
    used = {m for e in dashboard_exprs() for m in re.findall(r"\$([A-Za-z_]\w*)", e)} - {"__rate_interval", "__all"}
    assert used <= variables


async def test_engines_count_their_tokens_in_and_out(recorded):
    e = SimEngine.__new__(SimEngine)  # the engine replica's root, given the publisher instead of making its own
    await e.__init__("sim-model", "", replica_plan(sim_tokens_per_s=5000), use_start_lock=False,
                     publisher=recorded_publisher(recorded))
    status, body = await e.call_json("/v1/chat/completions", {**CHAT, "max_tokens": 5})
    assert status == 200
    e.load()  # a load poll sends what was counted since the last send
    usage = body["usage"]
    assert recorded.total("hive_tokens", model="sim-model", replica="r0", direction="out") \
        == usage["completion_tokens"] + WARM_UP_TOKENS + WARM_UP_SAMPLED["max_tokens"]  # and the warm-up's
    assert recorded.total("hive_tokens", direction="in") > usage["prompt_tokens"] > 0
    await e.http.stop()


def test_vllm_iteration_stats_feed_the_token_count():
    from types import SimpleNamespace

    from hive_apps.serving.engine.vllm_engine import LoadTracker

    tracker, seen = LoadTracker(), []
    tracker.on_tokens = lambda p, g: seen.append((p, g))
    tracker.record(SimpleNamespace(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25),
                   SimpleNamespace(num_prompt_tokens=40, num_generation_tokens=7))
    tracker.record(None, None)
    assert (tracker.running, tracker.waiting, tracker.kv_cache_usage) == (3, 1, 0.25) and seen == [(40, 7)]
