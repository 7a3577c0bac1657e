"""The reservation ledger: per-device memory accounting that never oversubscribes.

Pure state, no Ray: the registry deployment wraps one ``Ledger`` and persists its
reservations. ``available`` is what the planner may still use on a device:

    held      = per reservation, max(reserved, measured by its engine); for an engine asleep in
                place, only what it still holds there (its residual)
    explained = per reservation, what of the sampled use it accounts for: what its engine measured;
                without a measurement all of it once the engine is up (a CPU engine), nothing while
                it is pending (the engine starting, level-1 weights not yet copied to host RAM);
                asleep in place or waking there, its residual
    budget    = floor(budget_fraction x total)
    foreign   = max(0, used - explained by the hive), and never less than what the last sample
                left unexplained (an engine that measured itself since is not in that sample yet)
    available = max(0, budget - held by the hive - foreign)

Reservations count in full from the moment they are made, on top of any other use until they
are explained, so a pending booking never hides behind memory used by others, and two deploys
racing for one device cannot both fit: ``reserve`` checks and books every device of a plan in
one step.

A node's host RAM (``<node>:host``) is booked the same way for the weights of replicas asleep
at level 1.

An engine asleep in place (vLLM sleep level 1 or 2) still holds part of its devices: its CUDA
context, and what its start options let it keep (``planning/memory.sleep_residual_bytes``). Its
reservation stays, ``asleep``, booking that residual alone, which also explains that much of the
device's sampled use; its wake books only the rest (``reserve``), so the residual is never
counted twice, neither as foreign use nor as a second booking.
"""

from __future__ import annotations

from pydantic import BaseModel

from hive_apps.core.devices import Device, DeviceKind, NodeSample, host_id
from hive_apps.core.planning.types import DeviceCapacity
from hive_apps.core.state.records import Reservation, ReservationState

DRIFT_THRESHOLD = 0.05


class ReservationError(Exception):
    def __init__(self, message: str, status_code: int = 409):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


class DeviceState(BaseModel):
    """One row of ``GET /admin/gpus``."""

    device: Device
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int
    foreign_bytes: int  # use no reservation explains: other processes, an engine still starting
    available_bytes: int
    replicas: list[str]
    # models asleep (parked) whose last plan put a replica here: what waking them all would need
    dormant_bytes: int = 0
    dormant: list[str] = []


class NodeState(BaseModel):
    """One row of ``GET /admin/nodes``: a node's host RAM, which CPU engines live in."""

    node_id: str
    node_name: str
    source: str
    cpu_count: int
    host_total_bytes: int
    host_used_bytes: int
    host_reserved_bytes: int  # hive reservations on the node's CPU device
    devices: list[str]
    error: str | None = None  # the monitor could not read the node's GPUs (why, and what to fix)
    driver_version: str | None = None  # the node's NVIDIA driver, as NVML reports it (None: no GPU read)
    cuda_driver_version: str | None = None  # the newest CUDA that driver runs
    cuda_runtime: str | None = None  # the CUDA the node's torch was built for (None: no torch, CPU build)


class Ledger:
    def __init__(self, budget_fraction: float = 0.90):
        self.budget_fraction = budget_fraction
        self.devices: dict[str, Device] = {}
        self.reservations: dict[str, Reservation] = {}
        self.hosts: dict[str, tuple[str, int, int]] = {}  # host id -> (node id, total, used bytes of its RAM)
        self.sampled_foreign: dict[str, int] = {}  # device or host id -> what its last sample left unexplained

    # --- inventory -------------------------------------------------------------------
    def update_node(self, node_id: str, devices: list[Device]) -> None:
        """Replace what one node reported; devices it no longer reports disappear."""
        for dev_id in [d for d, dev in self.devices.items() if dev.node_id == node_id]:
            del self.devices[dev_id]
        for dev in devices:
            self.devices[dev.id] = dev
            self.sampled_foreign[dev.id] = self._unexplained(dev.id, self.used_on(dev))

    def update_host(self, sample: NodeSample) -> None:
        host = host_id(sample.node_name)
        self.hosts[host] = (sample.node_id, sample.host_total_bytes, sample.host_used_bytes)
        self.sampled_foreign[host] = self._unexplained(host, sample.host_used_bytes)

    def drop_nodes_except(self, alive_node_ids: set[str]) -> None:
        for dev_id in [d for d, dev in self.devices.items() if dev.node_id not in alive_node_ids]:
            del self.devices[dev_id]
        self.hosts = {h: v for h, v in self.hosts.items() if v[0] in alive_node_ids}

    def host_available(self, host: str) -> int:
        """What level-1 sleepers may still put in this node's host RAM."""
        if host not in self.hosts:
            return 0
        _, total, used = self.hosts[host]
        return self._booked(host, total, used)[2]

    # --- accounting ------------------------------------------------------------------
    def reserved_on(self, dev_id: str) -> int:
        return sum(r.held_bytes for r in self.reservations.values() if dev_id in r.devices)

    def measured_on(self, dev_id: str) -> int:
        return sum(r.engine_bytes for r in self.reservations.values() if dev_id in r.devices)

    def _unexplained(self, dev_id: str, used: int) -> int:
        return max(0, used - sum(r.explained_bytes for r in self.reservations.values() if dev_id in r.devices))

    def _booked(self, dev_id: str, total: int, used: int) -> tuple[int, int, int]:
        """(held by the hive, foreign, available) on a device or a node's host RAM. Foreign is at least
        what the last sample left unexplained (a measurement made since is not in that sample, so it
        cannot shrink it) and grows where a reservation went since (its engine may still be stopping)."""
        reserved = self.reserved_on(dev_id)
        foreign = max(self.sampled_foreign.get(dev_id, 0), self._unexplained(dev_id, used))
        return reserved, foreign, max(0, int(self.budget_fraction * total) - reserved - foreign)

    def replicas_on(self, dev_id: str) -> list[str]:
        """The replicas running here; one asleep in place is listed with the sleepers (``dormant``),
        though its residual stays booked in ``reserved_bytes``."""
        return sorted(r.key for r in self.reservations.values()
                      if dev_id in r.devices and r.state is not ReservationState.ASLEEP)

    def used_on(self, dev: Device) -> int:
        """Measured use; a simulated GPU holds exactly what its sim engines allocated, right now
        (derived here, not cached at sample time, so a released engine stops counting at once)."""
        return self.measured_on(dev.id) if dev.kind is DeviceKind.SIM_GPU else dev.used_bytes

    def state_of(self, dev: Device) -> DeviceState:
        used = self.used_on(dev)
        reserved, foreign, available = self._booked(dev.id, dev.total_bytes, used)
        return DeviceState(
            device=dev,
            total_bytes=dev.total_bytes,
            used_bytes=used,
            free_bytes=max(0, dev.total_bytes - used),
            reserved_bytes=reserved,
            foreign_bytes=foreign,
            available_bytes=available,
            replicas=self.replicas_on(dev.id),
        )

    def states(self) -> list[DeviceState]:
        return [self.state_of(d) for d in sorted(self.devices.values(), key=lambda d: d.id)]

    def node_state(self, sample: NodeSample) -> NodeState:
        cpu = [d.id for d in sample.devices if d.kind is DeviceKind.CPU]
        return NodeState(
            node_id=sample.node_id, node_name=sample.node_name, source=sample.source, cpu_count=sample.cpu_count,
            host_total_bytes=sample.host_total_bytes, host_used_bytes=sample.host_used_bytes,
            host_reserved_bytes=sum(self.reserved_on(d) for d in [*cpu, host_id(sample.node_name)]),
            devices=[d.id for d in sample.devices],
            error=sample.error,
            driver_version=next((d.driver_version for d in sample.devices if d.driver_version), None),
            cuda_driver_version=next((d.cuda_driver_version for d in sample.devices if d.cuda_driver_version), None),
            cuda_runtime=sample.cuda_runtime,
        )

    def capacities(self) -> list[DeviceCapacity]:
        return [
            DeviceCapacity(
                device=s.device,
                available_bytes=s.available_bytes,
                free_bytes=s.free_bytes,
                hive_replicas=s.replicas,
            )
            for s in self.states()
        ]

    # --- reservations ----------------------------------------------------------------
    def reserve(self, reservations: list[Reservation]) -> None:
        """Book every reservation of a deploy, or none of them. A replica asleep in place wakes into
        its own booking: what it kept through the sleep is booked already, only the rest is needed."""
        need: dict[str, int] = {}
        booked = [self._waking(r) for r in reservations]
        for r in booked:
            kept = self._asleep(r)
            if r.key in self.reservations and kept is None:
                raise ReservationError(f"replica {r.key} already holds a reservation")
            for dev_id in r.devices:
                need[dev_id] = need.get(dev_id, 0) + r.held_bytes - (kept.residual_bytes if kept else 0)
        for dev_id, nbytes in need.items():
            if dev_id in self.hosts:
                available = self.host_available(dev_id)
                if nbytes > available:
                    raise ReservationError(f"host RAM {dev_id} has {available / 2**30:.2f} GiB available but "
                                           f"{nbytes / 2**30:.2f} GiB are needed")
                continue
            dev = self.devices.get(dev_id)
            if dev is None:
                raise ReservationError(f"device {dev_id} is not in the registry (node gone?); plan again", 409)
            available = self.state_of(dev).available_bytes
            if nbytes > available:
                raise ReservationError(
                    f"device {dev_id} has {available / 2**30:.2f} GiB available but the plan needs "
                    f"{nbytes / 2**30:.2f} GiB (short by {(nbytes - available) / 2**30:.2f} GiB); "
                    "another deploy took it first: plan again or free memory"
                )
        for r in booked:
            self.reservations[r.key] = r

    def _waking(self, r: Reservation) -> Reservation:
        """``r`` as booked: waking in place where it wakes from its own residual, which it still holds;
        once up, its engine holds what it measured before it slept (so the wake books that, if more)."""
        kept = self._asleep(r)
        if kept is None:
            return r
        return r.model_copy(update={"state": ReservationState.WAKING, "residual_bytes": kept.residual_bytes,
                                    "measured_bytes": r.measured_bytes if r.measured_bytes is not None
                                    else kept.measured_bytes})

    def _asleep(self, r: Reservation) -> Reservation | None:
        """The same replica's booking asleep in place on the same devices, which ``r`` wakes from."""
        kept = self.reservations.get(r.key)
        ok = kept is not None and kept.state is ReservationState.ASLEEP and kept.devices == r.devices
        return kept if ok else None

    def activate(self, model_id: str) -> None:
        """Its engines are up (or its level-1 weights are in host RAM): pending and waking bookings
        are active; one asleep in place stays asleep."""
        for r in self.reservations.values():
            if r.model_id == model_id and r.state is not ReservationState.ASLEEP:
                r.state, r.residual_bytes = ReservationState.ACTIVE, 0

    def doze(self, key: str, residual_bytes: int) -> None:
        """Its engine sleeps in place: the booking keeps only what the engine still holds per device."""
        r = self.reservations[key]
        r.state, r.residual_bytes = ReservationState.ASLEEP, residual_bytes

    def release(self, model_id: str) -> list[Reservation]:
        gone = [r for r in self.reservations.values() if r.model_id == model_id]
        for r in gone:
            del self.reservations[r.key]
        return gone

    def report_usage(self, key: str, measured_bytes: int) -> Reservation | None:
        r = self.reservations.get(key)
        if r is not None:
            r.measured_bytes = measured_bytes
        return r

    def drifted(self) -> dict[str, float]:
        """Active reservations whose engine uses more than 5 % more or less than planned."""
        return {r.key: r.drift for r in self.reservations.values()
                if r.state is ReservationState.ACTIVE and r.drift is not None and abs(r.drift) > DRIFT_THRESHOLD}

    def expire_pending(self, now: float, ttl_s: float) -> list[Reservation]:
        """Pending reservations whose engine never came up (its deploy died with its admin)."""
        gone = [r for r in self.reservations.values()
                if r.state is ReservationState.PENDING and now - r.created_at > ttl_s]
        for r in gone:
            del self.reservations[r.key]
        return gone

    def release_key(self, key: str) -> Reservation | None:
        return self.reservations.pop(key, None)

    def on_nodes(self, node_names: set[str], node_ids: set[str] | frozenset[str] = frozenset()) -> list[Reservation]:
        """Reservations placed on any of these Ray nodes; one stored without a node id goes by the
        node names in its device ids ('<node>:<device>')."""
        return [r for r in self.reservations.values()
                if (r.node_id in node_ids if r.node_id else any(d.rsplit(":", 1)[0] in node_names for d in r.devices))]

    def of_model(self, model_id: str) -> list[Reservation]:
        return [r for r in self.reservations.values() if r.model_id == model_id]
