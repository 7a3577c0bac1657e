"""Sleep, park, wake, make room and idle destroy: the pure rules (``hive_apps/core/lifecycle.py``),
the registry's transitions and the admin's loops on the in-memory cluster, and the hold that
requests for a sleeping model wait in (``serving/routing/hold.py``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hive_apps.control.admin.lifecycle import Lifecycle
from hive_apps.control.admin.reconciler import Reconciler
from hive_apps.control.cluster import set_cluster
from hive_apps.core.lifecycle import Candidate, choose_victims, eviction_order, idle_since, sleep_due, update_activity
from hive_apps.core.planning.memory import CUDA_CONTEXT_BYTES, MIB, sleep_residual_bytes
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import ModelStatus, ReservationState, SleepMode
from hive_apps.serving.engine.protocol import EngineLoad
from hive_apps.serving.routing.hold import HoldRefused, WakeHold
from tests.unit.control.test_controller import Hive
from tests.unit.fake_cluster import FakeCluster, FakeSleep
from tests.unit.helpers import recorded_publisher

BIG = {"vllm_kwargs": {"kv_cache_memory_bytes": 14 * 2**30}}  # one such model fills an L4 (24 GB)
LIFE = HiveSettings(auth_disabled=True, deploy_timeout_s=30, min_residency_s=0, drain_grace_s=0.2,
                    hold_timeout_s=5, hold_max_per_model=2)


# --- the pure rules -----------------------------------------------------------------------
def cand(model_id: str, **kw) -> Candidate:
    base = dict(can_sleep=True, wake_cost_s=20.0, resident_since=0.0)
    return Candidate(model_id=model_id, **{**base, **kw})


def test_eviction_order_is_priority_then_expected_cost_then_least_recently_used():
    order, refused = eviction_order([
        cand("busy-cheap", rate_per_s=1.0, wake_cost_s=2.0),  # cost 2
        cand("rare-dear", rate_per_s=0.01, wake_cost_s=100.0),  # cost 1
        cand("important", priority=5, rate_per_s=0.0),
        cand("old", rate_per_s=0.0, last_request_at=10.0),
        cand("older", rate_per_s=0.0, last_request_at=5.0),
        cand("pinned", keep_resident=True),
        cand("static", can_sleep=False),
        cand("serving", in_flight=2),
        cand("fresh", resident_since=990.0, wake_cost_s=100.0),  # kept 60 s (the cap), not its wake
    ], now=1000.0, min_residency_s=60)
    assert [c.model_id for c in order] == ["older", "old", "rare-dear", "busy-cheap", "important"]
    reasons = {r.model_id: r.reason for r in refused}
    assert reasons["pinned"] == "keep_resident" and "no sleep_timeout" in reasons["static"]
    assert "2 requests in flight" in reasons["serving"] and "minimum residency, 50s left" in reasons["fresh"]


async def test_victims_are_the_shortest_prefix_that_fits_or_nobody():
    order = [cand("a"), cand("b"), cand("c")]

    async def fits_two(victims):
        return len(victims) >= 2

    async def never(victims):
        return False

    assert await choose_victims(order, fits_two) == ["a", "b"]
    assert await choose_victims(order, never) is None


def test_request_rate_decays_and_survives_an_engine_restart():
    a = update_activity(None, 0, 100, 50.0, now=100.0)
    b = update_activity(a, 0, 160, 159.0, now=160.0)  # 60 requests in 60 s
    assert 0.4 < b.rate_per_s < 0.6 and b.last_request_at == 159.0
    c = update_activity(b, 0, 3, None, now=220.0)  # counters went back: the engine restarted
    assert c.rate_per_s < b.rate_per_s and c.last_request_at == 159.0
    quiet = update_activity(c, 0, 3, None, now=1000.0)
    assert quiet.rate_per_s < 0.01


def test_idle_clock_counts_from_the_later_of_last_request_and_ready():
    assert idle_since(None, 100.0) == 100.0 and idle_since(150.0, 100.0) == 150.0
    assert not sleep_due(10, 100.0, in_flight=1, now=200.0)  # never with requests in flight
    assert sleep_due(10, 100.0, in_flight=0, now=110.0) and not sleep_due(10, 100.0, 0, now=109.0)
    assert not sleep_due(None, 100.0, 0, now=1e9)


# --- the admin's loops on the in-memory cluster ------------------------------------------
async def life_on(gpus: str, **more_nodes: str) -> Hive:
    """A registry, lifecycle loop and reconciler on one node with these simulated GPUs (and other
    nodes with theirs), all on the hive's manual clock."""
    h = Hive(FakeCluster({"node-a": gpus, **{name.replace("_", "-"): g for name, g in more_nodes.items()}}))
    h.lifecycle = Lifecycle(h.cluster, LIFE, h.clock)
    h.reconciler = Reconciler(h.cluster, LIFE, h.lifecycle, apply_grace_s=0, clock=h.clock)
    await h.start_registry()
    await h.sample()
    return h


@pytest.fixture
async def life():
    yield await life_on("L4")
    set_cluster(None)


def idle_for(hive: Hive, model_id: str, seconds: float, in_flight: int = 0) -> None:
    """The model's engines report their last request ``seconds`` ago (by the hive's clock)."""
    hive.cluster.loads[model_id] = EngineLoad(last_request_at=hive.clock() - seconds, in_flight=in_flight,
                                              requests_total=3)


async def ready(hive: Hive, model_id: str, **spec):
    await hive.deploy(model_id, **spec)
    rec = await hive.settle(model_id)
    assert rec.status is ModelStatus.READY, rec.message
    hive.clock.advance(3600)  # long resident
    return rec


async def test_idle_model_parks_keeps_route_and_plan_and_wakes_on_request(life):
    await ready(life, "m", sleep_timeout=5)
    idle_for(life, "m", 2)
    assert await life.lifecycle.tick(await life.registry.list_models()) == []  # not idle long enough
    life.lifecycle.activity.clear()  # (the engine's clock only moves forward; this test jumps back)
    idle_for(life, "m", 6)
    assert await life.lifecycle.tick(await life.registry.list_models()) == ["m"]
    rec = await life.settle("m")
    assert rec.status is ModelStatus.SLEEPING and rec.sleep_mode is SleepMode.PARKED and not rec.resident
    assert life.reserved("m") == {}  # memory released
    assert life.cluster.apps["m"].plan.replicas == []  # the app keeps its router, without engines
    assert rec.plan.replicas and "no requests for 6s" in rec.sleep_reason
    gpu = (await life.registry.device_states())[0]
    assert gpu.reserved_bytes == 0 and gpu.dormant == ["m/r0"] and gpu.dormant_bytes == rec.plan.replicas[0].reservation_bytes

    woke = await life.registry.transition(t.Wake(model_id="m"))
    assert woke.ok and woke.record.status is ModelStatus.WAKING
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.resident and set(life.reserved("m")) == {"m/r0"}
    assert rec.last_wake is not None and rec.last_wake.how is SleepMode.PARKED
    assert rec.last_wake.engine_start_s == 1.5 and rec.last_wake.warm_up_s == 0.25
    assert rec.last_wake.placement_s >= 0 and rec.woke_at is not None and rec.sleep_mode is None


# --- sleeping in place (vLLM sleep mode: level 1 or 2) ----------------------------------------
async def sleepy(hive: Hive, model_id: str, residual: dict[str, int] | None = None, **spec):
    """A ready model whose engine can sleep in place, put to sleep by its timeout (``residual``: what its
    engine says it still holds per device once asleep; None: it measures nothing)."""
    hive.cluster.sleepy[(model_id, 0)] = FakeSleep(residual=residual)
    rec = await ready(hive, model_id, sleep_timeout=5, **spec)
    idle_for(hive, model_id, 6)
    assert model_id in await hive.lifecycle.tick(await hive.registry.list_models())
    return rec, await hive.settle(model_id)


async def test_an_engine_that_can_sleep_sleeps_in_place_at_level_1_with_its_weights_in_host_ram(life):
    before, rec = await sleepy(life, "m")
    assert rec.status is ModelStatus.SLEEPING and rec.sleep_mode is SleepMode.LEVEL1 and not rec.resident
    assert life.cluster.sleepy[("m", 0)].calls == ["sleep1"]
    assert life.cluster.apps["m"].builds == 1 and life.cluster.apps["m"].plan.replicas  # the engine stays
    held = life.reserved("m")
    assert set(held) == {"m/r0", "m/r0@host"}  # the weights in the node's RAM, a residual on the GPU
    assert held["m/r0@host"].bytes_per_device == before.plan.replicas[0].memory.weights
    # the fake engine measured nothing: the plan's residual stays booked, the CUDA context and (a sim
    # plan carries no vLLM offload option) the graph pool; TP 1 has no NCCL
    rp = before.plan.replicas[0]
    residual = CUDA_CONTEXT_BYTES + rp.memory.cuda_graphs
    assert held["m/r0"].state is ReservationState.ASLEEP and held["m/r0"].held_bytes == residual
    gpu = (await life.registry.device_states())[0]
    assert gpu.reserved_bytes == residual and gpu.dormant == ["m/r0"]
    assert gpu.dormant_bytes == rp.reservation_bytes - residual  # what its wake still needs
    node = (await life.registry.node_states())[0]
    assert node.host_reserved_bytes == before.plan.replicas[0].memory.weights

    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.resident and set(life.reserved("m")) == {"m/r0"}
    assert life.cluster.sleepy[("m", 0)].calls == ["sleep1", "wake1"] and life.cluster.apps["m"].builds == 1
    assert rec.last_wake.how is SleepMode.LEVEL1 and rec.last_wake.engine_start_s == 0.5
    assert rec.last_wake.warm_up_s == 0.05 and rec.plan == before.plan and rec.sleep_mode is None
    assert rec.engine_start_s == before.engine_start_s  # the engine's own start is still its first one


async def test_level_1_weights_in_host_ram_count_once(life):
    """Booked before they move (on top of what the node uses); once the engine slept they are in the
    node's sampled use and that booking explains them: never counted twice."""
    before, _ = await sleepy(life, "m")
    life.cluster.host_used_bytes += before.plan.replicas[0].memory.weights  # the sleeping engine holds them
    await life.sample()
    budget = int(life.registry.ledger.budget_fraction * 64 * 2**30)
    assert life.registry.ledger.host_available("node-a:host") == budget - life.cluster.host_used_bytes


async def test_without_room_in_host_ram_it_sleeps_at_level_2_holding_only_its_residual(life):
    life.cluster.host_used_bytes = 60 * 2**30  # of 64: past the 0.90 budget already
    await life.sample()
    _, rec = await sleepy(life, "m", residual={"node-a:gpu0": 700 * MIB})
    assert rec.sleep_mode is SleepMode.LEVEL2 and set(life.reserved("m")) == {"m/r0"}  # no host RAM
    assert life.reserved("m")["m/r0"].held_bytes == 700 * MIB  # what its engine said it still holds
    assert "level 2" in (await life.registry.get_model("m")).message or rec.message
    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.LEVEL2
    assert life.cluster.sleepy[("m", 0)].calls == ["sleep2", "wake2"] and rec.last_wake.engine_start_s == 3.0


async def test_a_wake_that_brings_back_a_different_answer_restarts_the_engine(life):
    await sleepy(life, "m")
    life.cluster.sleepy[("m", 0)].corrupt = True
    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.PARKED  # started again
    assert life.cluster.apps["m"].builds == 3  # parked (router only), then built again
    assert set(life.reserved("m")) == {"m/r0"}  # no host RAM left behind


async def test_a_model_asleep_in_place_takes_its_devices_back_by_evicting_a_newcomer(life):
    await sleepy(life, "m", **BIG)
    await ready(life, "other", sleep_timeout=600, **BIG)  # took the card while m slept
    await life.registry.transition(t.Wake(model_id="m"))
    await life.settle("m")  # waits for other to park (the reconciler runs other's loop meanwhile)
    other = await life.settle("other")
    assert other.status is ModelStatus.SLEEPING and not other.resident and "make room for m" in other.sleep_reason
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.LEVEL1
    assert rec.last_wake.evicted == ["other"] and life.cluster.apps["m"].builds == 1


async def test_a_wake_in_place_on_a_packed_gpu_books_only_what_its_residual_does_not_hold(life):
    """m sleeps keeping R on the L4, measured by its engine; "other" (never evicted) keeps the rest. The
    wake needs m's footprint less R, which fits; the whole footprint again would not (it used to, once
    the residual showed as foreign use on a real GPU: a spurious eviction or a cold restart)."""
    m = await ready(life, "m", sleep_timeout=5, **BIG)
    other = await ready(life, "other")  # no sleep_timeout: never evicted
    f, o = m.plan.replicas[0].reservation_bytes, other.plan.replicas[0].reservation_bytes
    budget = int(0.9 * (await life.registry.device_states())[0].total_bytes)
    assert budget - f - o >= 0  # both fit awake
    r = budget - f - o + 256 * MIB  # what m keeps asleep: the whole footprint would not fit beside it
    life.cluster.sleepy[("m", 0)] = FakeSleep(residual={"node-a:gpu0": r})
    idle_for(life, "m", 6)
    assert await life.lifecycle.tick(await life.registry.list_models()) == ["m"]
    rec = await life.settle("m")
    assert rec.sleep_mode is SleepMode.LEVEL1 and not rec.resident
    gpu = (await life.registry.device_states())[0]
    assert gpu.reserved_bytes == r + o and gpu.available_bytes == budget - r - o < f
    assert gpu.dormant_bytes == f - r <= gpu.available_bytes

    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.LEVEL1 and rec.last_wake.evicted == []
    assert (await life.registry.get_model("other")).status is ModelStatus.READY
    assert life.reserved("m")["m/r0"].state is ReservationState.ACTIVE
    assert (await life.registry.device_states())[0].reserved_bytes == f + o


async def test_a_residual_measured_above_its_reservation_books_the_reservation(life):
    before, _ = await sleepy(life, "m", residual={"node-a:gpu0": 40 * 2**30})
    assert life.reserved("m")["m/r0"].held_bytes == before.plan.replicas[0].reservation_bytes


async def test_a_model_asleep_in_place_waits_for_requests_on_its_gpu_rather_than_start_cold(life):
    await sleepy(life, "m", **BIG)
    await ready(life, "other", sleep_timeout=600, **BIG)
    idle_for(life, "other", 0, in_flight=1)
    await life.lifecycle.tick(await life.registry.list_models())  # the admin sees other's request in flight
    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m", max_steps=3)
    assert rec.status is ModelStatus.WAKING and rec.sleeps_in_place and "waiting for their requests to end" in rec.message
    idle_for(life, "other", 0)  # its request ended
    await life.lifecycle.tick(await life.registry.list_models())
    await life.settle("m")
    await life.settle("other")
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.LEVEL1 and rec.last_wake.evicted == ["other"]


async def test_a_model_asleep_where_nothing_can_make_room_starts_again_on_another_gpu():
    h = await life_on("L4.L4")
    try:
        before, _ = await sleepy(h, "m", **BIG)  # (on gpu0, the first of two equal cards)
        await ready(h, "pinned", gpu="node-a:gpu0", **BIG)  # no sleep_timeout: never evicted
        await h.registry.transition(t.Wake(model_id="m"))
        rec = await h.settle("m")
        assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.PARKED
        assert before.plan.replicas[0].devices == ["node-a:gpu0"] and rec.plan.replicas[0].devices == ["node-a:gpu1"]
        assert set(h.reserved("m")) == {"m/r0"}
    finally:
        set_cluster(None)


async def test_a_restarted_registry_keeps_the_host_ram_and_the_residual_of_a_level_1_sleeper(life):
    before, _ = await sleepy(life, "m", residual={"node-a:gpu0": 900 * MIB})
    await life.start_registry()  # a new registry replica reads the records back
    await life.sample()
    assert set(life.reserved("m")) == {"m/r0", "m/r0@host"}
    kept = life.reserved("m")["m/r0"]
    assert kept.state is ReservationState.ASLEEP and kept.held_bytes == 900 * MIB  # as measured, not by plan
    assert (await life.registry.device_states())[0].reserved_bytes == 900 * MIB
    assert (await life.registry.node_states())[0].host_reserved_bytes == before.plan.replicas[0].memory.weights


async def test_a_doze_before_the_first_sample_waits_for_it_and_sleeps_at_level_1(life):
    """``doze`` books host RAM, which a registry knows only once it sampled the nodes: asked of a
    registry that just started, it waits for the first sample (``transitions.RULES``: needs_sample)
    rather than find no host RAM and settle for level 2."""
    rec = await ready(life, "m", sleep_timeout=5)
    assert (await life.registry.transition(t.Sleep(model_id="m", version=rec.version, reason="idle"))).ok
    await life.start_registry()  # a new registry replica, not sampled yet
    rec = await life.registry.get_model("m")
    assert rec.status is ModelStatus.SLEEPING and rec.resident and rec.sleep_mode is None
    doze = asyncio.ensure_future(life.registry.transition(t.Doze(model_id="m", version=rec.version)))
    await asyncio.sleep(0.05)
    assert not doze.done()
    await life.sample()
    out = await asyncio.wait_for(doze, 5)
    assert out.ok and out.record.sleep_mode is SleepMode.LEVEL1, out.record.message
    assert "m/r0@host" in life.reserved("m")


# --- asleep warm (no sleep mode: vLLM stops, the replica's process stays; issue 27) ----------------
async def warm(hive: Hive, model_id: str, residual: dict[str, int] | None = None, **spec):
    """A ready model whose engine has no sleep mode but keeps its process, put to sleep by its timeout."""
    hive.cluster.sleepy[(model_id, 0)] = FakeSleep(residual=residual, warm=True)
    rec = await ready(hive, model_id, sleep_timeout=5, **spec)
    idle_for(hive, model_id, 6)
    assert model_id in await hive.lifecycle.tick(await hive.registry.list_models())
    return rec, await hive.settle(model_id)


async def test_an_engine_without_sleep_mode_sleeps_warm_and_wakes_in_its_kept_process(life):
    before, rec = await warm(life, "m", residual={"node-a:gpu0": 300 * MIB})
    assert rec.status is ModelStatus.SLEEPING and rec.sleep_mode is SleepMode.WARM and not rec.resident
    assert life.cluster.sleepy[("m", 0)].calls == ["rest"]
    assert life.cluster.apps["m"].builds == 1 and life.cluster.apps["m"].plan.replicas  # the replica stays
    held = life.reserved("m")
    assert set(held) == {"m/r0"}, "nothing moves to host RAM"
    assert held["m/r0"].state is ReservationState.ASLEEP and held["m/r0"].held_bytes == 300 * MIB
    gpu = (await life.registry.device_states())[0]
    assert gpu.reserved_bytes == 300 * MIB and gpu.dormant == ["m/r0"]

    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.resident and rec.sleep_mode is None
    assert life.cluster.sleepy[("m", 0)].calls == ["rest", "wake_warm"] and life.cluster.apps["m"].builds == 1
    assert rec.last_wake.how is SleepMode.WARM and rec.last_wake.engine_start_s == 12.0
    assert life.reserved("m")["m/r0"].state is ReservationState.ACTIVE and rec.plan == before.plan


async def test_a_warm_wake_that_fails_starts_the_model_cold(life):
    """Its kept process died (or vLLM would not start in it): parked, then placed and started anew."""
    await warm(life, "m")
    life.cluster.sleepy[("m", 0)].corrupt = True
    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.PARKED
    assert life.cluster.apps["m"].builds == 3 and set(life.reserved("m")) == {"m/r0"}


async def test_kept_processes_are_stopped_before_anyone_is_evicted_to_make_room(life):
    """m sleeps warm keeping R on the card; "new" wakes and fits only without R: m's process is
    stopped (parked: nothing booked), and "awake", which could be put to sleep, stays."""
    awake = await ready(life, "awake", sleep_timeout=10**6, vllm_kwargs={"kv_cache_memory_bytes": 2**30})
    new = await ready(life, "new", sleep_timeout=5, **BIG)
    idle_for(life, "new", 6)
    assert await life.lifecycle.tick(await life.registry.list_models()) == ["new"]
    assert (await life.settle("new")).sleep_mode is SleepMode.PARKED  # the sim engine on a GPU without sleep mode
    f = new.plan.replicas[0].reservation_bytes
    budget = int(0.9 * (await life.registry.device_states())[0].total_bytes)
    r = budget - awake.plan.replicas[0].reservation_bytes - f + 2**30  # beside R, new does not fit
    await warm(life, "m", residual={"node-a:gpu0": r}, **BIG)
    assert (await life.registry.device_states())[0].available_bytes < f

    await life.registry.transition(t.Wake(model_id="new"))
    rec = await life.settle("new")
    assert rec.status is ModelStatus.READY and rec.last_wake.evicted == [] and rec.plan.replicas[0].devices == ["node-a:gpu0"]
    m = await life.registry.get_model("m")
    assert m.status is ModelStatus.SLEEPING and m.sleep_mode is SleepMode.PARKED and not m.cooling
    assert life.reserved("m") == {} and life.cluster.apps["m"].plan.replicas == []
    assert (await life.registry.get_model("awake")).status is ModelStatus.READY, "nobody awake was evicted"


async def test_a_warm_model_whose_card_is_full_starts_where_there_is_room_evicting_nobody():
    """Its kept process saves one process start, less than waiting for room made on its card: it is
    placed anew (cold) on the free card, and the sleepable model on its own card stays."""
    h = await life_on("L4.L4")
    try:
        before, _ = await warm(h, "m", **BIG)  # (on gpu0, the first of two equal cards)
        assert before.plan.replicas[0].devices == ["node-a:gpu0"]
        await ready(h, "other", sleep_timeout=600, gpu="node-a:gpu0", **BIG)
        await h.registry.transition(t.Wake(model_id="m"))
        rec = await h.settle("m")
        assert rec.status is ModelStatus.READY and rec.last_wake.how is SleepMode.PARKED
        assert rec.plan.replicas[0].devices == ["node-a:gpu1"] and rec.last_wake.evicted == []
        assert (await h.registry.get_model("other")).status is ModelStatus.READY
        assert h.cluster.sleepy[("m", 0)].calls == ["rest"], "its kept process was not woken"
    finally:
        set_cluster(None)


async def test_a_restarted_registry_keeps_what_a_warm_process_holds(life):
    await warm(life, "m", residual={"node-a:gpu0": 700 * MIB})
    await life.start_registry()
    await life.sample()
    kept = life.reserved("m")["m/r0"]
    assert kept.state is ReservationState.ASLEEP and kept.held_bytes == 700 * MIB and set(life.reserved("m")) == {"m/r0"}


async def test_a_model_with_requests_in_flight_never_sleeps(life):
    await ready(life, "m", sleep_timeout=5)
    idle_for(life, "m", 600, in_flight=1)
    assert await life.lifecycle.tick(await life.registry.list_models()) == []
    assert (await life.registry.get_model("m")).status is ModelStatus.READY


async def test_a_model_woken_while_it_drained_never_parks(life):
    await ready(life, "m", sleep_timeout=5)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    await life.registry.transition(t.Wake(model_id="m"))  # a request came before the reconciler drained it
    rec = await life.settle("m")
    assert rec.status is ModelStatus.READY and life.cluster.apps["m"].builds == 1  # never rebuilt
    assert rec.last_wake is None and set(life.reserved("m")) == {"m/r0"}


async def test_waking_model_evicts_the_cheapest_sleepable_model(life):
    await ready(life, "a", sleep_timeout=600, **BIG)
    room = await life.lifecycle.make_room((await life.registry.get_model("a")).spec.model_copy(update={"model_id": "b"}))
    assert room.plan is None and room.evicting == ["a"] == room.waiting_for  # one L4 holds one of them
    a = await life.settle("a")
    assert a.status is ModelStatus.SLEEPING and not a.resident and "evicted to make room for b" in a.sleep_reason


async def test_no_room_names_the_models_that_hold_it(life):
    await ready(life, "pinned", sleep_timeout=600, keep_resident=True, **BIG)
    spec = (await life.registry.get_model("pinned")).spec.model_copy(update={"model_id": "b", "keep_resident": False})
    room = await life.lifecycle.make_room(spec)
    assert room.plan is None and room.status_code == 503 and "pinned (keep_resident)" in room.error


async def test_minimum_residency_defers_the_eviction(life):
    life.lifecycle.settings = LIFE.model_copy(update={"min_residency_s": 60})
    rec = await ready(life, "a", sleep_timeout=600, **BIG)
    assert (await life.registry.transition(t.Sleep(model_id="a", version=rec.version, reason="idle"))).ok
    assert (await life.settle("a")).status is ModelStatus.SLEEPING
    assert (await life.registry.transition(t.Wake(model_id="a"))).ok
    await life.step("a")
    assert (await life.registry.get_model("a")).wake_placed
    life.clock.advance(90)  # its engines took 90 s to start: it is kept the cap, 60 s
    assert (await life.settle("a")).woke_at == life.clock()
    life.clock.advance(10)  # woke 10 s ago
    room = await life.lifecycle.make_room((await life.registry.get_model("a")).spec.model_copy(update={"model_id": "b"}))
    assert room.plan is None and not room.evicting and room.retry_at == pytest.approx(life.clock() + 50, abs=2)
    assert (await life.registry.get_model("a")).status is ModelStatus.READY


async def test_a_wake_without_room_fails_cleanly_and_held_requests_learn_why(life):
    await ready(life, "m", sleep_timeout=5, **BIG)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    await life.settle("m")
    await ready(life, "other", keep_resident=True, sleep_timeout=600, **BIG)  # took the card meanwhile
    await life.registry.transition(t.Wake(model_id="m"))
    rec = await life.settle("m")
    assert rec.status is ModelStatus.SLEEPING and rec.wake_failed_at is not None
    assert "other (keep_resident)" in rec.message and life.reserved("m") == {}


async def test_idle_destroy_frees_memory_and_keeps_a_record_that_says_why(life):
    await ready(life, "m", idle_timeout=30)
    idle_for(life, "m", 31)
    assert await life.lifecycle.tick(await life.registry.list_models()) == ["m"]
    rec = await life.settle("m")
    assert rec.status is ModelStatus.DESTROYED and "idle_timeout 30s" in rec.message
    assert life.reserved("m") == {} and "m" not in life.cluster.apps
    again = await life.deploy("m")  # the id is free again, and the memory with it
    assert again.status is ModelStatus.DEPLOYING


async def test_a_parked_model_is_destroyed_after_its_idle_timeout(life):
    await ready(life, "m", sleep_timeout=5, idle_timeout=60)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    await life.settle("m")
    life.clock.advance(55)  # its engines' last request: 61 s ago
    assert await life.lifecycle.tick(await life.registry.list_models()) == ["m"]
    assert (await life.settle("m")).status is ModelStatus.DESTROYED


# --- the hold -------------------------------------------------------------------------------
async def test_held_requests_wait_for_the_wake_and_are_bounded(life):
    await ready(life, "m", sleep_timeout=5)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    await life.settle("m")
    asked: list[str] = []

    async def ask_wake(model_id):
        asked.append(model_id)
        await life.registry.transition(t.Wake(model_id=model_id))

    hold = WakeHold(LIFE, ask_wake, publisher=recorded_publisher())
    await hold.update({"m": await life.registry.get_model("m")})
    waiters = [asyncio.create_task(hold.wait("m")) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(HoldRefused) as third:  # the bound is 2
        await hold.wait("m")
    assert third.value.response.status_code == 429 and third.value.response.headers["retry-after"]
    assert asked == ["m"]  # both waiters, one wake
    await life.settle("m")
    await hold.update({"m": await life.registry.get_model("m")})
    assert all(r.status is ModelStatus.READY for r in await asyncio.gather(*waiters))
    assert hold.held["m"] == 0


async def test_held_requests_get_503_with_the_reason_when_the_wake_fails(life):
    await ready(life, "m", sleep_timeout=5, **BIG)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    await life.settle("m")
    hold = WakeHold(LIFE, lambda model_id: life.registry.transition(t.Wake(model_id=model_id)), clock=life.clock,
                    publisher=recorded_publisher())
    await hold.update({"m": await life.registry.get_model("m")})
    waiter = asyncio.create_task(hold.wait("m"))
    await asyncio.sleep(0.05)
    await ready(life, "other", keep_resident=True, sleep_timeout=600, **BIG)
    await life.settle("m")
    await hold.update({"m": await life.registry.get_model("m")})
    with pytest.raises(HoldRefused) as refused:
        await waiter
    body = json.loads(refused.value.response.body)
    assert refused.value.response.status_code == 503 and "could not wake" in body["error"]["message"]


async def test_a_hold_times_out_with_503_and_a_destroyed_model_answers_404(life):
    settings = LIFE.model_copy(update={"hold_timeout_s": 0.2})
    await ready(life, "m", sleep_timeout=5)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    await life.settle("m")

    async def no_wake(model_id):
        return None

    hold = WakeHold(settings, no_wake, publisher=recorded_publisher())
    await hold.update({"m": await life.registry.get_model("m")})
    with pytest.raises(HoldRefused) as late:
        await hold.wait("m")
    assert late.value.response.status_code == 503 and "did not wake within 0s" in json.loads(late.value.response.body)["error"]["message"]
    gone = (await life.registry.get_model("m")).model_copy(update={"status": ModelStatus.DESTROYED, "message": "idle"})
    await hold.update({"m": gone})
    with pytest.raises(HoldRefused) as destroyed:
        await hold.wait("m")
    assert destroyed.value.response.status_code == 404 and "POST /admin/models" in json.loads(destroyed.value.response.body)["error"]["message"]


# --- load-driven replicas ------------------------------------------------------------------
def test_scale_decision_needs_every_replica_past_the_threshold_for_the_window():
    from hive_apps.core.lifecycle import ScaleClock, replica_to_retire, scale_decision

    step, clock = scale_decision([0.9, 0.95], (1, 3), ScaleClock(), now=100.0, window_s=30)
    assert step == 0 and clock.above_since == 100.0
    step, clock = scale_decision([0.9, 0.5], (1, 3), clock, now=120.0, window_s=30)  # one fell below: reset
    assert step == 0 and clock.above_since is None
    clock = ScaleClock(above_since=100.0)
    assert scale_decision([0.9, 0.9], (1, 3), clock, now=130.0, window_s=30)[0] == 1
    assert scale_decision([0.9, 0.9, 0.9], (1, 3), clock, now=130.0, window_s=30)[0] == 0  # at max_replicas
    low = ScaleClock(below_since=100.0)
    assert scale_decision([0.1, 0.0], (1, 3), low, now=130.0, window_s=30)[0] == -1
    assert scale_decision([0.1], (1, 3), low, now=130.0, window_s=30)[0] == 0  # at min_replicas
    assert replica_to_retire({0: 0.1, 1: 0.0, 2: 0.0}) == 2


def test_replica_bounds_are_validated():
    from pydantic import ValidationError

    from hive_apps.core.spec import ModelSpec

    with pytest.raises(ValidationError, match="min_replicas <= replicas <= max_replicas"):
        ModelSpec(model_id="m", model="x", replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="min_replicas needs max_replicas"):
        ModelSpec(model_id="m", model="x", min_replicas=1)
    with pytest.raises(ValidationError, match="cannot be combined with gpu pins"):
        ModelSpec(model_id="m", model="x", gpu="n:gpu0", max_replicas=2)
    assert ModelSpec(model_id="m", model="x", max_replicas=4).replica_bounds == (1, 4)


@pytest.fixture
async def pair():
    h = Hive(FakeCluster({"node-a": "H100-80GB.H100-80GB"}))
    h.lifecycle = Lifecycle(h.cluster, LIFE.model_copy(update={"scale_window_s": 0}), h.clock)
    h.reconciler = Reconciler(h.cluster, LIFE, h.lifecycle, apply_grace_s=0, clock=h.clock)
    await h.start_registry()
    await h.sample()
    yield h
    set_cluster(None)


def busy(hive: Hive, model_id: str, share: float) -> None:
    rec = hive.registry.book.records[model_id]
    seqs = rec.plan.replicas[0].settings.max_num_seqs
    hive.cluster.loads[model_id] = EngineLoad(running=int(seqs * share), max_num_seqs=seqs, last_request_at=hive.clock())


async def test_load_adds_a_replica_and_removes_it_when_load_goes(pair):
    await ready(pair, "m", max_replicas=2)
    busy(pair, "m", 0.9)
    assert await pair.lifecycle.tick(await pair.registry.list_models()) == ["m"]  # (a window of 0 s here)
    rec = await pair.registry.get_model("m")
    assert rec.status is ModelStatus.SCALING and [rp.index for rp in rec.plan.replicas] == [0, 1]
    assert set(pair.reserved("m")) == {"m/r0", "m/r1"}
    rec = await pair.settle("m")
    assert rec.status is ModelStatus.READY and rec.engine_start_s == {"r0": 1.5, "r1": 2.5}
    assert await pair.lifecycle.tick(await pair.registry.list_models()) == []  # at max_replicas

    busy(pair, "m", 0.0)
    assert await pair.lifecycle.tick(await pair.registry.list_models()) == ["m"]
    rec = await pair.registry.get_model("m")
    assert rec.retiring == [1]  # the newest of equally idle replicas; routers skip it from now on
    from hive_apps.serving.routing.follow import live_plan

    assert [rp.index for rp in live_plan(rec).replicas] == [0]
    rec = await pair.settle("m")
    assert [rp.index for rp in rec.plan.replicas] == [0] and rec.retiring == [] and rec.status is ModelStatus.READY
    assert set(pair.reserved("m")) == {"m/r0"} and [rp.index for rp in pair.cluster.apps["m"].plan.replicas] == [0]
    assert await pair.lifecycle.tick(await pair.registry.list_models()) == []  # at min_replicas (= replicas)


async def test_a_pending_scale_down_does_not_outlive_a_sleep():
    """A retire the model went to sleep before finishing must not take a replica from the wake: a
    parked model wakes with min_replicas, and those are what it keeps."""
    hive = await life_on("H100-80GB.H100-80GB.H100-80GB")
    try:
        rec = await ready(hive, "m", replicas=3, min_replicas=2, max_replicas=3, sleep_timeout=5)
        rec = (await hive.registry.transition(t.Retire(model_id="m", version=rec.version, index=0))).record
        assert (await hive.registry.transition(t.Sleep(model_id="m", version=rec.version, reason="idle"))).ok
        rec = await hive.settle("m")
        assert rec.status is ModelStatus.SLEEPING and rec.sleep_mode is SleepMode.PARKED and rec.retiring == []
        assert (await hive.registry.transition(t.Wake(model_id="m"))).ok
        rec = await hive.settle("m")
        assert rec.status is ModelStatus.READY and rec.retiring == []
        assert len(rec.plan.replicas) == 2 and len(hive.reserved("m")) == 2
    finally:
        set_cluster(None)


async def test_an_added_replica_that_fails_is_dropped_and_freed(pair):
    await ready(pair, "m", max_replicas=2)
    busy(pair, "m", 0.9)
    await pair.lifecycle.tick(await pair.registry.list_models())
    pair.cluster.start_mode["m"] = "fail"
    rec = await pair.settle("m")
    assert rec.status is ModelStatus.READY and "could not add a replica" in rec.message
    assert [rp.index for rp in rec.plan.replicas] == [0] and set(pair.reserved("m")) == {"m/r0"}


async def test_replica_loads_for_the_status_page(pair):
    await ready(pair, "m", max_replicas=2)
    busy(pair, "m", 0.5)
    rec = await pair.registry.get_model("m")
    loads = await pair.lifecycle.replica_loads(rec)
    seqs = rec.plan.replicas[0].settings.max_num_seqs
    assert set(loads) == {"r0"} and loads["r0"].capacity == seqs and loads["r0"].running == int(seqs * 0.5)


def test_a_held_stream_that_ends_in_an_error_types_it_as_the_json_answer_would():
    from hive_apps.core.openai_errors import ERROR_TYPES, sse_error
    from hive_apps.serving.routing.hold import _message

    events = sse_error(429, "the hold queue is full").decode().split("\n\n")
    err = json.loads(events[0].removeprefix("data: "))["error"]
    assert err == {"message": "the hold queue is full", "type": ERROR_TYPES[429], "param": None, "code": 429}
    assert events[1] == "data: [DONE]"
    assert _message(b'{"error": {"message": "bad request", "type": "BadRequestError"}}') == "bad request"
    assert _message(b"Internal Server Error") == "Internal Server Error"


async def test_an_eviction_counts_only_what_a_victim_that_sleeps_in_place_gives_back(life):
    """A vLLM engine started with sleep mode keeps its residual on the GPU when evicted: making room
    counts its reservation less that, so one eviction round frees what it promised (issue #24)."""
    rec = await ready(life, "a", sleep_timeout=600, **BIG)
    rp = rec.plan.replicas[0]
    (dev,) = rp.devices
    held = life.reserved("a")["a/r0"].held_bytes
    assert await life.lifecycle._held_by(["a"], [rec]) == {dev: held}  # the sim engine's plan: it parks
    sleeping = rp.model_copy(update={"engine_kwargs": {**rp.engine_kwargs, "enable_sleep_mode": True}})
    vllm = rec.model_copy(update={"plan": rec.plan.model_copy(update={"replicas": [sleeping]})})
    keeps = sleep_residual_bytes(sleeping)
    assert 0 < keeps < held and await life.lifecycle._held_by(["a"], [vllm]) == {dev: held - keeps}
    assert await life.lifecycle._held_by(["a"]) == {dev: held}  # without its record: counted as parking
