import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hive_apps.core.devices import Device, DeviceKind, NodeSample
from hive_apps.core.state.ledger import Ledger, ReservationError
from hive_apps.core.state.records import Reservation, ReservationState

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
    """An engine that measured itself, or one that is up without measuring (a CPU engine), explains
    its use: it is not counted twice."""
    ledger.reserve([res("m", ["a:gpu0"], 20), res("up", ["a:gpu1"], 20)])
    ledger.report_usage("m/r0", 18 * GIB)
    ledger.activate("up")
    ledger.update_node("id-a", [gpu("a", 0, used=18 * GIB), gpu("a", 1, used=20 * GIB)])
    for dev in ("a:gpu0", "a:gpu1"):
        s = ledger.state_of(ledger.devices[dev])
        assert s.foreign_bytes == 0 and s.reserved_bytes == 20 * GIB
        assert s.available_bytes == int(0.9 * 80 * GIB) - 20 * GIB


def test_a_pending_reservation_never_hides_behind_other_use(ledger):
    """An engine still starting (or level-1 weights not yet in host RAM) uses nothing yet: its booking
    counts on top of what others use, on a GPU and in host RAM alike."""
    ledger.update_node("id-a", [gpu("a", 0, used=30 * GIB), gpu("a", 1)])
    ledger.update_host(NodeSample(node_id="id-a", node_name="a", host_total_bytes=80 * GIB, host_used_bytes=30 * GIB,
                                  cpu_count=8, devices=[]))
    ledger.reserve([res("m", ["a:gpu0"], 30), Reservation(model_id="s", replica=0, devices=["a:host"],
                                                          bytes_per_device=30 * GIB, host=True)])
    budget = int(0.9 * 80 * GIB)
    assert ledger.state_of(ledger.devices["a:gpu0"]).available_bytes == budget - 60 * GIB
    assert ledger.host_available("a:host") == budget - 60 * GIB
    with pytest.raises(ReservationError, match="short by"):
        ledger.reserve([res("late", ["a:gpu0"], 13)])


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
    ledger.activate("new")
    assert ledger.expire_pending(now=time.time() + 99, ttl_s=100) == []  # not yet
    assert [r.key for r in ledger.expire_pending(now=time.time() + 101, ttl_s=100)] == ["old/r0"]
    assert list(ledger.reservations) == ["new/r0"]


def test_released_sim_engine_stops_counting_before_the_next_sample(ledger):
    ledger.update_node("id-a", [gpu("a", 0, kind=DeviceKind.SIM_GPU)])
    ledger.reserve([res("m", ["a:gpu0"], 30)])
    ledger.report_usage("m/r0", 30 * GIB)
    assert ledger.state_of(ledger.devices["a:gpu0"]).used_bytes == 30 * GIB
    ledger.release("m")  # no new sample in between
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.used_bytes == 0 and s.foreign_bytes == 0 and s.available_bytes == int(0.9 * 80 * GIB)


def asleep(ledger: Ledger, key: str, residual_gib: float) -> Reservation:
    """An engine that was up sleeps in place, keeping ``residual_gib`` per device (``ModelBook.dozed``)."""
    ledger.activate(key.split("/")[0])
    ledger.doze(key, int(residual_gib * GIB))
    return ledger.reservations[key]


def test_a_residual_inside_measured_use_counts_once(ledger):
    """A GPU where a sleeper keeps 1 GiB and something else uses 2 GiB: NVML shows 3 GiB; the sleeper's
    booking explains its 1 GiB, so the device gives budget - 3 GiB, not budget - 4 GiB."""
    ledger.reserve([res("m", ["a:gpu0"], 20)])
    asleep(ledger, "m/r0", 1)
    ledger.update_node("id-a", [gpu("a", 0, used=3 * GIB), gpu("a", 1)])
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.reserved_bytes == 1 * GIB and s.foreign_bytes == 2 * GIB and s.used_bytes == 3 * GIB
    assert s.available_bytes == int(0.9 * 80 * GIB) - 3 * GIB


def test_a_wake_in_place_books_the_rest_and_explains_only_the_residual_until_up(ledger):
    ledger.reserve([res("m", ["a:gpu0"], 20)])
    ledger.report_usage("m/r0", 19 * GIB)  # what the engine measured when it started
    asleep(ledger, "m/r0", 1)
    ledger.update_node("id-a", [gpu("a", 0, used=3 * GIB), gpu("a", 1)])  # 2 GiB foreign, as above
    budget = int(0.9 * 80 * GIB)
    ledger.reserve([res("other", ["a:gpu0"], budget / GIB - 3 - 19)])  # leaves 19 GiB: short of 20, not of 19
    ledger.activate("other")
    with pytest.raises(ReservationError, match="short by 1.00 GiB"):
        ledger.reserve([res("fresh", ["a:gpu0"], 20)])  # the whole footprint again would not fit
    ledger.reserve([res("m", ["a:gpu0"], 20)])  # its wake needs 20 - 1
    r = ledger.reservations["m/r0"]
    assert r.state is ReservationState.WAKING and r.explained_bytes == 1 * GIB and r.held_bytes == 20 * GIB
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.foreign_bytes == 2 * GIB and s.available_bytes == 0
    assert ledger.expire_pending(now=time.time() + 10**6, ttl_s=1) == []  # a wake is not a start that died
    ledger.activate("m")  # up: it holds what it measured before it slept
    assert r.state is ReservationState.ACTIVE and r.residual_bytes == 0 and r.explained_bytes == 19 * GIB


def test_a_booking_that_is_not_asleep_is_never_booked_twice(ledger):
    ledger.reserve([res("m", ["a:gpu0"], 10)])
    asleep(ledger, "m/r0", 1)
    with pytest.raises(ReservationError, match="already holds"):  # waking on other devices: not its own
        ledger.reserve([res("m", ["a:gpu1"], 10)])
    ledger.reserve([res("m", ["a:gpu0"], 10)])
    with pytest.raises(ReservationError, match="already holds"):  # awake (waking) already
        ledger.reserve([res("m", ["a:gpu0"], 10)])


def test_a_sleeping_sim_engine_shows_its_residual_as_used(ledger):
    ledger.update_node("id-a", [gpu("a", 0, kind=DeviceKind.SIM_GPU)])
    ledger.reserve([res("m", ["a:gpu0"], 10)])
    ledger.report_usage("m/r0", 9 * GIB)
    asleep(ledger, "m/r0", 0.5)
    s = ledger.state_of(ledger.devices["a:gpu0"])
    assert s.used_bytes == s.reserved_bytes == GIB // 2 and s.foreign_bytes == 0


# --- bookings never pass the budget, whatever the order of events -----------------------------
class Bookings(RuleBasedStateMachine):
    """One device (a GPU, or a node's host RAM) and the world the ledger only sees through samples and
    engines' reports: what each engine really uses, and foreign use. Every grant made within
    ``available`` keeps what the ledger handed out plus foreign use within the budget."""

    host = False
    DEV = "a:gpu0"

    def __init__(self):
        super().__init__()
        self.ledger = Ledger(budget_fraction=0.9)
        self.foreign = 0
        self.actual: dict[str, int] = {}  # reservation key -> what its engine really uses now
        self.made = 0
        self._sample()

    # what the world does, and what the ledger learns of it
    def _sample(self) -> None:
        used = self.foreign + sum(self.actual.values())
        if self.host:
            self.ledger.update_host(NodeSample(node_id="id-a", node_name="a", host_total_bytes=80 * GIB,
                                               host_used_bytes=used, cpu_count=8, devices=[]))
        else:
            self.ledger.update_node("id-a", [gpu("a", 0, used=used)])

    def _available(self) -> int:
        if self.host:
            return self.ledger.host_available(self.DEV)
        return self.ledger.state_of(self.ledger.devices[self.DEV]).available_bytes

    def _truly_free(self) -> int:
        held = sum(max(r.held_bytes, self.actual[k]) for k, r in self.ledger.reservations.items())
        return int(0.9 * 80 * GIB) - held - self.foreign

    def _pick(self, data, unmeasured: bool = False) -> Reservation | None:
        """A booking whose engine starts or runs (one asleep or waking in place changes only by its own rules)."""
        keys = sorted(k for k, r in self.ledger.reservations.items() if not r.in_place and
                      (not unmeasured or (r.measured_bytes is None and r.state is ReservationState.PENDING)))
        return self.ledger.reservations[data.draw(st.sampled_from(keys))] if keys else None

    @rule(quarter_gib=st.integers(1, 320))
    def reserve(self, quarter_gib):
        nbytes, available = quarter_gib * GIB // 4, self._available()
        r = Reservation(model_id=f"m{self.made}", replica=0, devices=[self.DEV], bytes_per_device=nbytes,
                        host=self.host)
        self.made += 1
        try:
            self.ledger.reserve([r])
        except ReservationError:
            assert nbytes > available
            return
        self.actual[r.key] = 0
        assert self._truly_free() >= 0, "a grant made within available passed the budget"

    @rule(data=st.data())
    def engine_allocates(self, data):
        """A starting engine takes part of its memory before it says anything."""
        r = self._pick(data, unmeasured=True)
        if r is not None:
            self.actual[r.key] = data.draw(st.integers(self.actual[r.key], r.bytes_per_device))

    @rule(data=st.data(), share=st.floats(0.0, 1.5))
    def measure(self, data, share):
        """An engine reports what it really uses (possibly more than it reserved)."""
        r = self._pick(data)
        if r is not None:
            self.actual[r.key] = int(share * r.bytes_per_device)
            self.ledger.report_usage(r.key, self.actual[r.key])

    @rule(data=st.data())
    def engine_up(self, data):
        """The engine is up (the weights are in host RAM): one that never measured itself uses its
        reservation; one that woke in place takes back what it measured."""
        keys = sorted(k for k, r in self.ledger.reservations.items() if r.state is not ReservationState.ASLEEP)
        if keys:
            r = self.ledger.reservations[data.draw(st.sampled_from(keys))]
            if r.measured_bytes is None:
                self.actual[r.key] = r.bytes_per_device
            elif r.state is ReservationState.WAKING:
                self.actual[r.key] = r.measured_bytes
            self.ledger.activate(r.model_id)

    @rule(data=st.data(), measured=st.booleans())
    def engine_sleeps(self, data, measured):
        """An engine that is up sleeps in place (GPU only), freeing part of what it holds: what it measured
        it keeps stays booked, at most its reservation; unmeasured, the plan's estimate (what it keeps)."""
        keys = sorted(k for k, r in self.ledger.reservations.items() if r.state is ReservationState.ACTIVE)
        if self.host or not keys:
            return
        r = self.ledger.reservations[data.draw(st.sampled_from(keys))]
        self.actual[r.key] = data.draw(st.integers(0, self.actual[r.key] if measured else min(self.actual[r.key],
                                                                                             r.bytes_per_device)))
        self.ledger.doze(r.key, min(r.bytes_per_device, self.actual[r.key]))

    @rule(data=st.data())
    def engine_wakes(self, data):
        """A sleeper wakes in place if the rest of what it held awake (its reservation, or what it measured
        if more) is available, and takes memory back."""
        keys = sorted(k for k, r in self.ledger.reservations.items() if r.state is ReservationState.ASLEEP)
        if not keys:
            return
        r = self.ledger.reservations[data.draw(st.sampled_from(keys))]
        awake = max(r.bytes_per_device, r.measured_bytes or 0)
        need, available, before = awake - r.residual_bytes, self._available(), self._truly_free()
        try:
            self.ledger.reserve([Reservation(model_id=r.model_id, replica=0, devices=[self.DEV],
                                             bytes_per_device=r.bytes_per_device)])
        except ReservationError:
            assert need > available
            return
        # (foreign use may have passed the budget already: a wake that needs nothing more is no grant)
        assert self._truly_free() >= min(0, before), "a wake granted within available passed the budget"
        self.actual[r.key] = data.draw(st.integers(self.actual[r.key], max(self.actual[r.key], awake)))

    @rule(data=st.data())
    def release(self, data):
        r = self._pick(data)
        if r is not None:
            self.ledger.release_key(r.key)
            del self.actual[r.key]

    @rule(foreign_gib=st.integers(0, 80))
    def sample(self, foreign_gib):
        self.foreign = foreign_gib * GIB
        self._sample()

    @invariant()
    def never_offers_what_is_taken(self):
        assert self._available() <= max(0, self._truly_free())


class HostBookings(Bookings):
    host = True
    DEV = "a:host"


Bookings.TestCase.settings = HostBookings.TestCase.settings = settings(max_examples=100, stateful_step_count=25,
                                                                      deadline=None)
TestGpuBookings = Bookings.TestCase
TestHostRamBookings = HostBookings.TestCase
