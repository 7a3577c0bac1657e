"""The ``hive-registry`` Serve app: one stateful replica around a ``Ledger``.

It samples every alive node's devices through a tiny per-node monitor actor, keeps the
reservation ledger and the model records, and writes both through to Ray's internal KV,
so a restarted replica comes back with every model and reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from pydantic import BaseModel
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hive_apps.planning.types import DeviceCapacity
from hive_apps.registry.devices import NodeSample
from hive_apps.registry.ledger import DeviceState, Ledger, NodeState, ReservationError
from hive_apps.registry.locks import StartLocks
from hive_apps.registry.monitor import node_name_of, sample_node
from hive_apps.registry.records import SERVING, ModelRecord, ModelStatus, Reservation, ReservationState
from hive_apps.registry.store import StateStore
from hive_apps.settings import get_settings

log = logging.getLogger("ray.serve")


@ray.remote(num_cpus=0)
class NodeMonitor:
    """Lives on one node and reports what that node's devices hold right now."""

    def __init__(self, node_id: str, labels: dict[str, str]):
        self.node_id = node_id
        self.labels = labels

    def sample(self) -> NodeSample:
        return sample_node(self.node_id, self.labels)


class ReserveResult(BaseModel):
    ok: bool
    message: str = ""
    status_code: int = 200


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class Registry:
    def __init__(self):
        self.settings = get_settings()
        self.ledger = Ledger(self.settings.memory_budget_fraction)
        self.store = StateStore(self.settings.state_namespace)
        self.models: dict[str, ModelRecord] = {r.model_id: r for r in self.store.load_all("model/", ModelRecord)}
        for r in self.store.load_all("reservation/", Reservation):
            self.ledger.reservations[r.key] = r
        self.monitors: dict[str, ray.actor.ActorHandle] = {}
        self.nodes: dict[str, NodeSample] = {}  # Ray node id -> latest sample
        self.pushed: dict[str, NodeSample] = {}  # node name -> latest sample from a standalone agent
        self.start_locks = StartLocks()
        self.sampled = asyncio.Event()
        self.last_sample_at = 0.0
        self._loop_task = asyncio.get_event_loop().create_task(self._monitor_loop())
        log.info("registry up: %d models, %d reservations restored", len(self.models), len(self.ledger.reservations))

    # --- monitoring ------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:  # keep monitoring through transient GCS/actor errors
                log.exception("device sampling failed")
            await asyncio.sleep(self.settings.monitor_interval_s)

    async def sample_once(self) -> None:
        all_nodes = await asyncio.to_thread(ray.nodes)
        nodes = [n for n in all_nodes if n.get("Alive")]
        alive = {n["NodeID"] for n in nodes}
        for node_id in list(self.monitors):
            if node_id not in alive:
                del self.monitors[node_id]
        for n in nodes:
            if n["NodeID"] not in self.monitors:
                self.monitors[n["NodeID"]] = NodeMonitor.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote(n["NodeID"], n.get("Labels", {}))
        node_ids = list(self.monitors)
        results = await asyncio.gather(*(self.monitors[i].sample.remote() for i in node_ids), return_exceptions=True)
        for node_id, sample in zip(node_ids, results):
            if isinstance(sample, Exception):
                log.warning("monitor on node %s failed: %s", node_id[:8], sample)
                self.monitors.pop(node_id, None)
                continue
            sample = self._prefer_agent(node_id, sample)
            self.nodes[node_id] = sample
            self.ledger.update_node(node_id, sample.devices)
        for node_id in [n for n in self.nodes if n not in alive]:
            del self.nodes[node_id]
        self.ledger.drop_nodes_except(alive)
        await self._release_dead_nodes(all_nodes)
        await self._expire_pending()
        await self._record_drift()
        self.last_sample_at = time.time()
        self.sampled.set()

    def _prefer_agent(self, node_id: str, sample: NodeSample) -> NodeSample:
        """A fresh sample pushed by a standalone agent for this node wins over the Ray monitor's."""
        pushed = self.pushed.get(sample.node_name)
        ttl = max(5.0, 3 * self.settings.monitor_interval_s)
        if pushed is None or time.time() - pushed.sampled_at > ttl:
            return sample
        devices = [d.model_copy(update={"node_id": node_id}) for d in pushed.devices]
        return pushed.model_copy(update={"node_id": node_id, "devices": devices})

    async def push_sample(self, sample: NodeSample) -> ReserveResult:
        """Accept a sample from ``python -m hive_apps.monitor`` for a node Ray knows by that name."""
        if sample.node_name not in {s.node_name for s in self.nodes.values()}:
            known = ", ".join(sorted(s.node_name for s in self.nodes.values()))
            return ReserveResult(ok=False, status_code=404, message=(
                f"no alive Ray node is named {sample.node_name!r} (known: {known}); start the Ray node with "
                f"the label ray-hive/node={sample.node_name} or pass that name to the agent's --node-name"))
        self.pushed[sample.node_name] = sample.model_copy(update={"sampled_at": time.time(), "source": "agent"})
        return ReserveResult(ok=True)

    async def node_states(self) -> list[NodeState]:
        await self._ready()
        return [self.ledger.node_state(s) for s in sorted(self.nodes.values(), key=lambda s: s.node_name)]

    async def _expire_pending(self) -> None:
        for r in self.ledger.expire_pending(time.time(), self.settings.pending_reservation_ttl_s):
            self._forget(r.key)
            log.warning("released %s: its engine never came up", r.key)

    async def _record_drift(self) -> None:
        """Show in each model's status where an engine uses > 5 % more or less than reserved."""
        drifted = self.ledger.drifted()
        for rec in list(self.models.values()):
            now = {}
            for r in self.ledger.of_model(rec.model_id):
                if r.key in drifted:
                    now[f"r{r.replica}"] = (f"{drifted[r.key]:+.0%}: measured {r.measured_bytes / 2**30:.2f} GiB "
                                            f"vs reserved {r.bytes_per_device / 2**30:.2f} GiB")
            if now != rec.drift:
                rec.drift = now
                await self.put_model(rec)

    async def _release_dead_nodes(self, all_nodes: list[dict]) -> None:
        """Free what replicas on dead nodes held, and say so in their models' status."""
        def name(n: dict) -> str:
            return node_name_of(n["NodeID"], n.get("Labels", {}))

        alive = {name(n) for n in all_nodes if n.get("Alive")}
        dead = {name(n) for n in all_nodes if not n.get("Alive")} - alive
        for r in self.ledger.on_nodes(dead):
            self.ledger.release_key(r.key)
            self._forget(r.key)
            rec = self.models.get(r.model_id)
            if rec is None:
                continue
            rec.lost_replicas[f"r{r.replica}"] = f"node of {', '.join(r.devices)} died"
            if rec.status in SERVING:
                rec.status = ModelStatus.DEGRADED
            rec.message = f"lost replicas {sorted(rec.lost_replicas)}: their node died; reservations released"
            await self.put_model(rec)
            log.warning("released %s: node of %s is dead", r.key, r.devices)

    async def _ready(self) -> None:
        await asyncio.wait_for(self.sampled.wait(), timeout=60)

    # --- devices -----------------------------------------------------------------------
    async def capacities(self) -> list[DeviceCapacity]:
        await self._ready()
        return self.ledger.capacities()

    async def device_states(self) -> list[DeviceState]:
        await self._ready()
        return self.ledger.states()

    # --- reservations ------------------------------------------------------------------
    def _save(self, r: Reservation) -> None:
        self.store.put(f"reservation/{r.key}", r)

    def _forget(self, key: str) -> None:
        self.store.delete(f"reservation/{key}")

    async def reserve(self, reservations: list[Reservation]) -> ReserveResult:
        await self._ready()
        try:
            self.ledger.reserve(reservations)
        except ReservationError as e:
            return ReserveResult(ok=False, message=e.message, status_code=e.status_code)
        for r in reservations:
            self._save(r)
        return ReserveResult(ok=True)

    async def activate(self, model_id: str) -> None:
        self.ledger.activate(model_id)
        for r in self.ledger.of_model(model_id):
            self._save(r)

    async def release_replicas(self, model_id: str, indices: list[int]) -> None:
        for key in (f"{model_id}/r{i}" for i in indices):
            if self.ledger.release_key(key) is not None:
                self._forget(key)

    async def release(self, model_id: str) -> int:
        self.start_locks.release(model_id)
        gone = self.ledger.release(model_id)
        for r in gone:
            self._forget(r.key)
        return len(gone)

    async def report_usage(self, key: str, measured_bytes: int) -> None:
        r = self.ledger.report_usage(key, measured_bytes)
        if r is not None:
            self._save(r)

    async def acquire_start_lock(self, devices: list[str], holder: str, lease_s: float) -> bool:
        return self.start_locks.try_acquire(devices, holder, lease_s)

    async def release_start_lock(self, holder: str) -> None:
        self.start_locks.release(holder)

    async def reservations(self, model_id: str | None = None) -> list[Reservation]:
        rs = self.ledger.reservations.values()
        return [r for r in rs if model_id is None or r.model_id == model_id]

    # --- model records -----------------------------------------------------------------
    async def put_model(self, record: ModelRecord) -> None:
        self.models[record.model_id] = record
        self.store.put(f"model/{record.model_id}", record)

    async def claim_model(self, record: ModelRecord) -> bool:
        """Store a new record unless the id is taken: the registry serialises model_id uniqueness."""
        if record.model_id in self.models:
            return False
        await self.put_model(record)
        return True

    async def get_model(self, model_id: str) -> ModelRecord | None:
        return self.models.get(model_id)

    async def list_models(self) -> list[ModelRecord]:
        return sorted(self.models.values(), key=lambda r: r.created_at)

    async def delete_model(self, model_id: str) -> None:
        self.models.pop(model_id, None)
        self.store.delete(f"model/{model_id}")

    # --- recovery ----------------------------------------------------------------------
    async def reset(self) -> dict[str, int]:
        """Rebuild the inventory from the monitors and the reservations from the model records."""
        self.ledger.devices.clear()
        for node_id in list(self.monitors):
            ray.kill(self.monitors.pop(node_id))
        await self.sample_once()
        measured = {k: r.measured_bytes for k, r in self.ledger.reservations.items()}
        for key in list(self.ledger.reservations):
            self._forget(key)
        self.ledger.reservations.clear()
        for rec in self.models.values():
            for rp in rec.plan.replicas:
                if f"r{rp.index}" in rec.lost_replicas:
                    continue
                r = Reservation.for_replica(rec.model_id, rp, measured.get(f"{rec.model_id}/r{rp.index}"))
                if rec.status in SERVING and rp.index not in rec.healing_replicas:
                    r.state = ReservationState.ACTIVE  # its engine is up; left pending it would expire
                self.ledger.reservations[r.key] = r
                self._save(r)
        return {"devices": len(self.ledger.devices), "reservations": len(self.ledger.reservations)}

    async def healthz(self) -> dict:
        return {"devices": len(self.ledger.devices), "last_sample_age_s": round(time.time() - self.last_sample_at, 2)}


def build(_: dict | None = None):
    return Registry.bind()
