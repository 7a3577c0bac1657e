"""A property-based fuzz of the registry's transition table (``hive_apps/core/state/book.py``).

Random sequences of every transition the table lists, with stale versions, node losses (and nodes
re-joining under their name) and registry restarts, against a small cluster. After every step:

* no reservation without a record that books it (``ModelRecord.books``: what ``release_unbooked``
  would keep), so a restart frees nothing;
* every record that holds memory has a reservation for each live replica, on that replica's
  devices (and a level-1 sleeper one in host RAM for each);
* bookings never pass a device's (or a host's) budget;
* every record is in a legal state (``ModelRecord.state`` in ``records.LEGAL``; ``ModelBook._commit``
  also refuses to store another, which fails the step as a bug);
* a record's version never goes down, goes up whenever the record changes (restarts included),
  and the book's version never goes down;
* a refused transition (``TransitionError``) changes nothing; a stale version is always refused;
  anything else raised is a bug;
* what was persisted (each ``Change`` applied to a KV "store" the way ``Registry._persist`` does:
  one value per model, its record with its reservations) is exactly the book and its ledger, and a
  registry restarted from it (``ModelBook.restore``, as ``Registry.__init__``) holds the same records
  and reservations, also from a store in the older layout (reservations under keys of their own).
"""

from __future__ import annotations

from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hive_apps.core import names
from hive_apps.core.devices import Device, DeviceKind, NodeSample
from hive_apps.core.planning.types import (
    EngineSettings,
    MemoryBreakdown,
    Plan,
    ProfileSummary,
    ReplicaPlan,
)
from hive_apps.core.spec import ModelSpec, Routing
from hive_apps.core.state.book import Change, ModelBook, TransitionError
from hive_apps.core.state.ledger import Ledger
from hive_apps.core.state.records import (
    DORMANT,
    ENDED,
    LEGAL,
    STARTING,
    ModelRecord,
    ModelStatus,
    Origin,
    Reservation,
    ReservationState,
    SleepMode,
    dump_stored,
    load_stored,
)
from hive_apps.core.state.transitions import ADAPTER, ASKED

GIB = 2**30
BUDGET = 0.9
GPU_TOTAL = 40 * GIB
HOST_TOTAL = {"a": 48 * GIB, "b": 48 * GIB, "c": 6 * GIB}  # node c's sleepers often doze at level 2
NODES = ("a", "b", "c")
GPUS_PER_NODE = 2
MODELS = ("m0", "m1", "m2")
MODEL_KEY, RESERVATION_KEY = "model/", "reservation/"  # as hive_apps/control/registry/deployment.py

# now and then (about one draw in ten: Hypothesis favours the ends of a range, so not 0 or 11)
rarely_st = st.integers(0, 11).map(lambda n: n == 3)
stale_st = rarely_st  # a stale version, which must be refused
text_st = st.sampled_from(["idle", "evicted", "boom", ""])

# where each transition starts (the table in control.py), to steer the fuzz to the ones that can go
S = ModelStatus
STARTS = {
    "create": ENDED, "applied": STARTING, "started": STARTING, "fail": (S.DEPLOYING,), "heal": (S.DEGRADED,),
    "heal_failed": (S.HEALING,), "note": tuple(S), "delete": tuple(S), "deleted": (S.DELETING,),
    "sleep": (S.READY, S.DEGRADED), "doze": (S.SLEEPING,), "dozed": (S.SLEEPING,), "cool": (S.SLEEPING,), "parked": DORMANT,
    "wake": (S.SLEEPING,), "placed": (S.WAKING,), "wake_failed": (S.WAKING,),
    "destroy": (S.READY, S.DEGRADED, S.SLEEPING), "scale_up": (S.READY,), "scale_failed": (S.SCALING,),
    "retire": (S.READY,), "retired": (S.READY, S.DEGRADED),
    "respec": tuple(s for s in S if s not in ENDED and s is not S.DELETING),
}


def test_the_fuzz_steers_every_transition_of_the_table():
    assert set(STARTS) == ASKED - ADAPTER  # the table: hive_apps/core/state/transitions.py (adapters: test_lora_state.py)


def profile() -> ProfileSummary:
    return ProfileSummary(architecture="Qwen3ForCausalLM", model_type="qwen3", path="/x", runner="generate",
                          dtype="bfloat16", num_params=1, weight_bytes=1, kv_bytes_per_token=1)


class Transitions(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.now = 1000.0
        self.node_ids = {n: f"id-{n}-0" for n in NODES}  # each node's current Ray node id
        self.alive = {n: True for n in NODES}
        self.dead_ids: set[str] = set()
        self.store: dict[str, str] = {}  # the KV: key -> JSON
        self.ledger = Ledger(BUDGET)
        self._sample_nodes(self.ledger)
        self.book = ModelBook(self.ledger)
        self.seen: dict[str, dict] = {}  # model id -> its record as last seen (a dump)
        self.floor: dict[str, int] = {}  # model id -> the last version of its removed record
        self.book_version = self.book.version

    # --- the world ----------------------------------------------------------------------------
    def _devices(self, node: str) -> list[Device]:
        return [Device(id=f"{node}:gpu{i}", node_id=self.node_ids[node], node_name=node, kind=DeviceKind.GPU,
                       index=i, name="H100-80GB", total_bytes=GPU_TOTAL) for i in range(GPUS_PER_NODE)]

    def _sample_nodes(self, ledger: Ledger) -> None:
        """What a monitor sample tells the ledger: the alive nodes' devices and host RAM."""
        ledger.drop_nodes_except({self.node_ids[n] for n in NODES if self.alive[n]})
        for n in NODES:
            if self.alive[n]:
                ledger.update_node(self.node_ids[n], self._devices(n))
                ledger.update_host(NodeSample(node_id=self.node_ids[n], node_name=n, host_total_bytes=HOST_TOTAL[n],
                                              host_used_bytes=0, cpu_count=8, devices=self._devices(n)))

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def _replica(self, data, index: int) -> ReplicaPlan:
        """One replica where a planner might put it: one GPU or both of a node (mostly an alive one)."""
        alive = [n for n in NODES if self.alive[n]]
        node = data.draw(st.sampled_from(list(NODES) if not alive or data.draw(rarely_st) else alive))
        gpus = data.draw(st.sampled_from([[0], [1], [0, 1]]))
        gib = data.draw(st.integers(2, 24))
        weights = data.draw(st.integers(1, gib - 1)) * GIB
        return ReplicaPlan(
            index=index, node_id=self.node_ids[node], node_name=node, devices=[f"{node}:gpu{i}" for i in gpus],
            device_kind=DeviceKind.GPU, device_indices=gpus,
            settings=EngineSettings(tensor_parallel_size=len(gpus), max_model_len=512, max_num_seqs=4,
                                    max_num_batched_tokens=2048, gpu_memory_utilization=0.5,
                                    kv_cache_memory_bytes=GIB),
            memory=MemoryBreakdown(weights=weights, kv_cache=gib * GIB - weights - 2, activations=1, overhead=1),
            reservation_bytes=gib * GIB)

    def _plan(self, data, model_id: str) -> Plan:
        n = data.draw(st.integers(1, 3))
        return Plan(model_id=model_id, model="/x", engine="sim", profile=profile(),
                    replicas=[self._replica(data, i) for i in range(n)])

    def _version(self, model_id: str, stale: bool) -> int:
        rec = self.book.records.get(model_id)
        version = rec.version if rec is not None else 0
        return version + (1 if version == 0 else -1) if stale else version

    # --- persistence, as Registry._persist ----------------------------------------------------------
    def _persist(self, changes: list[Change]) -> None:
        """One KV write per changed model: its record with the reservations it holds."""
        for c in changes:
            if c.record is not None:
                self.store[MODEL_KEY + c.model_id] = dump_stored(c.record, c.reservations).decode()
            elif c.model_id not in self.book.records:
                self.store.pop(MODEL_KEY + c.model_id, None)

    def _rewrite(self, model_id: str) -> None:
        """As Registry._rewrite: the model stored again with its reservations as they are now."""
        self.store[MODEL_KEY + model_id] = dump_stored(self.book.records[model_id],
                                                      self.ledger.of_model(model_id)).decode()

    def _snapshot(self) -> tuple:
        return (self.book.version, {k: r.model_dump() for k, r in self.book.records.items()},
                {k: r.model_dump() for k, r in self.ledger.reservations.items()})

    def _do(self, call, stale: bool = False) -> list[Change] | None:
        """Run one transition: refused, it must change nothing; a stale version must be refused."""
        before, name = self._snapshot(), call.__qualname__.split(".")[1].removeprefix("t_")
        try:
            out = call()
        except TransitionError as e:
            note(f"{name}: refused: {e.message}")
            assert self._snapshot() == before, "a refused transition changed the book or the ledger"
            return None
        assert not stale, "a transition from a stale version was accepted"
        changes = out if isinstance(out, list) else [out]
        for c in changes:
            rec = c.record
            note(f"{name} {c.model_id}: " + ("removed" if rec is None else
                 f"v{rec.version} {rec.status.value} resident={rec.resident} sleep={rec.sleep_mode and rec.sleep_mode.value} "
                 f"plan={[(rp.index, rp.devices) for rp in rec.plan.replicas]} lost={sorted(rec.lost_replicas)}")
                 + f" ={[r.key for r in c.reservations]} -{c.forgotten}")
        for c in changes:
            now = self.book.records.get(c.model_id)
            assert (c.record.model_dump() if c.record else None) == (now.model_dump() if now else None), \
                f"the change of {c.model_id} is not the record the book holds"
        self._persist(changes)
        for c in changes:
            if c.record is None:  # removed: a new deploy under its id starts past every version it had
                gone = self.seen.pop(c.model_id, None)
                if gone is not None:
                    self.floor[c.model_id] = gone["version"]
        self._check_versions()
        return changes

    def _check_versions(self) -> None:
        assert self.book.version >= self.book_version, "the book's version went down"
        self.book_version = self.book.version
        for model_id, rec in self.book.records.items():
            now, seen = rec.model_dump(), self.seen.get(model_id)
            if seen is None:
                assert rec.version > self.floor.get(model_id, 0), f"{model_id}: a new record reuses an old version"
            else:
                assert rec.version >= seen["version"], f"{model_id}: version went down"
                assert now == seen or rec.version > seen["version"], f"{model_id} changed without a new version"
            self.seen[model_id] = now
        assert set(self.seen) == set(self.book.records), "a record went without a change that removed it"

    # --- the admin's transitions: each draws what the admin would pass -----------------------------
    def t_create(self, model_id, data):
        self._create(model_id, data.draw(st.booleans()), data)

    def _create(self, model_id: str, sleeps: bool, data) -> None:
        plan = self._plan(data, model_id)
        spec = ModelSpec(model_id=model_id, model="/x", engine="sim", sleep_timeout=60 if sleeps else None)
        record = ModelRecord(model_id=model_id, spec=spec, plan=plan)
        reservations = [Reservation.for_replica(model_id, rp) for rp in plan.replicas]
        self._do(lambda: self.book.create(record, reservations, self._tick()))

    def t_applied(self, model_id, data):
        stale, rec = data.draw(stale_st), self.book.records.get(model_id)
        generation = (rec.plan_generation if rec else 1) + data.draw(rarely_st)
        self._do(lambda: self.book.applied(model_id, self._version(model_id, stale), generation, self._tick()), stale)

    def t_started(self, model_id, data):
        stale = data.draw(stale_st)
        self._do(lambda: self.book.started(model_id, self._version(model_id, stale), self._tick(),
                                           engine_start_s={"r0": 1.5}, warm_up_s={"r0": 0.2}, wake_s={"r0": 0.5}),
                 stale)

    def t_fail(self, model_id, data):
        stale, reason = data.draw(stale_st), data.draw(text_st)
        self._do(lambda: self.book.fail(model_id, self._version(model_id, stale), reason), stale)

    def t_heal(self, model_id, data):
        """Replacements for (some of) its lost replicas, and now and then for one that is not lost."""
        stale, rec = data.draw(stale_st), self.book.records.get(model_id)
        lost = sorted(names.replica_index(k) for k in rec.lost_replicas) if rec else []
        indices = data.draw(st.lists(st.sampled_from(lost), min_size=1, unique=True)) if lost else []
        if data.draw(rarely_st):
            indices.append(data.draw(st.integers(0, 4)))
        replacements = [self._replica(data, i) for i in sorted(set(indices))]
        self._do(lambda: self.book.heal(model_id, self._version(model_id, stale), replacements, self._tick()), stale)

    def t_heal_failed(self, model_id, data):
        stale, reason = data.draw(stale_st), data.draw(text_st)
        self._do(lambda: self.book.heal_failed(model_id, self._version(model_id, stale), reason, self._tick(), 60.0),
                 stale)

    def t_note(self, model_id, data):
        stale, message, backoff = data.draw(stale_st), data.draw(text_st), data.draw(st.booleans())
        self._do(lambda: self.book.note(model_id, self._version(model_id, stale), message,
                                        next_heal_at=self.now + 30 if backoff else None), stale)

    def t_delete(self, model_id, data):
        self._do(lambda: self.book.delete(model_id))

    def t_deleted(self, model_id, data):
        stale = data.draw(stale_st)
        self._do(lambda: self.book.deleted(model_id, self._version(model_id, stale)), stale)

    def t_sleep(self, model_id, data):
        stale, reason, last = data.draw(stale_st), data.draw(text_st), data.draw(st.booleans())
        self._do(lambda: self.book.sleep(model_id, self._version(model_id, stale), reason or "idle", self._tick(),
                                         last_request_at=self.now - 5 if last else None), stale)

    def t_doze(self, model_id, data):
        stale, warm = data.draw(stale_st), data.draw(st.booleans())
        self._do(lambda: self.book.doze(model_id, self._version(model_id, stale), warm=warm), stale)

    def t_cool(self, model_id, data):
        stale = data.draw(stale_st)
        self._do(lambda: self.book.cool(model_id, self._version(model_id, stale), "making room"), stale)

    def t_dozed(self, model_id, data):
        stale = data.draw(stale_st)
        self._do(lambda: self.book.dozed(model_id, self._version(model_id, stale), self._tick()), stale)

    def t_parked(self, model_id, data):
        self._do(lambda: self.book.parked(model_id, self._tick()))

    def t_wake(self, model_id, data):
        self._do(lambda: self.book.wake(model_id, self._tick()))

    def t_placed(self, model_id, data):
        """As the admin asks: where it sleeps (its own plan) or a new plan; a reservation per replica."""
        stale, rec = data.draw(stale_st), self.book.records.get(model_id)
        in_place = rec is not None and rec.sleeps_in_place != data.draw(rarely_st)
        plan = rec.plan.model_copy(deep=True) if in_place else self._plan(data, model_id)
        reservations = [Reservation.for_replica(model_id, rp) for rp in plan.replicas]
        self._do(lambda: self.book.placed(model_id, self._version(model_id, stale), plan, reservations,
                                          placement_s=0.5, evicted=[], now=self._tick()), stale)

    def t_wake_failed(self, model_id, data):
        stale, reason = data.draw(stale_st), data.draw(text_st)
        self._do(lambda: self.book.wake_failed(model_id, self._version(model_id, stale), reason, self._tick()), stale)

    def t_destroy(self, model_id, data):
        stale, reason = data.draw(stale_st), data.draw(text_st)
        self._do(lambda: self.book.destroy(model_id, self._version(model_id, stale), reason or "idle"), stale)

    def t_scale_up(self, model_id, data):
        """One more replica, numbered as the admin numbers it (now and then one it already has)."""
        stale, rec = data.draw(stale_st), self.book.records.get(model_id)
        indices = [rp.index for rp in rec.plan.replicas] if rec else [0]
        index = indices[0] if data.draw(rarely_st) else max(indices) + 1
        replica = self._replica(data, index)
        self._do(lambda: self.book.scale_up(model_id, self._version(model_id, stale), replica, self._tick()), stale)

    def t_scale_failed(self, model_id, data):
        stale, reason = data.draw(stale_st), data.draw(text_st)
        self._do(lambda: self.book.scale_failed(model_id, self._version(model_id, stale), reason), stale)

    def t_retire(self, model_id, data):
        stale, rec = data.draw(stale_st), self.book.records.get(model_id)
        choices = [rp.index for rp in rec.plan.replicas] if rec else []
        index = data.draw(st.integers(0, 4) if not choices or data.draw(rarely_st) else st.sampled_from(choices))
        self._do(lambda: self.book.retire(model_id, self._version(model_id, stale), index), stale)

    def t_retired(self, model_id, data):
        stale = data.draw(stale_st)
        self._do(lambda: self.book.retired(model_id, self._version(model_id, stale)), stale)

    def t_respec(self, model_id, data):
        """Settings that change in place, now and then one that needs new engines (refused)."""
        stale, rec = data.draw(stale_st), self.book.records.get(model_id)
        spec = rec.spec if rec else ModelSpec(model_id=model_id, model="/x", engine="sim")
        update = {"priority": data.draw(st.integers(-5, 5))} if spec.sleep_timeout else {"routing": Routing.LEAST_LOADED}
        if data.draw(rarely_st):
            update["max_input_prompt_length"] = spec.max_input_prompt_length + 1
        origin = data.draw(st.sampled_from(list(Origin)))
        self._do(lambda: self.book.respec(model_id, self._version(model_id, stale), spec.model_copy(update=update),
                                          origin), stale)

    def _run(self, name: str, data) -> None:
        """A transition, mostly on a model whose status it may start from (else it must be refused)."""
        fits = [m for m in MODELS if (self.book.records[m].status in STARTS[name] if m in self.book.records
                                      else name == "create")]
        model_id = data.draw(st.sampled_from(MODELS if not fits or data.draw(rarely_st) else fits))
        getattr(self, "t_" + name)(model_id, data)

    @initialize(data=st.data())
    def deploy_some(self, data):
        """Each model deployed, most of them up (through the same transitions)."""
        for model_id in MODELS:
            self.t_create(model_id, data)
            if model_id in self.book.records and not data.draw(rarely_st):
                self._do(lambda m=model_id: self.book.applied(m, self.book.records[m].version, 1, self._tick()))
                self._do(lambda m=model_id: self.book.started(m, self.book.records[m].version, self._tick()))

    @staticmethod
    def _next(rec: ModelRecord | None) -> list[str]:
        """What the admin would most likely ask next for a model (repeated: likelier), and some of
        what it might ask instead."""
        if rec is None or rec.status in ENDED:
            return ["create"]
        if rec.status in STARTING:
            if rec.status is S.WAKING and not rec.resident:
                return ["placed"] * 4 + ["wake_failed", "parked"]
            step = "applied" if rec.applied_generation != rec.plan_generation else "started"
            failed = {S.DEPLOYING: "fail", S.HEALING: "heal_failed", S.SCALING: "scale_failed",
                      S.WAKING: "wake_failed"}[rec.status]
            return [step] * 6 + [failed, "note"]
        if rec.status is S.SLEEPING:
            if rec.resident:
                return ["doze"] * 3 + ["parked", "wake"] if rec.sleep_mode is None else ["dozed"] * 3 + ["wake"]
            return ["wake"] * 3 + ["destroy", "parked", "cool"]
        if rec.status is S.DELETING:
            return ["deleted"]
        serving = ["sleep", "sleep", "scale_up", "retire", "retired", "destroy", "note"]
        return serving + ["heal"] * 3 if rec.status is S.DEGRADED else serving

    @rule(model_id=st.sampled_from(MODELS), steps=st.integers(1, 8), data=st.data())
    def admin_steps(self, model_id, steps, data):
        """What the admin would do next for a model, a few steps in a row; now and then a node dies (or
        comes back as a new Ray node) in between."""
        for _ in range(steps):
            getattr(self, "t_" + data.draw(st.sampled_from(self._next(self.book.records.get(model_id)))))(model_id, data)
            if data.draw(rarely_st):
                node = data.draw(st.sampled_from(NODES))
                note(f"node {node} " + ("dies" if self.alive[node] else "stays dead"))
                self.node_lost(node)
            elif data.draw(rarely_st):
                node = data.draw(st.sampled_from(NODES))
                note(f"node {node} comes back as a new Ray node")
                self.node_rejoins(node, data.draw(st.booleans()))

    @rule(data=st.data())
    def create(self, data):
        self._run("create", data)

    @rule(data=st.data())
    def applied(self, data):
        self._run("applied", data)

    @rule(data=st.data())
    def started(self, data):
        self._run("started", data)

    @rule(data=st.data())
    def fail(self, data):
        self._run("fail", data)

    @rule(data=st.data())
    def heal(self, data):
        self._run("heal", data)

    @rule(data=st.data())
    def heal_failed(self, data):
        self._run("heal_failed", data)

    @rule(data=st.data())
    def note(self, data):
        self._run("note", data)

    @rule(data=st.data())
    def delete(self, data):
        self._run("delete", data)

    @rule(data=st.data())
    def deleted(self, data):
        self._run("deleted", data)

    @rule(data=st.data())
    def sleep(self, data):
        self._run("sleep", data)

    @rule(data=st.data())
    def doze(self, data):
        self._run("doze", data)

    @rule(data=st.data())
    def dozed(self, data):
        self._run("dozed", data)

    @rule(data=st.data())
    def cool(self, data):
        self._run("cool", data)

    @rule(data=st.data())
    def parked(self, data):
        self._run("parked", data)

    @rule(data=st.data())
    def wake(self, data):
        self._run("wake", data)

    @rule(data=st.data())
    def placed(self, data):
        self._run("placed", data)

    @rule(data=st.data())
    def wake_failed(self, data):
        self._run("wake_failed", data)

    @rule(data=st.data())
    def destroy(self, data):
        self._run("destroy", data)

    @rule(data=st.data())
    def scale_up(self, data):
        self._run("scale_up", data)

    @rule(data=st.data())
    def scale_failed(self, data):
        self._run("scale_failed", data)

    @rule(data=st.data())
    def retire(self, data):
        self._run("retire", data)

    @rule(data=st.data())
    def retired(self, data):
        self._run("retired", data)

    @rule(data=st.data())
    def respec(self, data):
        self._run("respec", data)

    # --- what the registry does itself ------------------------------------------------------------
    def _registry_sample(self) -> None:
        """Registry.sample_once: devices from alive nodes, then what dead nodes held is released."""
        self._sample_nodes(self.ledger)
        alive_names = {n for n in NODES if self.alive[n]}
        dead_names = {n for n in NODES if not self.alive[n]} | ({n for n in NODES if any(
            i.startswith(f"id-{n}-") for i in self.dead_ids)})
        self._do(lambda: self.book.node_lost(set(self.dead_ids), dead_names, alive_names))

    @rule(node=st.sampled_from(NODES))
    def node_lost(self, node):
        if self.alive[node]:
            self.alive[node] = False
            self.dead_ids.add(self.node_ids[node])
        self._registry_sample()

    @rule(node=st.sampled_from(NODES), sample_first=st.booleans())
    def node_rejoins(self, node, sample_first):
        """A node comes back under its name as a new Ray node (its old replicas are gone), seen by the
        registry before or after it noticed the old one died."""
        if self.alive[node]:
            self.alive[node] = False
            self.dead_ids.add(self.node_ids[node])
            if sample_first:
                self._registry_sample()
        self.alive[node] = True
        self.node_ids[node] = f"id-{node}-{int(self.node_ids[node].rsplit('-', 1)[1]) + 1}"
        self._registry_sample()

    @rule(data=st.data(), share=st.sampled_from([0.5, 0.97, 1.0, 1.2, 2.0]))
    def report_usage(self, data, share):
        """An engine measures itself (Registry.report_usage writes it through)."""
        keys = sorted(k for k, r in self.ledger.reservations.items() if not r.host)
        if keys:
            r = self.ledger.report_usage(data.draw(st.sampled_from(keys)), 0)
            r.measured_bytes = int(share * r.bytes_per_device)
            self._rewrite(r.model_id)

    @rule()
    def drift(self):
        self._do(lambda: self.book.drift(self.ledger.drifted()))

    @rule(data=st.data())
    def upgrade(self, data):
        """A registry of this version starts on a store an older one wrote: some records alone, their
        reservations under keys of their own (the restart moves them back into the records)."""
        for k in [k for k in sorted(self.store) if k.startswith(MODEL_KEY) and data.draw(st.booleans())]:
            stored = load_stored(self.store[k].encode())
            self.store[k] = stored.record.model_dump_json()
            self.store.update({RESERVATION_KEY + r.key: r.model_dump_json() for r in stored.reservations})
        self.restart()

    @rule()
    def restart(self):
        """A new registry replica: everything read back from the KV, as Registry.__init__ does."""
        ledger = Ledger(BUDGET)
        stored = [load_stored(v.encode()) for k, v in sorted(self.store.items()) if k.startswith(MODEL_KEY)]
        legacy = [Reservation.model_validate_json(v) for k, v in sorted(self.store.items())
                  if k.startswith(RESERVATION_KEY)]
        book = ModelBook(ledger, [s.record for s in stored])
        book.version = self.book.version + 1000  # past any version its predecessor reached
        rewrite, gone = book.restore(stored, legacy)
        assert gone == {}, f"a restart released reservations the book still held: {gone}"
        assert rewrite == {s.record.model_id for s in stored if s.reservations is None}
        self._sample_nodes(ledger)
        assert {k: r.model_dump() for k, r in book.records.items()} == \
               {k: r.model_dump() for k, r in self.book.records.items()}, "the restarted book's records differ"
        assert {k: r.model_dump() for k, r in ledger.reservations.items()} == \
               {k: r.model_dump() for k, r in self.ledger.reservations.items()}, "the restarted ledger differs"
        self.book, self.ledger = book, ledger
        for model_id in rewrite:  # the older layout migrated, as Registry._restore does
            self._rewrite(model_id)
        for r in legacy:
            del self.store[RESERVATION_KEY + r.key]

    # --- invariants ----------------------------------------------------------------------------
    @invariant()
    def no_reservation_without_a_record(self):
        for r in self.ledger.reservations.values():
            rec = self.book.records.get(r.model_id)
            assert rec is not None, f"{r.key} is reserved but {r.model_id} has no record"
            assert rec.books(r), f"{r.key} is reserved but its record ({rec.status.value}) does not hold it"

    @invariant()
    def resident_records_hold_their_replicas(self):
        for rec in self.book.records.values():
            if rec.holds_memory:
                for rp in rec.live_replicas:
                    r = self.ledger.reservations.get(names.replica_key(rec.model_id, rp.index))
                    assert r is not None and r.devices == rp.devices, \
                        f"{rec.model_id} ({rec.status.value}) is resident but r{rp.index} holds no reservation"
            if rec.sleep_mode is SleepMode.LEVEL1 and rec.status not in ENDED:
                for rp in rec.live_replicas:
                    key = names.replica_key(rec.model_id, rp.index) + "@host"
                    assert key in self.ledger.reservations, f"{rec.model_id} sleeps at level 1 without {key}"
            if rec.status in DORMANT and not rec.resident and rec.sleeps_in_place:
                for rp in rec.live_replicas:  # what its engines still hold stays booked on their devices
                    r = self.ledger.reservations.get(names.replica_key(rec.model_id, rp.index))
                    assert r is not None and r.state is ReservationState.ASLEEP and r.devices == rp.devices, \
                        f"{rec.model_id} sleeps in place but r{rp.index} books no residual"

    @invariant()
    def bookings_within_budget(self):
        booked: dict[str, int] = {}
        for r in self.ledger.reservations.values():
            for dev in r.devices:  # an engine asleep in place books only its residual
                booked[dev] = booked.get(dev, 0) + (r.residual_bytes if r.state is ReservationState.ASLEEP
                                                    else r.bytes_per_device)
        for dev, nbytes in booked.items():
            total = HOST_TOTAL[dev.removesuffix(":host")] if dev.endswith(":host") else GPU_TOTAL
            assert nbytes <= int(BUDGET * total), f"{dev} is booked past its budget"

    @invariant()
    def every_record_is_in_a_legal_state(self):
        for rec in self.book.records.values():
            assert rec.state in LEGAL, f"{rec.model_id} is in an illegal state: {rec.state}"

    @invariant()
    def versions_only_go_up(self):
        self._check_versions()

    @invariant()
    def the_store_is_the_book(self):
        models = [load_stored(v.encode()) for k, v in self.store.items() if k.startswith(MODEL_KEY)]
        assert {s.record.model_id: s.record.model_dump() for s in models} == \
               {k: r.model_dump() for k, r in self.book.records.items()}, "records not persisted"
        assert all(s.reservations is not None for s in models) and not [k for k in self.store
                                                                         if k.startswith(RESERVATION_KEY)]
        stored = {r.key: r.model_dump() for s in models for r in s.reservations}
        assert stored == {k: r.model_dump() for k, r in self.ledger.reservations.items()}, \
            "reservations not persisted"


Transitions.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTransitions = Transitions.TestCase
