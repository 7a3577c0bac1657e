import pytest

from hive_apps.registry.devices import Device, DeviceKind
from hive_apps.registry.ledger import Ledger, ReservationError
from hive_apps.registry.records import Reservation, ReservationState

GIB = 2**30


def gpu(node: str, i: int, total=80 * GIB, used=0, kind=DeviceKind.GPU) -> Device:
    return Device(id=f"{node}:gpu{i}", node_id=f"id-{node}", node_name=node, kind=kind,
                  index=i, name="H100-80GB", total_bytes=total, used_bytes=used)


def res(model: str, devices: list[str], gib: float, replica: int = 0) -> Reservation:
    return Reservation(model_id=model, replica=replica, devices=devices, bytes_per_device=int(gib * GIB))


@pytest.fixture
def ledger():
    led = Ledger(budget_fraction=0.9)
    led.update_node("id-a", [gpu("a", 0), gpu("a", 1)])
    return led


def test_available_is_budget_minus_reserved_and_foreign(ledger):
    ledger.update_node("id-b", [gpu("b", 0, used=10 * GIB)])
    ledger.reserve([res("m", ["a:gpu0"], 20)])
    by_id = {s.device.id: s for s in ledger.states()}
    assert by_id["a:gpu0"].available_bytes == int(0.9 * 80 * GIB) - 20 * GIB
    assert by_id["a:gpu0"].replicas == ["m/r0"]
    # 10 GiB used by something the hive did not reserve counts as foreign
    assert by_id["b:gpu0"].foreign_bytes == 10 * GIB
    assert by_id["b:gpu0"].available_bytes == int(0.9 * 80 * GIB) - 10 * GIB


def test_used_memory_explained_by_reservations_is_not_foreign(ledger):
    ledger.reserve([res("m", ["a:gpu0"], 20)])
    ledger.update_node("id-a", [gpu("a", 0, used=18 * GIB), gpu("a", 1)])
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.foreign_bytes == 0 and s.reserved_bytes == 20 * GIB


def test_reserve_is_all_or_nothing(ledger):
    ledger.reserve([res("big", ["a:gpu1"], 60)])
    with pytest.raises(ReservationError, match="short by"):
        ledger.reserve([res("m", ["a:gpu0"], 10, 0), res("m", ["a:gpu1"], 20, 1)])
    assert ledger.of_model("m") == []
    assert ledger.reserved_on("a:gpu0") == 0


def test_tp_reservation_books_every_device(ledger):
    ledger.reserve([res("tp", ["a:gpu0", "a:gpu1"], 30)])
    assert ledger.reserved_on("a:gpu0") == ledger.reserved_on("a:gpu1") == 30 * GIB


def test_unknown_device_and_double_reservation(ledger):
    with pytest.raises(ReservationError, match="not in the registry"):
        ledger.reserve([res("m", ["zz:gpu0"], 1)])
    ledger.reserve([res("m", ["a:gpu0"], 1)])
    with pytest.raises(ReservationError, match="already holds"):
        ledger.reserve([res("m", ["a:gpu1"], 1)])


def test_release_and_activate(ledger):
    ledger.reserve([res("m", ["a:gpu0"], 5), res("m", ["a:gpu1"], 5, 1)])
    ledger.activate("m")
    assert {r.state for r in ledger.of_model("m")} == {ReservationState.ACTIVE}
    assert len(ledger.release("m")) == 2
    assert ledger.reserved_on("a:gpu0") == 0


def test_node_updates_replace_and_drop(ledger):
    ledger.update_node("id-a", [gpu("a", 0)])
    assert set(ledger.devices) == {"a:gpu0"}
    ledger.update_node("id-b", [gpu("b", 0)])
    ledger.drop_nodes_except({"id-b"})
    assert set(ledger.devices) == {"b:gpu0"}


def test_reservations_on_dead_nodes(ledger):
    ledger.update_node("id-b", [gpu("b", 0)])
    ledger.reserve([res("m", ["a:gpu0"], 1, 0), res("m", ["b:gpu0"], 1, 1), res("tp", ["a:gpu1"], 1)])
    assert sorted(r.key for r in ledger.on_nodes({"a"})) == ["m/r0", "tp/r0"]
    assert ledger.release_key("m/r0").replica == 0
    assert [r.key for r in ledger.of_model("m")] == ["m/r1"]


def test_engine_outgrowing_its_reservation_counts_in_full(ledger):
    ledger.reserve([res("m", ["a:gpu0"], 10)])
    ledger.activate("m")
    ledger.report_usage("m/r0", 12 * GIB)
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.reserved_bytes == 12 * GIB
    assert ledger.drifted() == {"m/r0": pytest.approx(0.2)}
    ledger.report_usage("m/r0", int(10.2 * GIB))  # within 5 %
    assert ledger.drifted() == {}


def test_simulated_gpu_used_memory_follows_engine_allocations(ledger):
    ledger.reserve([res("m", ["a:gpu0"], 10)])
    ledger.report_usage("m/r0", 9 * GIB)
    ledger.update_node("id-a", [gpu("a", 0, kind=DeviceKind.SIM_GPU)])  # the monitor reports 0 used
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.used_bytes == 9 * GIB and s.foreign_bytes == 0


def test_pending_reservations_expire(ledger):
    ledger.reserve([res("old", ["a:gpu0"], 1), res("new", ["a:gpu1"], 1)])
    ledger.reservations["old/r0"].created_at = 0
    ledger.activate("new")
    ledger.reservations["new/r0"].created_at = 0
    assert [r.key for r in ledger.expire_pending(now=1000, ttl_s=100)] == ["old/r0"]
    assert list(ledger.reservations) == ["new/r0"]


def test_released_sim_engine_stops_counting_before_the_next_sample(ledger):
    ledger.update_node("id-a", [gpu("a", 0, kind=DeviceKind.SIM_GPU)])
    ledger.reserve([res("m", ["a:gpu0"], 30)])
    ledger.report_usage("m/r0", 30 * GIB)
    assert ledger.state_of(ledger.devices["a:gpu0"]).used_bytes == 30 * GIB
    ledger.release("m")  # no new sample in between
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.used_bytes == 0 and s.foreign_bytes == 0 and s.available_bytes == int(0.9 * 80 * GIB)
