"""The typed lifecycle state (``ModelRecord.state``, ``records.LEGAL``): the table, the state each
transition leads to, and that records stored today read back as the state they were in."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
from pydantic import ValidationError

from hive_apps.core.devices import Device, DeviceKind, NodeSample
from hive_apps.core.planning.types import EngineSettings, MemoryBreakdown, Plan, ProfileSummary, ReplicaPlan
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.book import ModelBook, TransitionError
from hive_apps.core.state.ledger import Ledger
from hive_apps.core.state.records import (
    _RESIDENCY,
    LEGAL,
    IllegalState,
    ModelRecord,
    ModelState,
    ModelStatus,
    Origin,
    ReplicaChange,
    Reservation,
    Residency,
    SleepMode,
    dump_stored,
    load_stored,
)
from hive_apps.core.state.transitions import ADAPTER, ASKED

GIB = 2**30
S, R, W = ModelStatus, Residency, ReplicaChange
FLAGS = {residency: flags for flags, residency in _RESIDENCY.items()}  # residency -> (resident, sleep_mode, placed)


def state(phase: ModelStatus, residency: Residency = R.RESIDENT, replicas: ReplicaChange = W.NONE,
          destroy: bool = False) -> ModelState:
    return ModelState(phase=phase, residency=residency, replicas=replicas, destroy=destroy)


def replica(index: int, node: str = "a", gpu: int = 0) -> ReplicaPlan:
    return ReplicaPlan(
        index=index, node_id=f"id-{node}", node_name=node, devices=[f"{node}:gpu{gpu}"], device_kind=DeviceKind.GPU,
        device_indices=[gpu],
        settings=EngineSettings(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=2048,
                                gpu_memory_utilization=0.5, kv_cache_memory_bytes=GIB),
        memory=MemoryBreakdown(weights=4 * GIB, kv_cache=GIB, activations=1, overhead=1), reservation_bytes=8 * GIB)


def plan(*replicas: ReplicaPlan) -> Plan:
    profile = ProfileSummary(architecture="Qwen3ForCausalLM", model_type="qwen3", path="/x", runner="generate",
                             dtype="bfloat16", num_params=1, weight_bytes=1, kv_bytes_per_token=1)
    return Plan(model_id="m", model="/x", engine="sim", profile=profile, replicas=list(replicas or [replica(0)]))


def record_in(s: ModelState) -> ModelRecord:
    """A record whose status and flags stand for ``s`` (validated as a caller's record is)."""
    resident, sleep_mode, wake_placed = FLAGS[s.residency]
    return ModelRecord(
        model_id="m", spec=ModelSpec(model_id="m", model="/x", engine="sim"), plan=plan(replica(0), replica(1, "b")),
        status=s.phase, resident=resident, sleep_mode=sleep_mode, wake_placed=wake_placed,
        healing_replicas=[0] if s.replicas in (W.STARTING, W.STARTING_AND_RETIRING) else [],
        retiring=[1] if s.replicas in (W.RETIRING, W.STARTING_AND_RETIRING) else [],
        destroy_reason="idle" if s.destroy else "")


class World:
    """A book over three nodes (two GPUs of 40 GiB each); ``host_gib``: each node's host RAM."""

    def __init__(self, host_gib: int = 64):
        self.ledger = Ledger(0.9)
        self.book = ModelBook(self.ledger)
        self.now = 1000.0
        for node in ("a", "b", "c"):
            self.ledger.update_node(f"id-{node}", self.devices(node))
        self.host_ram(host_gib)

    @staticmethod
    def devices(node: str) -> list[Device]:
        return [Device(id=f"{node}:gpu{i}", node_id=f"id-{node}", node_name=node, kind=DeviceKind.GPU, index=i,
                       name="H100-80GB", total_bytes=40 * GIB) for i in range(2)]

    def host_ram(self, gib: int) -> None:
        for node in ("a", "b", "c"):
            self.ledger.update_host(NodeSample(node_id=f"id-{node}", node_name=node, host_total_bytes=gib * GIB,
                                               host_used_bytes=0, cpu_count=8, devices=self.devices(node)))

    def tick(self) -> float:
        self.now += 1
        return self.now

    @property
    def rec(self) -> ModelRecord:
        return self.book.records["m"]

    @property
    def v(self) -> int:
        return self.rec.version

    def deploy(self, *replicas: ReplicaPlan, sleeps: bool = True) -> ModelState:
        p = plan(*replicas)
        spec = ModelSpec(model_id="m", model="/x", engine="sim", sleep_timeout=60 if sleeps else None)
        self.book.create(ModelRecord(model_id="m", spec=spec, plan=p),
                         [Reservation.for_replica("m", rp) for rp in p.replicas], self.tick())
        return self.rec.state

    def up(self) -> ModelState:
        self.book.applied("m", self.v, self.rec.plan_generation, self.tick())
        self.book.started("m", self.v, self.tick())
        return self.rec.state

    def lose(self, node: str) -> ModelState:
        self.book.node_lost({f"id-{node}"}, {node}, {"a", "b", "c"} - {node})
        return self.rec.state

    def place(self, *replicas: ReplicaPlan) -> ModelState:
        p = self.rec.plan if self.rec.sleeps_in_place else plan(*replicas)
        booked = self.rec.live_replicas if self.rec.sleeps_in_place else p.replicas
        self.book.placed("m", self.v, p, [Reservation.for_replica("m", rp) for rp in booked], 0.5, [], self.tick())
        return self.rec.state


# --- the table ----------------------------------------------------------------------------------
ALL = [state(*c) for c in itertools.product(S, R, W, (False, True))]


def test_the_table_holds_only_states_the_enums_can_make():
    assert LEGAL < set(ALL) and len(LEGAL) == 57  # of 1040 (asleep warm: 10 of them)
    assert all(s.legal for s in LEGAL)


def test_a_record_is_built_only_in_a_legal_state():
    """Each of the 800 combinations of the enums has one encoding in the record's flags; a record
    built in one outside the table is refused (``check_state`` says why)."""
    wrong = []
    for s in ALL:
        try:
            rec = record_in(s)
        except ValidationError as e:
            if s in LEGAL or "is not a legal state" not in str(e):
                wrong.append(f"refused: {s}: {e}")
            continue
        if s not in LEGAL or rec.state != s or rec.check_state() != s:
            wrong.append(f"built: {s} as {rec.state}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("flags", sorted(set(itertools.product((True, False), (None, *SleepMode), (True, False)))
                                         - set(_RESIDENCY), key=str))
def test_flags_that_stand_for_no_residency_are_refused(flags):
    resident, sleep_mode, wake_placed = flags
    with pytest.raises(ValidationError, match="stand for no residency"):
        ModelRecord(model_id="m", spec=ModelSpec(model_id="m", model="/x", engine="sim"), plan=plan(),
                    status=S.WAKING, resident=resident, sleep_mode=sleep_mode, wake_placed=wake_placed)


def test_what_the_table_says():
    """The rules in words (``core/state/book.py`` says which transition makes each)."""
    serving = (S.READY, S.DEGRADED, S.HEALING, S.SCALING)
    assert {s.residency for s in LEGAL if s.phase in (*serving, S.DEPLOYING, S.FAILED)} == {R.RESIDENT}
    assert not [s for s in LEGAL if s.phase in (S.HEALING, S.SCALING) and s.replicas in (W.NONE, W.RETIRING)], \
        "healing or scaling with nothing starting"
    assert not [s for s in LEGAL if s.phase not in (S.HEALING, S.SCALING, S.DELETING) and
                s.replicas in (W.STARTING, W.STARTING_AND_RETIRING)]
    assert state(S.SCALING, replicas=W.STARTING_AND_RETIRING) not in LEGAL  # scale_up waits for a retire to end
    assert {s.residency for s in LEGAL if s.phase is S.SLEEPING} == {
        R.RESIDENT, R.DOZING_LEVEL1, R.DOZING_LEVEL2, R.ASLEEP_LEVEL1, R.ASLEEP_LEVEL2, R.DOZING_WARM, R.ASLEEP_WARM,
        R.PARKED}
    assert {s.residency for s in LEGAL if s.phase is S.WAKING} == set(R) - {R.NONE}
    assert {s.replicas for s in LEGAL if s.phase in (S.SLEEPING, S.WAKING)} == {W.NONE}
    assert {s for s in LEGAL if s.phase is S.DESTROYED} == {state(S.DESTROYED, R.NONE, W.NONE, True),
                                                           state(S.DESTROYED, R.NONE, W.RETIRING, True)}
    assert {s.phase for s in LEGAL if s.destroy} == {S.DELETING, S.DESTROYED}
    assert {s.residency for s in LEGAL if s.phase is S.DELETING and s.destroy} == {
        R.RESIDENT, R.DOZING_LEVEL1, R.DOZING_LEVEL2, R.ASLEEP_LEVEL1, R.ASLEEP_LEVEL2, R.DOZING_WARM, R.ASLEEP_WARM,
        R.PARKED}
    assert {s.residency for s in LEGAL if s.phase is S.DELETING} == set(R)  # delete wins over anything


# --- each transition leads to a legal state ----------------------------------------------------
def test_deploy_serve_scale_heal_and_end():
    w = World()
    assert w.deploy(replica(0), replica(1, "b")) == state(S.DEPLOYING)
    assert w.up() == state(S.READY)
    w.book.scale_up("m", w.v, replica(2, "a", 1), w.tick())
    assert w.rec.state == state(S.SCALING, replicas=W.STARTING)
    w.book.scale_failed("m", w.v, "no")
    assert w.rec.state == state(S.READY)
    w.book.retire("m", w.v, 1)
    assert w.rec.state == state(S.READY, replicas=W.RETIRING)
    assert w.lose("a") == state(S.DEGRADED, replicas=W.RETIRING)
    w.book.heal("m", w.v, [replica(0, "c")], w.tick())
    assert w.rec.state == state(S.HEALING, replicas=W.STARTING_AND_RETIRING)
    w.book.heal_failed("m", w.v, "no", w.tick(), 60.0)
    assert w.rec.state == state(S.DEGRADED, replicas=W.RETIRING)
    w.book.heal("m", w.v, [replica(0, "c")], w.tick())
    assert w.up() == state(S.READY, replicas=W.RETIRING)
    w.book.retired("m", w.v)
    assert w.rec.state == state(S.READY)
    w.book.destroy("m", w.v, "idle for 10 min")
    assert w.rec.state == state(S.DELETING, destroy=True)
    w.book.deleted("m", w.v)
    assert w.rec.state == state(S.DESTROYED, R.NONE, destroy=True)
    w.book.delete("m")
    assert w.rec.state == state(S.DELETING, R.NONE)
    w.book.deleted("m", w.v)
    assert "m" not in w.book.records


def test_a_failed_deploy_and_a_deploy_again():
    w = World()
    w.deploy()
    w.book.fail("m", w.v, "boom")
    assert w.rec.state == state(S.FAILED)
    assert w.deploy() == state(S.DEPLOYING)


@pytest.mark.parametrize(("host_gib", "warm", "dozing", "asleep", "placed"), [
    (64, False, R.DOZING_LEVEL1, R.ASLEEP_LEVEL1, R.PLACED_LEVEL1),
    (1, False, R.DOZING_LEVEL2, R.ASLEEP_LEVEL2, R.PLACED_LEVEL2),  # no host RAM for the weights: level 2
    (64, True, R.DOZING_WARM, R.ASLEEP_WARM, R.PLACED_WARM),  # no sleep mode: vLLM stops, the process stays
])
def test_sleep_in_place_and_wake(host_gib, warm, dozing, asleep, placed):
    w = World(host_gib)
    w.deploy()
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    assert w.rec.state == state(S.SLEEPING)
    w.book.doze("m", w.v, warm=warm)
    assert w.rec.state == state(S.SLEEPING, dozing)
    w.book.dozed("m", w.v, w.tick())
    assert w.rec.state == state(S.SLEEPING, asleep)
    w.book.wake("m", w.tick())
    assert w.rec.state == state(S.WAKING, asleep)
    assert w.place() == state(S.WAKING, placed)
    w.book.wake_failed("m", w.v, "no", w.tick())
    assert w.rec.state == state(S.SLEEPING, asleep)  # its engines still sleep in place
    w.book.wake("m", w.tick())
    w.place()
    assert w.up() == state(S.READY)
    assert w.rec.last_wake is not None and w.rec.last_wake.how.value == placed.value.removeprefix("placed_")


def test_woken_before_it_slept():
    w = World()
    w.deploy()
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.doze("m", w.v)
    w.book.wake("m", w.tick())
    assert w.rec.state == state(S.WAKING, R.DOZING_LEVEL1)
    assert w.up() == state(S.READY)
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.wake("m", w.tick())
    assert w.rec.state == state(S.WAKING)
    w.book.wake_failed("m", w.v, "no", w.tick())
    assert w.rec.state == state(S.SLEEPING, R.PARKED)


def test_park_and_wake_elsewhere():
    w = World()
    w.deploy()
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.parked("m", w.tick())
    assert w.rec.state == state(S.SLEEPING, R.PARKED)
    w.book.wake("m", w.tick())
    assert w.rec.state == state(S.WAKING, R.PARKED)
    assert w.place(replica(0, "b", 1)) == state(S.WAKING, R.PLACED)
    w.book.delete("m")
    assert w.rec.state == state(S.DELETING, R.PLACED)


def test_a_warm_sleeper_cools_into_parked_and_a_wake_ends_the_cooling():
    w = World()
    w.deploy()
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.doze("m", w.v, warm=True)
    with pytest.raises(TransitionError):
        w.book.cool("m", w.v, "room")  # still resident (dozing): its process is not kept yet
    w.book.dozed("m", w.v, w.tick())
    w.book.cool("m", w.v, "making room for n")
    assert w.rec.state == state(S.SLEEPING, R.ASLEEP_WARM) and w.rec.releasing
    w.book.wake("m", w.tick())
    assert w.rec.state == state(S.WAKING, R.ASLEEP_WARM) and not w.rec.cooling
    w.book.wake_failed("m", w.v, "no", w.tick())
    w.book.cool("m", w.v, "making room for n")
    w.book.parked("m", w.tick())
    assert w.rec.state == state(S.SLEEPING, R.PARKED) and not w.rec.cooling and not w.rec.releasing
    assert w.book.ledger.of_model("m") == []


def test_destroy_a_sleeper():
    w = World()
    w.deploy()
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.doze("m", w.v)
    w.book.dozed("m", w.v, w.tick())
    w.book.destroy("m", w.v, "idle for a day")
    assert w.rec.state == state(S.DELETING, R.ASLEEP_LEVEL1, destroy=True)
    w.book.deleted("m", w.v)
    assert w.rec.state == state(S.DESTROYED, R.NONE, destroy=True)
    assert not w.ledger.reservations


def test_a_retiring_replica_is_not_healed():
    """The bug the table found: a lost replica that was retiring could be healed; losing its
    replacement left the model healing with nothing starting (and it would have served a replica
    it meant to remove). ``heal`` now refuses it, as the admin never asks (``retired`` drops it)."""
    w = World()
    w.deploy(replica(0), replica(1, "b"))
    w.up()
    w.book.retire("m", w.v, 1)
    assert w.lose("b") == state(S.READY, replicas=W.RETIRING)  # the retiring one: nothing to heal
    assert w.lose("a") == state(S.DEGRADED, replicas=W.RETIRING)
    before = w.rec.model_dump()
    with pytest.raises(TransitionError, match="retires"):
        w.book.heal("m", w.v, [replica(1, "c")], w.tick())
    assert w.rec.model_dump() == before
    w.book.retired("m", w.v)
    assert w.rec.state == state(S.DEGRADED)


def test_no_transition_stores_an_illegal_state():
    """``ModelBook._commit`` checks the state: a transition that broke it raises, and the book keeps
    the record it had."""
    w = World()
    w.deploy()
    w.rec.sleep_mode = SleepMode.PARKED  # as a broken transition would leave it
    with pytest.raises(IllegalState):
        w.book.note("m", w.v, "hello")
    assert w.rec.message != "hello"


# every step the admin, the gateway or the registry may take, with the arguments it would pass
def _heal(w: World, last: bool = False) -> None:
    """A replacement on node c for the first (or the last) lost replica."""
    lost = sorted(int(label[1:]) for label in w.rec.lost_replicas)
    w.book.heal("m", w.v, [replica(i, "c", i % 2) for i in (lost[-1:] if last else lost[:1])], w.tick())


def _doze_level2(w: World) -> None:
    w.host_ram(1)
    try:
        w.book.doze("m", w.v)
    finally:
        w.host_ram(64)


def _started(w: World) -> None:
    """Built (``applied``, which changes no state: the search would not keep it) and started."""
    if w.rec.applied_generation != w.rec.plan_generation:
        w.book.applied("m", w.v, w.rec.plan_generation, w.tick())
    w.book.started("m", w.v, w.tick())


STEPS = {
    "deploy": lambda w: w.deploy(replica(0), replica(1, "b")),
    "applied": lambda w: w.book.applied("m", w.v, w.rec.plan_generation, w.tick()),
    "started": _started,
    "fail": lambda w: w.book.fail("m", w.v, "boom"),
    "heal": _heal,
    "heal the last lost": lambda w: _heal(w, last=True),
    "heal_failed": lambda w: w.book.heal_failed("m", w.v, "no", w.tick(), 60.0),
    "note": lambda w: w.book.note("m", w.v, "hello"),
    "delete": lambda w: w.book.delete("m"),
    "deleted": lambda w: w.book.deleted("m", w.v),
    "sleep": lambda w: w.book.sleep("m", w.v, "idle", w.tick()),
    "doze": lambda w: w.book.doze("m", w.v),
    "doze, no host RAM to spare": _doze_level2,
    "doze, warm": lambda w: w.book.doze("m", w.v, warm=True),
    "dozed": lambda w: w.book.dozed("m", w.v, w.tick()),
    "cool": lambda w: w.book.cool("m", w.v, "room"),
    "parked": lambda w: w.book.parked("m", w.tick()),
    "wake": lambda w: w.book.wake("m", w.tick()),
    "placed": lambda w: w.place(replica(0, "c"), replica(1, "c", 1)),
    "wake_failed": lambda w: w.book.wake_failed("m", w.v, "no", w.tick()),
    "destroy": lambda w: w.book.destroy("m", w.v, "idle"),
    "scale_up": lambda w: w.book.scale_up("m", w.v, replica(2, "c", 1), w.tick()),
    "scale_failed": lambda w: w.book.scale_failed("m", w.v, "no"),
    "retire": lambda w: w.book.retire("m", w.v, 1),
    "retired": lambda w: w.book.retired("m", w.v),
    "respec": lambda w: w.book.respec("m", w.v, w.rec.spec.model_copy(update={"priority": 5}), Origin.DECLARED),
    **{f"node {n} dies": (lambda w, n=n: w.lose(n)) for n in ("a", "b", "c")},
}


def test_the_steps_are_every_transition():
    asked = {s.split(",")[0] for s in STEPS if not s.startswith(("node", "heal the"))} - {"deploy"} | {"create"}
    assert asked == ASKED - ADAPTER  # adapters' transitions change no model's state (test_lora_state.py)


def _shape(w: World) -> tuple[object, ...] | None:
    """What of a book the search tells apart: the state, and which replicas are planned, lost,
    starting and retiring (a state alone would merge books whose next steps differ)."""
    if "m" not in w.book.records:
        return None
    rec = w.rec
    return (rec.state, tuple(rp.index for rp in rec.plan.replicas), tuple(sorted(rec.lost_replicas)),
            tuple(rec.healing_replicas), tuple(rec.retiring), rec.applied_generation == rec.plan_generation)


def reach() -> dict[ModelState | None, list[str]]:
    """Every state the steps reach from a fresh deploy, and the shortest steps to it."""
    w = World()
    w.deploy(replica(0), replica(1, "b"))
    paths: dict[ModelState | None, list[str]] = {w.rec.state: ["deploy"]}
    seen, queue = {_shape(w)}, [(w, ["deploy"])]
    while queue:
        w, path = queue.pop(0)
        nxt = copy.deepcopy(w)
        for name, step in STEPS.items():
            try:
                step(nxt)
            except TransitionError:  # it changed nothing (the fuzz checks so): try the next step on it
                continue
            except IllegalState as e:
                pytest.fail(f"{' -> '.join([*path, name])}: {e}")
            shape = _shape(nxt)
            if shape == _shape(w):  # as it was (a note, an idempotent repeat): go on from it
                continue
            paths.setdefault(None if shape is None else shape[0], [*path, name])
            if shape is not None and shape not in seen:  # removed: a deploy again starts as the first did
                seen.add(shape)
                queue.append((nxt, [*path, name]))
            nxt = copy.deepcopy(w)
    return paths


def test_the_transitions_reach_every_legal_state_and_no_other():
    """What the steps reach is exactly ``LEGAL`` (a step that leaves an illegal state fails with the
    steps to it)."""
    paths = reach()
    reached = {s for s in paths if s is not None}
    assert reached == LEGAL, "\n".join(
        [f"reached, not legal: {s} by {paths[s]}" for s in reached - LEGAL] +
        [f"legal, never reached: {s}" for s in LEGAL - reached])


# --- records stored today ----------------------------------------------------------------------
def stored_states() -> list[tuple[bytes, ModelState]]:
    """Values as the registry stores them (``dump_stored``), made by the transitions, and the state
    each is in."""
    out = []

    def keep(w: World, expected: ModelState) -> None:
        out.append((dump_stored(w.rec, w.ledger.of_model("m")), expected))

    w = World()
    w.deploy(replica(0), replica(1, "b"))
    keep(w, state(S.DEPLOYING))
    w.up()
    w.book.retire("m", w.v, 1)
    keep(w, state(S.READY, replicas=W.RETIRING))
    w.book.retired("m", w.v)
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.doze("m", w.v)
    keep(w, state(S.SLEEPING, R.DOZING_LEVEL1))
    w.book.dozed("m", w.v, w.tick())
    keep(w, state(S.SLEEPING, R.ASLEEP_LEVEL1))
    w.book.wake("m", w.tick())
    w.place()
    keep(w, state(S.WAKING, R.PLACED_LEVEL1))
    w.book.parked("m", w.tick())
    keep(w, state(S.WAKING, R.PARKED))
    w.book.wake_failed("m", w.v, "no", w.tick())
    w.book.destroy("m", w.v, "idle")
    keep(w, state(S.DELETING, R.PARKED, destroy=True))
    w.book.deleted("m", w.v)
    keep(w, state(S.DESTROYED, R.NONE, destroy=True))
    return out


@pytest.mark.parametrize("i", range(len(stored_states())))
def test_records_stored_today_read_back_in_their_state(i):
    raw, expected = stored_states()[i]
    body = json.loads(raw)
    assert "state" not in body  # the stored format is unchanged: the state is read from the flags
    assert load_stored(raw).record.state == expected == ModelRecord.from_stored(raw).state


def test_a_stored_value_of_today_as_written():
    """A level-1 sleeper's value as this version writes it, field for field."""
    w = World()
    w.deploy()
    w.up()
    w.book.sleep("m", w.v, "idle", w.tick())
    w.book.doze("m", w.v)
    w.book.dozed("m", w.v, w.tick())
    body = json.loads(dump_stored(w.rec, w.ledger.of_model("m")))
    assert {k: body[k] for k in ("status", "resident", "sleep_mode", "wake_placed", "retiring", "healing_replicas",
                                 "destroy_reason")} == {
        "status": "sleeping", "resident": False, "sleep_mode": "level1", "wake_placed": False, "retiring": [],
        "healing_replicas": [], "destroy_reason": ""}
    assert set(body) == set(ModelRecord.model_fields) - {"policy_warning"} | {"reservations"}
    assert ModelRecord.from_stored(json.dumps(body).encode()).state == state(S.SLEEPING, R.ASLEEP_LEVEL1)


def test_a_stored_record_in_an_illegal_state_still_loads():
    """Quarantining it would lose a running model over a flag: it loads as stored, and says why no
    transition may store it again."""
    w = World()
    w.deploy()
    w.up()
    body = json.loads(dump_stored(w.rec, w.ledger.of_model("m")))
    body["healing_replicas"] = [0]  # ready, yet starting: no transition writes this
    rec = load_stored(json.dumps(body).encode()).record
    assert rec.state == state(S.READY, replicas=W.STARTING) and not rec.state.legal
    with pytest.raises(IllegalState, match="not a legal state"):
        rec.check_state()
