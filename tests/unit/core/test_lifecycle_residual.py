"""What an engine asleep in place still holds (issue #24 item 2): the plan's estimate of it
(``planning/memory.sleep_residual_bytes``), the vLLM options that shrink it (``planning/sizing``), and
the registry's books: the residual stays booked after ``dozed``, a wake books only the rest, a failed
wake goes back to the residual, and a stored record (and a rebuilt ledger) keeps it."""

from __future__ import annotations

import json

import pytest

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.memory import (
    CUDA_CONTEXT_BYTES,
    GPU_RUNTIME_BYTES,
    MIB,
    sleep_residual_bytes,
    tp_comm_bytes,
)
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.types import EngineSettings, MemoryBreakdown, ReplicaPlan
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.book import TransitionError
from hive_apps.core.state.records import Reservation, ReservationState, SleepMode, dump_stored, load_stored
from tests.unit.core.test_model_state import GIB, World, replica
from tests.unit.planning_fixtures import cpu, fixture_path, gpu, profile

GRAPHS = 300 * MIB


def sleeper(tp: int = 1, graphs: int = GRAPHS, kind: DeviceKind = DeviceKind.GPU, reservation: int = 20 * GIB,
            graphs_field: bool = True, **engine_kwargs) -> ReplicaPlan:
    """A replica whose overhead is the context, the runtime buffers, NCCL at TP > 1 and ``graphs``."""
    overhead = CUDA_CONTEXT_BYTES + GPU_RUNTIME_BYTES + tp_comm_bytes(tp) + graphs
    return ReplicaPlan(
        index=0, node_id="id-a", node_name="a", devices=[f"a:gpu{i}" for i in range(tp)], device_kind=kind,
        settings=EngineSettings(tensor_parallel_size=tp, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=2048,
                                gpu_memory_utilization=0.5, kv_cache_memory_bytes=GIB),
        memory=MemoryBreakdown(weights=4 * GIB, kv_cache=GIB, activations=GIB, overhead=overhead,
                               cuda_graphs=graphs if graphs_field else 0),
        reservation_bytes=reservation, engine_kwargs=engine_kwargs)


# --- the plan's estimate --------------------------------------------------------------------------
def test_the_planned_residual_is_the_context_plus_what_the_start_options_keep():
    context, graphs = CUDA_CONTEXT_BYTES, GRAPHS
    assert sleep_residual_bytes(sleeper()) == context + graphs  # vLLM's defaults keep the graph pool
    assert sleep_residual_bytes(sleeper(sleep_mode_offload_cudagraph=True)) == context
    # TP 4: NCCL stays on each rank unless suspended
    assert sleep_residual_bytes(sleeper(tp=4)) == context + graphs + tp_comm_bytes(4)
    assert sleep_residual_bytes(sleeper(tp=4, sleep_mode_offload_cudagraph=True)) == context + tp_comm_bytes(4)
    assert sleep_residual_bytes(sleeper(tp=4, sleep_mode_offload_cudagraph=True, enable_nccl_comm_suspend=True)) == context
    # a plan stored before the graph pool was a field of its own: read out of the overhead
    assert sleep_residual_bytes(sleeper(graphs_field=False)) == context + graphs
    assert sleep_residual_bytes(sleeper(kind=DeviceKind.SIM_GPU)) == context + graphs  # a sim engine stands in for vLLM
    assert sleep_residual_bytes(sleeper(kind=DeviceKind.CPU)) == 0  # no sleep mode on CPU: it parks
    assert sleep_residual_bytes(sleeper(reservation=256 * MIB)) == 256 * MIB  # never above its reservation


def test_sleepable_vllm_engines_on_gpus_start_with_the_options_that_release_graphs_and_nccl():
    def kwargs(devices, engine="vllm", tp=1, **spec):
        s = ModelSpec(model_id="m", model=fixture_path("Qwen__Qwen3-8B"), engine=engine,
                      vllm_kwargs={"tensor_parallel_size": tp}, **spec)
        return plan_deployment(s, devices, profile("Qwen__Qwen3-8B")).replicas[0].engine_kwargs

    one = kwargs([gpu("H100-80GB")], sleep_timeout=60)
    assert one["sleep_mode_offload_cudagraph"] is True and "enable_nccl_comm_suspend" not in one  # no NCCL at TP 1
    two = kwargs([gpu("L4", "n1", 0), gpu("L4", "n1", 1)], tp=2, sleep_timeout=60)
    assert two["sleep_mode_offload_cudagraph"] is True and two["enable_nccl_comm_suspend"] is True
    for other in (kwargs([gpu("H100-80GB")]), kwargs([cpu()], sleep_timeout=60),
                  kwargs([gpu("H100-80GB", kind=DeviceKind.SIM_GPU)], engine="sim", sleep_timeout=60)):
        assert not {"sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend"} & set(other)


# --- the registry's books ---------------------------------------------------------------------------
def asleep(w: World, residuals: dict[int, dict[str, int]] | None = None) -> None:
    """Deploy m on a:gpu0 (8 GiB booked), let it serve, then sleep it in place at level 1."""
    w.deploy(replica(0))
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.doze("m", w.v)
    w.book.dozed("m", w.v, w.tick(), residuals)


def other_booking(rp: ReplicaPlan) -> Reservation:
    return Reservation.for_replica("other", rp)


def device(w: World, dev: str = "a:gpu0"):
    return w.ledger.state_of(w.ledger.devices[dev])


BUDGET = int(0.9 * 40 * GIB)  # World's GPUs: 40 GiB, a 0.90 budget


def test_the_measured_residual_stays_booked_after_dozed():
    w = World()
    asleep(w, {0: {"a:gpu0": 700 * MIB}})
    r = w.ledger.reservations["m/r0"]
    assert r.state is ReservationState.ASLEEP and r.held_bytes == 700 * MIB and r.bytes_per_device == 8 * GIB
    assert device(w).reserved_bytes == 700 * MIB and device(w).available_bytes == BUDGET - 700 * MIB
    assert w.rec.sleep_mode is SleepMode.LEVEL1 and not w.rec.resident and w.rec.books(r)
    assert {s.device.id: s.dormant_bytes for s in w.book.device_states()}["a:gpu0"] == 8 * GIB - 700 * MIB


@pytest.mark.parametrize(("measured", "booked"), [
    ({"a:gpu0": 12 * GIB}, 8 * GIB),  # above its reservation: clamped (the rest shows as foreign use)
    ({"a:gpu0": -5}, 0),  # a sleep that freed more than the start measured: nothing
    ({"b:gpu1": 3 * GIB}, CUDA_CONTEXT_BYTES),  # not its device: as unmeasured, the plan's (its overhead is 1 B)
    (None, CUDA_CONTEXT_BYTES),
])
def test_the_booked_residual_is_bounded_by_the_plan(measured, booked):
    w = World()
    asleep(w, {0: measured} if measured is not None else None)
    assert w.ledger.reservations["m/r0"].held_bytes == booked


def test_a_wake_books_only_the_difference_and_fits_where_the_whole_footprint_would_not():
    w = World()
    asleep(w, {0: {"a:gpu0": 2 * GIB}})
    # another model takes all but 7 GiB of the budget: 8 GiB again would not fit, the 6 GiB it lacks do
    other = replica(0).model_copy(update={"reservation_bytes": BUDGET - 2 * GIB - 7 * GIB})
    w.ledger.reserve([other_booking(other)])
    assert device(w).available_bytes == 7 * GIB
    w.book.wake("m", w.tick())
    w.place()
    r = w.ledger.reservations["m/r0"]
    assert r.state is ReservationState.WAKING and r.held_bytes == 8 * GIB and r.explained_bytes == 2 * GIB
    assert device(w).reserved_bytes == BUDGET - 2 * GIB - 7 * GIB + 8 * GIB and device(w).available_bytes == 1 * GIB
    w.book.applied("m", w.v, w.rec.plan_generation, w.tick())
    w.book.started("m", w.v, w.tick(), wake_s={"r0": 0.5})
    r = w.ledger.reservations["m/r0"]
    assert r.state is ReservationState.ACTIVE and r.residual_bytes == 0 and r.held_bytes == 8 * GIB


def test_a_wake_that_cannot_fit_even_the_difference_is_refused_and_the_residual_stays():
    w = World()
    asleep(w, {0: {"a:gpu0": 2 * GIB}})
    w.ledger.reserve([other_booking(replica(0).model_copy(update={"reservation_bytes": BUDGET - 2 * GIB - 5 * GIB}))])
    w.book.wake("m", w.tick())
    with pytest.raises(TransitionError, match="short by 1.00 GiB"):  # needs 6 GiB, 5 GiB available
        w.place()
    assert w.ledger.reservations["m/r0"].state is ReservationState.ASLEEP
    w.book.wake_failed("m", w.v, "no room", w.tick())
    assert w.ledger.reservations["m/r0"].held_bytes == 2 * GIB and "m/r0@host" in w.ledger.reservations


def test_a_failed_wake_after_its_placement_goes_back_to_its_residual():
    w = World()
    asleep(w, {0: {"a:gpu0": 2 * GIB}})
    w.book.wake("m", w.tick())
    w.place()
    w.book.wake_failed("m", w.v, "the engine did not wake", w.tick())
    r = w.ledger.reservations["m/r0"]
    assert r.state is ReservationState.ASLEEP and r.held_bytes == 2 * GIB and w.rec.books(r)
    assert device(w).reserved_bytes == 2 * GIB


def test_parked_or_deleted_it_holds_nothing():
    w = World()
    asleep(w, {0: {"a:gpu0": 2 * GIB}})
    w.book.parked("m", w.tick())
    assert w.ledger.of_model("m") == [] and device(w).reserved_bytes == 0


def test_a_stored_sleeper_reads_back_with_its_residual_and_an_older_value_loads_without_one():
    w = World()
    asleep(w, {0: {"a:gpu0": 900 * MIB}})
    raw = dump_stored(w.rec, w.ledger.of_model("m"))
    stored = load_stored(raw)
    back = {r.key: r for r in stored.reservations or []}
    assert back["m/r0"].state is ReservationState.ASLEEP and back["m/r0"].held_bytes == 900 * MIB
    again = World()  # a restarted registry: the ledger from the stored value
    again.book.records["m"] = stored.record
    assert again.book.restore([stored], []) == (set(), {})  # nothing released, nothing to rewrite
    assert again.ledger.state_of(again.ledger.devices["a:gpu0"]).reserved_bytes == 900 * MIB
    # a value stored before residuals: an active booking without the field reads as holding none
    body = json.loads(raw)
    body["reservations"] = [{k: v for k, v in r.items() if k != "residual_bytes"} | {"state": "active"}
                            for r in body["reservations"]]
    old = load_stored(json.dumps(body).encode())
    assert all(r.residual_bytes == 0 for r in old.reservations or [])


def test_a_rebuilt_ledger_books_the_residual_as_before_or_else_by_plan():
    w = World()
    asleep(w, {0: {"a:gpu0": 900 * MIB}})
    w.book.rebuild_reservations({})
    assert w.ledger.reservations["m/r0"].held_bytes == 900 * MIB  # as booked before
    w.ledger.reservations.clear()
    w.book.rebuild_reservations({})
    r = w.ledger.reservations["m/r0"]
    assert r.state is ReservationState.ASLEEP and r.held_bytes == CUDA_CONTEXT_BYTES  # the plan's: its overhead is 1 B
