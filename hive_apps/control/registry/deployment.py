"""The ``hive-registry`` Serve app: the one owner of devices, reservations and model records.

A thin shell around pure state: a ``Ledger`` (devices, reservations) and a ``ModelBook``
(records, changed only by typed transitions, ``core/state/transitions.py``). It samples every
alive node through the cluster seam, writes every change through to Ray's internal KV (so a
restarted replica comes back with every model, reservation and start lock), and lets the
admin, the gateway and routers wait for changes (``watch``) instead of polling.

What is stored, and why in one write. Ray's internal KV has no multi-key transaction, so a
model and what it books live under one key, ``model/<id>``: the record's JSON plus the
reservations it holds (``records.dump_stored``). Every change of a model (a transition, an
engine's measured use, a pending booking expired) is one ``kv_put`` of that key: a crash lands
all of it or none of it, so records and reservations can never disagree in the KV. The ledger
is not stored on its own: at start it is rebuilt from the records (``ModelBook.restore``).

The reservations are stored in the value, not recomputed from the plan at start, because the
record does not determine them all: whether a booking is pending or active (a deleting record
does not say whether it was still starting), when it was made (the pending TTL counts from it),
what its engine measured (reported once, when it started), and which bookings a record holds
at all (a failed deploy's record still lists its replicas). Their devices and bytes follow from
the plan: ``ModelRecord.books`` checks each one read back against its record, and
``POST /admin/reset`` rebuilds them from the plans (``ModelBook.rebuild_reservations``).

An older registry stored reservations as separate ``reservation/<key>`` keys, written one by one
after the record. At start they are read once: a record stored without reservations takes its
own from them (measured bytes, state and age kept), any its record does not book is released
(a crash between two of those writes), then each such record is written again with its
reservations and the old keys are deleted, puts first: a crash in between leaves the old keys
to a next start, which prefers the reservations inside the records. (An older registry started
again on this layout sees no reservations: ``POST /admin/reset`` rebuilds them from the records.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from hive_apps.control.cluster import NodeInfo, get_cluster, off_loop
from hive_apps.control.registry.monitor import node_name_of
from hive_apps.control.registry.samples import node_problems, sample_problems
from hive_apps.control.registry.store import StateStore
from hive_apps.core.devices import DeviceKind, NodeSample
from hive_apps.core.planning.types import DeviceCapacity
from hive_apps.core.settings import HiveSettings, get_settings
from hive_apps.core.state.book import Change, ModelBook, TransitionError
from hive_apps.core.state.ledger import DeviceState, Ledger, NodeState
from hive_apps.core.state.locks import StartLocks
from hive_apps.core.state.records import (
    AdapterRecord,
    ModelRecord,
    Reservation,
    StoredModel,
    dump_stored,
    load_stored,
)
from hive_apps.core.state.transitions import Deleted, Transition, rule_of
from hive_apps.ops import metrics

log = logging.getLogger("ray.serve")

MODEL_KEY = "model/"
ADAPTER_KEY = "adapter/"  # a LoRA adapter's record, one key each (``AdapterRecord``)
RESERVATION_KEY = "reservation/"  # an older registry's reservations: read once at start, then deleted
START_LOCKS_KEY = "start-locks"
SAMPLE_TIMEOUT_S = 60.0
WATCH_MAX_S = 60.0


class Outcome(BaseModel):
    """The answer to a transition: the record as it is now, or why the transition was refused."""

    ok: bool
    record: ModelRecord | None = None
    message: str = ""
    status_code: int = 200
    adapter: AdapterRecord | None = None  # an adapter's transition: its record as it is now


class BookView(BaseModel):
    """Every model record at one version of the book (what ``watch`` answers)."""

    version: int
    models: list[ModelRecord]
    adapters: list[AdapterRecord] = []  # the LoRA adapters, whatever state their bases are in


class StartLockState(BaseModel):
    held: dict[str, tuple[str, float]] = {}


class Registry:
    async def __init__(self, settings: HiveSettings | None = None,  # type: ignore[misc]  # Serve awaits it
                       clock: Callable[[], float] = time.time, publisher: metrics.Publisher | None = None):
        """Serve awaits this; so do the unit tests (``Registry.__new__`` then ``await __init__``).
        ``clock``: wall time, which transitions stamp records with and samples age by. A composition
        root: what Serve does not pass (settings, the metrics publisher) it builds here."""
        self.settings = settings or get_settings()
        self.clock = clock
        self.publisher = publisher or metrics.Publisher()
        self.cluster = get_cluster()
        self.ledger = Ledger(self.settings.memory_budget_fraction)
        self.store = StateStore(self.cluster, self.settings.state_namespace, self.settings.kv_timeout_s)
        load = self.store.load_all_async
        stored = await load(MODEL_KEY, lambda raw: load_stored(raw, self.settings))
        adapters = await load(ADAPTER_KEY, AdapterRecord.model_validate_json)
        self.book = ModelBook(self.ledger, [s.record for s in stored], adapters)
        # Followers long-poll with the last version they saw; a restarted registry starts past any
        # version its predecessor reached (the clock in ms; a change takes longer than 1 ms).
        self.book.version = int(time.time() * 1000)  # real time, whatever the clock: it orders processes
        await self._restore(stored, await load(RESERVATION_KEY, Reservation.model_validate_json))
        for rec in self.book.records.values():
            if rec.policy_warning:
                log.warning("%s: %s", rec.model_id, rec.policy_warning)
        self.start_locks = StartLocks()
        locks = await load(START_LOCKS_KEY, StartLockState.model_validate_json)
        if locks:
            self.start_locks.held = dict(locks[0].held)
        self.nodes: dict[str, NodeSample] = {}  # Ray node id -> latest sample
        # Ray node id -> the latest sample of the node's own Ray monitor, and its Ray labels: what
        # a pushed sample is checked against (never a pushed one, so no lie builds on another)
        self.in_ray: dict[str, NodeSample] = {}
        self.labels: dict[str, dict[str, str]] = {}
        self.pushed: dict[str, NodeSample] = {}  # node name -> latest sample from a standalone agent
        self.sampled = asyncio.Event()
        self.changed = asyncio.Condition()
        self.last_sample_at = 0.0
        self._loop_task = asyncio.get_running_loop().create_task(self._monitor_loop())
        log.info("registry up: %d models, %d adapters, %d reservations, %d start locks restored",
                 len(self.book.records), len(self.book.adapters), len(self.ledger.reservations),
                 len(self.start_locks.held))

    # --- persistence and announcements -------------------------------------------------
    async def _persist(self, changes: list[Change]) -> None:
        """Each changed model is one KV write: its record with the reservations it holds."""
        puts: dict[str, BaseModel | bytes] = {}
        deletes: list[str] = []
        for c in changes:
            if not c.model:
                pass
            elif c.record is not None:
                puts[MODEL_KEY + c.model_id] = dump_stored(c.record, c.reservations)
            elif c.model_id not in self.book.records:
                deletes.append(MODEL_KEY + c.model_id)
            for name, adapter in c.adapters.items():
                if adapter is not None:
                    puts[ADAPTER_KEY + name] = adapter
                elif name not in self.book.adapters:
                    deletes.append(ADAPTER_KEY + name)
        await self.store.write(puts, deletes)
        await self._announce()

    async def _rewrite(self, model_ids: set[str], deletes: Sequence[str] = ()) -> None:
        """Store these models again as they are now (their bookings changed outside a transition)."""
        await self.store.write({MODEL_KEY + m: dump_stored(self.book.records[m], self.ledger.of_model(m))
                                for m in sorted(model_ids) if m in self.book.records}, deletes)

    async def _announce(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    # --- monitoring ------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:  # keep monitoring through transient GCS/actor errors
                log.exception("device sampling failed")
            await asyncio.sleep(self.settings.monitor_interval_s)

    async def sample_once(self) -> None:
        all_nodes: list[NodeInfo] = await off_loop(self.cluster.nodes, timeout=SAMPLE_TIMEOUT_S)
        alive = {n.node_id for n in all_nodes if n.alive}
        samples = await off_loop(self.cluster.sample_nodes, all_nodes, timeout=SAMPLE_TIMEOUT_S)
        self.labels = {n.node_id: n.labels for n in all_nodes if n.alive}
        for node_id, sample in samples.items():
            if isinstance(sample, Exception):
                log.warning("monitor on node %s failed: %s", node_id[:8], sample)
                continue
            self.in_ray[node_id] = sample
            sample = self._prefer_agent(node_id, sample)
            self.nodes[node_id] = sample
            self.ledger.update_node(node_id, sample.devices)
            self.ledger.update_host(sample)
        for by_node in (self.nodes, self.in_ray):
            for node_id in [n for n in by_node if n not in alive]:
                del by_node[node_id]
        self.ledger.drop_nodes_except(alive)
        await self._release_dead_nodes(all_nodes)
        await self._expire_pending()
        drift = self.book.drift(self.ledger.drifted())
        if drift:
            await self._persist(drift)
        self.last_sample_at = self.clock()
        self.sampled.set()
        self.publisher.publish_registry(await self.device_states(), list(self.ledger.reservations.values()),
                                        self.book.list())

    def _prefer_agent(self, node_id: str, sample: NodeSample) -> NodeSample:
        """A fresh sample pushed by a standalone agent for this node wins over the Ray monitor's for
        its GPUs; host RAM (and a CPU node's CPU device) stay the Ray monitor's: the agent's
        container is not where the node's engines and sleepers live, nor is its torch (the GPUs
        keep the Ray monitor's ``cuda_runtime``)."""
        pushed = self.pushed.get(sample.node_name)
        ttl = max(5.0, 3 * self.settings.monitor_interval_s)
        if pushed is None or self.clock() - pushed.sampled_at > ttl:
            return sample
        gpus = [d.model_copy(update={"node_id": node_id,
                                     "cuda_runtime": sample.cuda_runtime if d.kind is DeviceKind.GPU else None})
                for d in pushed.devices if d.kind.is_gpu]
        devices = gpus + [d for d in sample.devices if not d.kind.is_gpu]
        return sample.model_copy(update={"devices": devices, "error": pushed.error, "source": pushed.source,
                                         "sampled_at": pushed.sampled_at})

    async def push_sample(self, sample: NodeSample) -> Outcome:
        """Accept a sample from ``python -m hive_apps.ops.monitor`` for a node Ray knows by that name,
        if it agrees with what that node's own Ray monitor reports (``control/registry/samples.py``)."""
        problems = sample_problems(sample)
        if problems:
            return Outcome(ok=False, status_code=422, message="sample refused: " + "; ".join(problems))
        node_id = next((i for i, s in self.in_ray.items() if s.node_name == sample.node_name), None)
        if node_id is None:
            known = ", ".join(sorted(s.node_name for s in self.in_ray.values()))
            return Outcome(ok=False, status_code=404, message=(
                f"no alive Ray node is named {sample.node_name!r} (known: {known}); start the Ray node with "
                f"the label ray-hive/node={sample.node_name} or pass that name to the agent's --node-name"))
        problems = node_problems(sample, self.in_ray[node_id], self.labels.get(node_id, {}))
        if problems:
            return Outcome(ok=False, status_code=422, message="sample refused: " + "; ".join(problems))
        self.pushed[sample.node_name] = sample.model_copy(update={"sampled_at": self.clock(), "source": "agent"})
        return Outcome(ok=True)

    async def node_states(self) -> list[NodeState]:
        await self._ready()
        return [self.ledger.node_state(s) for s in sorted(self.nodes.values(), key=lambda s: s.node_name)]

    async def _expire_pending(self) -> None:
        gone = self.ledger.expire_pending(self.clock(), self.settings.pending_reservation_ttl_s)
        for r in gone:
            log.warning("released %s: its engine never came up", r.key)
        if gone:
            await self._rewrite({r.model_id for r in gone})

    async def _restore(self, stored: list[StoredModel], legacy: list[Reservation]) -> None:
        """The ledger from the records; an older registry's reservation keys folded in, then deleted."""
        rewrite, gone = self.book.restore(stored, legacy)
        for key, why in gone.items():
            log.warning("released reservation %s: %s", key, why)
        if legacy:
            log.info("moved %d reservations from %s keys into their models' records", len(legacy), RESERVATION_KEY)
        if rewrite or legacy:
            await self._rewrite(rewrite, [RESERVATION_KEY + r.key for r in legacy])

    async def _release_dead_nodes(self, all_nodes: list[NodeInfo]) -> None:
        """Free what replicas on dead nodes held, and say so in their models' status."""
        dead_ids = {n.node_id for n in all_nodes if not n.alive}
        alive_names = {node_name_of(n.node_id, n.labels) for n in all_nodes if n.alive}
        dead_names = {node_name_of(n.node_id, n.labels) for n in all_nodes if not n.alive}
        changes = self.book.node_lost(dead_ids, dead_names, alive_names)
        for c in changes:
            log.warning("released %s: their node is dead", c.forgotten)
        if changes:
            await self._persist(changes)

    async def _ready(self) -> None:
        await asyncio.wait_for(self.sampled.wait(), timeout=60)

    # --- devices -----------------------------------------------------------------------
    async def capacities(self) -> list[DeviceCapacity]:
        await self._ready()
        return self.ledger.capacities()

    async def device_states(self) -> list[DeviceState]:
        """Each device: what is resident (reserved), and what sleeping models would need back (dormant)."""
        await self._ready()
        return self.book.device_states()

    # --- model records: read, wait, transition ---------------------------------------------
    async def get_model(self, model_id: str) -> ModelRecord | None:
        return self.book.get(model_id)

    async def list_models(self) -> list[ModelRecord]:
        return self.book.list()

    async def get_adapter(self, model_id: str) -> AdapterRecord | None:
        return self.book.get_adapter(model_id)

    async def list_adapters(self) -> list[AdapterRecord]:
        return self.book.list_adapters()

    async def watch(self, after: int = -1, timeout_s: float = 30.0) -> BookView:
        """Every record, as soon as the book's version is past ``after`` (or at the timeout).

        Routers, the gateway and the admin long-poll here instead of polling on a timer.
        """
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.book.version > after),
                                       min(max(timeout_s, 0.0), WATCH_MAX_S))
            except TimeoutError:
                pass
        return BookView(version=self.book.version, models=self.book.list(), adapters=self.book.list_adapters())

    async def transition(self, msg: Transition) -> Outcome:
        """Apply one asked-for transition (``core/state/transitions.py``: the messages and their table)."""
        rule = rule_of(msg)
        if rule is None:
            return Outcome(ok=False, status_code=400, message=f"unknown transition {type(msg).__name__!r}")
        if rule.needs_sample:
            await self._ready()
        model_id = msg.model_id
        kwargs = rule.arguments(msg)
        if rule.takes_now:
            kwargs["now"] = self.clock()
        kwargs.update({k: getattr(self.settings, v) for k, v in rule.settings.items()})
        before = self.book.get(model_id)  # a copy: for the lifecycle metrics
        try:
            change = getattr(self.book, rule.method)(**kwargs)
        except TransitionError as e:
            return Outcome(ok=False, record=self.book.get(model_id), message=e.message, status_code=e.status_code,
                           adapter=self.book.get_adapter(model_id))
        if isinstance(msg, Deleted):
            self.start_locks.release(model_id)
            await self._save_start_locks()
        await self._persist([change])
        self.publisher.on_transition(rule.method, before, change.record, kwargs)
        return Outcome(ok=True, record=change.record, adapter=change.adapters.get(model_id))

    # --- reservations and start locks --------------------------------------------------
    async def report_usage(self, key: str, measured_bytes: int) -> None:
        r = self.ledger.report_usage(key, measured_bytes)
        if r is not None:
            await self._rewrite({r.model_id})

    async def _save_start_locks(self) -> None:
        await self.store.write({START_LOCKS_KEY: StartLockState(held=self.start_locks.held)})

    async def acquire_start_lock(self, devices: list[str], holder: str, lease_s: float) -> bool:
        got = self.start_locks.try_acquire(devices, holder, lease_s)
        if got:
            await self._save_start_locks()
        return got

    async def release_start_lock(self, holder: str) -> None:
        if self.start_locks.release(holder):
            await self._save_start_locks()

    async def reservations(self, model_id: str | None = None) -> list[Reservation]:
        rs = self.ledger.reservations.values()
        return [r for r in rs if model_id is None or r.model_id == model_id]

    # --- recovery ----------------------------------------------------------------------
    async def reset(self) -> dict[str, int]:
        """Rebuild the inventory from the monitors and the reservations from the model records."""
        self.ledger.devices.clear()
        await off_loop(self.cluster.reset_monitors, timeout=SAMPLE_TIMEOUT_S)
        await self.sample_once()
        measured = {k: r.measured_bytes for k, r in self.ledger.reservations.items()}
        self.book.rebuild_reservations(measured)
        await self._rewrite(set(self.book.records))
        await self._announce()
        return {"devices": len(self.ledger.devices), "reservations": len(self.ledger.reservations)}

    async def healthz(self) -> dict:
        return {"devices": len(self.ledger.devices), "last_sample_age_s": round(self.clock() - self.last_sample_at, 2),
                "book_version": self.book.version}


def registry_deployment():
    from ray import serve

    return serve.deployment(Registry, name="Registry", num_replicas=1, max_ongoing_requests=1000,
                            ray_actor_options={"num_cpus": 0})


def build(_: dict | None = None):
    return registry_deployment().bind()
