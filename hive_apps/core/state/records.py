"""Durable records the registry keeps: reservations and deployed models.

A model's KV value is its record with the reservations it books (``dump_stored``): one key per
model, so every change of a model, its bookings included, is one atomic KV write. Its lifecycle is
one typed state (``ModelRecord.state``) read from its status and flags; ``LEGAL`` lists the states
a record may be in.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, model_validator

from hive_apps.core import names
from hive_apps.core.devices import host_id
from hive_apps.core.planning.drift import Loaded
from hive_apps.core.planning.types import Plan, ReplicaPlan
from hive_apps.core.spec import SETTINGS, ModelSpec
from hive_apps.core.weights.types import Manifest

if TYPE_CHECKING:
    from hive_apps.core.settings import HiveSettings

SCHEMA_VERSION: Final = 1  # of the stored records below; a record of another version is quarantined
HOST_SUFFIX = "@host"  # a host-RAM reservation's key: ``<model_id>/r<i>@host``


class ReservationState(str, Enum):
    PENDING = "pending"  # the engine is starting
    ACTIVE = "active"  # the engine is up
    ASLEEP = "asleep"  # the engine sleeps in place: it books only what it still holds there (``residual_bytes``)
    WAKING = "waking"  # it wakes in place: booked in full again, holding what it kept through the sleep


class Reservation(BaseModel):
    """Memory held for one replica on each of its devices."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model_id: str
    replica: int
    devices: list[str]
    node_id: str | None = None  # the Ray node the replica was placed on (a node re-joining
    # under the same name is another node: its old replicas are gone)
    bytes_per_device: int
    state: ReservationState = ReservationState.PENDING
    created_at: float = Field(default_factory=time.time)
    measured_bytes: int | None = None  # what the running engine really uses per device
    host: bool = False  # host RAM of the node (``devices`` = [``<node>:host``]): weights of a level-1 sleeper
    # per device, what its engine kept there through a sleep in place (measured when it slept, bounded by
    # the reservation): all it books while asleep, and what it surely holds while it wakes (0 otherwise)
    residual_bytes: int = 0

    @property
    def in_place(self) -> bool:
        """Its engine is asleep in place, or waking there: it holds ``residual_bytes``, no more for sure."""
        return self.state in (ReservationState.ASLEEP, ReservationState.WAKING)

    @property
    def held_bytes(self) -> int:
        """What counts against the device: the reservation, or more if the engine outgrew it; asleep,
        what the engine still holds (the wake books the rest again)."""
        if self.state is ReservationState.ASLEEP:
            return self.residual_bytes
        return max(self.bytes_per_device, self.measured_bytes or 0)

    @property
    def engine_bytes(self) -> int:
        """What its engine holds on each device now, as far as it measured (0: unmeasured): asleep or
        waking in place, what it kept through the sleep. A simulated GPU's use is the sum of these."""
        return self.residual_bytes if self.in_place else self.measured_bytes or 0

    @property
    def explained_bytes(self) -> int:
        """What of its device's sampled use this reservation accounts for: what its engine measured;
        without a measurement, all of it once the engine is up (or the weights are in host RAM), and
        nothing while pending, so a booking not yet in use never hides behind other use. Asleep or
        waking in place, what the engine kept through the sleep."""
        if self.in_place or self.measured_bytes is not None:
            return self.engine_bytes
        return self.bytes_per_device if self.state is ReservationState.ACTIVE else 0

    @property
    def drift(self) -> float | None:
        if self.measured_bytes is None or not self.bytes_per_device:
            return None
        return (self.measured_bytes - self.bytes_per_device) / self.bytes_per_device

    @classmethod
    def for_replica(cls, model_id: str, rp: ReplicaPlan, measured_bytes: int | None = None) -> Reservation:
        return cls(model_id=model_id, replica=rp.index, devices=rp.devices, node_id=rp.node_id,
                   bytes_per_device=rp.reservation_bytes, measured_bytes=measured_bytes)

    @classmethod
    def on_host(cls, model_id: str, rp: ReplicaPlan) -> Reservation:
        """Host RAM for the weights of a replica asleep at level 1 (every rank's, on its node): pending
        until the engine slept and the weights are there (``dozed``)."""
        return cls(model_id=model_id, replica=rp.index, devices=[host_id(rp.node_name)], node_id=rp.node_id,
                   bytes_per_device=rp.memory.weights * len(rp.devices), host=True)

    @property
    def key(self) -> str:
        return names.replica_key(self.model_id, self.replica) + (HOST_SUFFIX if self.host else "")


class ModelStatus(str, Enum):
    DEPLOYING = "deploying"
    READY = "ready"
    DEGRADED = "degraded"  # serving, but some replicas were lost
    HEALING = "healing"  # serving while replacements for lost replicas start
    FAILED = "failed"
    DELETING = "deleting"
    SLEEPING = "sleeping"  # draining, or parked: no engine, no reservation; a request wakes it
    WAKING = "waking"  # placing and starting its engines again; requests wait
    DESTROYED = "destroyed"  # removed for idleness; the record stays to say so
    SCALING = "scaling"  # serving while a replica added for load starts


SERVING = (ModelStatus.READY, ModelStatus.DEGRADED, ModelStatus.HEALING, ModelStatus.SCALING)
STARTING = (ModelStatus.DEPLOYING, ModelStatus.HEALING, ModelStatus.WAKING, ModelStatus.SCALING)
DORMANT = (ModelStatus.SLEEPING, ModelStatus.WAKING)  # requests are held until it serves
LISTED = (*SERVING, *DORMANT)  # on GET /v1/models: a request is served now or wakes it
ENDED = (ModelStatus.FAILED, ModelStatus.DESTROYED)  # a new deploy may take the id
HOLDING = (ModelStatus.DEPLOYING, *SERVING, *DORMANT)  # statuses whose replicas hold reservations while resident


class Origin(str, Enum):
    """Who asked for a model: ``POST /admin/models`` (``api``), or the hive's Serve config, which lists
    it in ``hive-admin``'s args (``declared``: removing it from the list deletes it; docs/declared_models.md)."""

    API = "api"
    DECLARED = "declared"


class SleepMode(str, Enum):
    LEVEL1 = "level1"  # vLLM sleep level 1: weights copied to the node's host RAM (reserved there), KV freed
    LEVEL2 = "level2"  # vLLM sleep level 2: weights and KV discarded; a wake reloads the weights
    PARKED = "parked"  # engine deployment removed, reservation released (vLLM sleep mode not available)
    # no sleep mode, but the replica's process is kept: vLLM's engine stopped (its memory freed), Python and
    # vLLM's imports kept; waking starts vLLM again in it (issue 27: no Serve scheduling, no new process)
    WARM = "warm"

    @property
    def keeps_engine(self) -> bool:
        """The engine process stays (and its devices with it): it wakes in place."""
        return self is not SleepMode.PARKED


# --- the typed lifecycle state ----------------------------------------------------------------------
# A record stores its lifecycle as a status and flags (the stored JSON stays as it was);
# ``ModelRecord.state`` reads them as one typed state, and ``LEGAL`` lists every state a transition may
# leave a record in.


class Residency(str, Enum):
    """Where a model's memory is: ``resident``, ``sleep_mode`` and ``wake_placed`` read together (a
    combination of them that no value stands for is illegal)."""

    RESIDENT = "resident"  # its devices are booked; engines up, starting or stopping
    # drained, falling asleep in place (or woken before it slept): its devices booked, at level 1 host RAM too
    DOZING_LEVEL1 = "dozing_level1"
    DOZING_LEVEL2 = "dozing_level2"
    ASLEEP_LEVEL1 = "asleep_level1"  # engines asleep in place, devices free but their residual, weights in booked host RAM
    ASLEEP_LEVEL2 = "asleep_level2"  # engines asleep in place, devices free but their residual, weights discarded
    DOZING_WARM = "dozing_warm"  # drained, its vLLM stopping in a kept process: devices booked
    ASLEEP_WARM = "asleep_warm"  # vLLM stopped, the replica's process kept: devices free but what the process holds
    PARKED = "parked"  # no engine, nothing booked (the plan is kept)
    PLACED_LEVEL1 = "placed_level1"  # a wake booked its devices again: engines wake in place from level 1
    PLACED_LEVEL2 = "placed_level2"  # the same from level 2
    PLACED_WARM = "placed_warm"  # the same for kept processes: vLLM starts again in them
    PLACED = "placed"  # a wake placed a parked model anew: its new plan's devices booked, engines start
    NONE = "none"  # nothing booked and nothing asleep (destroyed)


# (resident, sleep_mode, wake_placed) -> residency; the other combinations stand for nothing
_RESIDENCY: Final[dict[tuple[bool, SleepMode | None, bool], Residency]] = {
    (True, None, False): Residency.RESIDENT,
    (True, SleepMode.LEVEL1, False): Residency.DOZING_LEVEL1,
    (True, SleepMode.LEVEL2, False): Residency.DOZING_LEVEL2,
    (False, SleepMode.LEVEL1, False): Residency.ASLEEP_LEVEL1,
    (False, SleepMode.LEVEL2, False): Residency.ASLEEP_LEVEL2,
    (True, SleepMode.WARM, False): Residency.DOZING_WARM,
    (False, SleepMode.WARM, False): Residency.ASLEEP_WARM,
    (True, SleepMode.WARM, True): Residency.PLACED_WARM,
    (False, SleepMode.PARKED, False): Residency.PARKED,
    (True, SleepMode.LEVEL1, True): Residency.PLACED_LEVEL1,
    (True, SleepMode.LEVEL2, True): Residency.PLACED_LEVEL2,
    (True, SleepMode.PARKED, True): Residency.PLACED,
    (False, None, False): Residency.NONE,
}


class ReplicaChange(str, Enum):
    """What its replicas do besides serving: ``healing_replicas`` and ``retiring`` read together."""

    NONE = "none"
    STARTING = "starting"  # replacements of lost replicas, or a replica added for load, start
    RETIRING = "retiring"  # replicas drain before they are removed (load went down)
    STARTING_AND_RETIRING = "starting_and_retiring"  # both: lost replicas are replaced while another drains


class ModelState(BaseModel):
    """A model's lifecycle as one typed value (``ModelRecord.state``); legal when in ``LEGAL``."""

    model_config = ConfigDict(frozen=True)

    phase: ModelStatus
    residency: Residency
    replicas: ReplicaChange = ReplicaChange.NONE
    destroy: bool = False  # removed for idleness (``destroy_reason``): the record stays, destroyed

    @property
    def legal(self) -> bool:
        return self in LEGAL


class IllegalState(ValueError):
    """A record whose flags make no legal state: a transition that wrote it is a bug."""


def _legal_table() -> frozenset[ModelState]:
    S, R, W = ModelStatus, Residency, ReplicaChange
    in_place = (R.DOZING_LEVEL1, R.DOZING_LEVEL2, R.ASLEEP_LEVEL1, R.ASLEEP_LEVEL2, R.DOZING_WARM, R.ASLEEP_WARM)
    asleep = (R.RESIDENT, *in_place, R.PARKED)  # sleep drains, doze, dozed, parked, wake_failed
    serving = {(R.RESIDENT, W.NONE), (R.RESIDENT, W.RETIRING)}  # retire; retired
    # phase -> the (residency, replicas) it may hold, read from the transitions (core/state/book.py)
    holds: dict[ModelStatus, set[tuple[Residency, ReplicaChange]]] = {
        S.DEPLOYING: {(R.RESIDENT, W.NONE)},
        S.READY: serving,
        S.DEGRADED: serving,  # a node died (under a replica that retires, too)
        S.HEALING: {(R.RESIDENT, W.STARTING), (R.RESIDENT, W.STARTING_AND_RETIRING)},  # heal keeps a pending retire
        S.SCALING: {(R.RESIDENT, W.STARTING)},  # scale_up only while nothing retires
        S.FAILED: {(R.RESIDENT, W.NONE)},  # fail releases its bookings but leaves the flags as deploying had them
        S.SLEEPING: {(r, W.NONE) for r in asleep},  # sleep ends a pending retire; parked any start
        S.WAKING: {(r, W.NONE) for r in (*asleep, R.PLACED_LEVEL1, R.PLACED_LEVEL2, R.PLACED_WARM, R.PLACED)},  # wake, placed
        S.DESTROYED: {(R.NONE, W.NONE), (R.NONE, W.RETIRING)},  # deleted keeps a retire pending at destroy
    }
    legal = {ModelState(phase=p, residency=r, replicas=w, destroy=p is S.DESTROYED)
             for p, pairs in holds.items() for r, w in pairs}
    # delete starts from anything and wins over whatever was in flight (a node loss may end a start
    # meanwhile); destroy starts from ready, degraded or sleeping
    legal |= {ModelState(phase=S.DELETING, residency=r, replicas=w) for pairs in holds.values() for r, w in pairs}
    legal |= {ModelState(phase=S.DELETING, residency=r, replicas=w, destroy=True)
              for p in (S.READY, S.DEGRADED, S.SLEEPING) for r, w in holds[p]}
    return frozenset(legal)


LEGAL: Final[frozenset[ModelState]] = _legal_table()  # every state a record may be stored in
STORED: Final = "stored"  # validation context key: a record read back from the KV


class WakeReport(BaseModel):
    """How the last wake went, for the model's status."""

    how: SleepMode
    requested_at: float
    ready_at: float
    placement_s: float  # planning, making room and reserving
    engine_start_s: float | None = None  # the slowest replica's engine start (parked) or vLLM wake_up (level 1/2)
    warm_up_s: float | None = None  # its one-token warm-up
    total_s: float  # from the first held request to serving
    evicted: list[str] = Field(default_factory=list)  # models put to sleep to make room


class ModelRecord(BaseModel):
    """One model as the registry owns it. Only the registry writes it, by named transitions
    (``core/state/book.py``); ``version`` goes up with each, so a stale writer is refused."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model_id: str
    spec: ModelSpec
    plan: Plan
    version: int = 0
    plan_generation: int = 1  # goes up when the plan changes (self-healing moved replicas)
    applied_generation: int = 0  # the plan generation the model's Serve app was last built from
    applied_at: float = 0.0  # when it was built (Serve's status lags a rebuild briefly)
    placed_at: dict[int, int] = Field(default_factory=dict)  # replica index -> plan generation of its last placement
    starting_since: float = Field(default_factory=time.time)  # when the current deploy or heal began
    heal_attempts: int = 0  # failed self-healing attempts in a row (for the back-off)
    next_heal_at: float = 0.0
    status: ModelStatus = ModelStatus.DEPLOYING
    message: str = ""
    created_at: float = Field(default_factory=time.time)
    ready_at: float | None = None
    lost_replicas: dict[str, str] = Field(default_factory=dict)  # "r0" -> why it is gone
    drift: dict[str, str] = Field(default_factory=dict)  # "r0" -> measured vs reserved, when off by > 5 %
    healing_replicas: list[int] = Field(default_factory=list)  # replacements (or replicas added for load) being started
    retiring: list[int] = Field(default_factory=list)  # replicas drained before removal (load went down)
    engine_start_s: dict[str, float] = Field(default_factory=dict)  # "r0" -> seconds the engine itself took to start
    warm_up_s: dict[str, float] = Field(default_factory=dict)  # "r0" -> its first request
    loaded: dict[str, list[Loaded]] = Field(default_factory=dict)  # "r0" -> per rank: what vLLM loaded, read at start
    # --- lifecycle (``hive_apps/core/lifecycle.py``) ---
    resident: bool = True  # its plan's replicas hold reservations (False once parked, or asleep in place: then
    # each books only what its engine still holds, ``Reservation.residual_bytes``)
    sleep_mode: SleepMode | None = None  # how it sleeps (set while sleeping or waking)
    slept_at: float | None = None
    sleep_reason: str = ""
    cooling: str = ""  # asleep warm: why its kept processes are being stopped (another model needs the room)
    last_request_at: float | None = None  # as the engines last reported it (kept while parked)
    wake_requested_at: float | None = None
    wake_placement_s: float = 0.0
    wake_evicted: list[str] = Field(default_factory=list)
    wake_placed: bool = False  # this wake has its plan and reservations
    wake_failed_at: float | None = None  # a wake that could not place or start: held requests get 503
    last_wake: WakeReport | None = None
    woke_at: float | None = None  # when it last became ready after sleeping (minimum residency)
    destroy_reason: str = ""  # set while an idle model is removed; then status is destroyed
    origin: Origin = Origin.API  # api: POSTed; declared: listed in the hive's Serve config (``respec`` may change it)
    # why today's policy refuses its stored spec (set when the registry reads it back; never stored)
    policy_warning: str = Field(default="", exclude=True)

    @model_validator(mode="after")
    def _legal_state(self, info: ValidationInfo) -> ModelRecord:
        """A record built in an illegal state is refused. One read back from the KV loads as it was
        stored (quarantining a running model for a flag an older registry left would lose it);
        ``ModelBook._commit`` refuses to store an illegal state again."""
        if not (info.context or {}).get(STORED):
            self.check_state()
        return self

    @property
    def state(self) -> ModelState:
        """Its status and lifecycle flags as one typed state (``LEGAL`` says whether it may be)."""
        residency = _RESIDENCY.get((self.resident, self.sleep_mode, self.wake_placed))
        if residency is None:
            raise IllegalState(f"{self.model_id}: resident={self.resident}, sleep_mode="
                               f"{self.sleep_mode and self.sleep_mode.value}, wake_placed={self.wake_placed} "
                               "stand for no residency")
        starting, retiring = bool(self.healing_replicas), bool(self.retiring)
        replicas = (ReplicaChange.STARTING_AND_RETIRING if starting and retiring else ReplicaChange.STARTING
                    if starting else ReplicaChange.RETIRING if retiring else ReplicaChange.NONE)
        return ModelState(phase=self.status, residency=residency, replicas=replicas, destroy=bool(self.destroy_reason))

    def check_state(self) -> ModelState:
        """Its state, or ``IllegalState`` when that is not in ``LEGAL``."""
        state = self.state
        if not state.legal:
            raise IllegalState(f"{self.model_id}: {state.phase.value}, {state.residency.value}, replicas "
                               f"{state.replicas.value}{', destroy' if state.destroy else ''} is not a legal state")
        return state

    @classmethod
    def from_stored(cls, raw: bytes, settings: HiveSettings | None = None) -> ModelRecord:
        """A record as the registry stored it. Its spec was accepted when it was deployed, so one that
        today's policy (``settings``; None: the spec's shape only) or a stricter ModelSpec after an
        upgrade refuses keeps running, with the reason in ``policy_warning`` and its message, until an
        operator deletes it. Raises only when the record does not parse even without the spec's validators."""
        try:
            return cls.model_validate_json(raw, context={STORED: True, SETTINGS: settings})
        except ValidationError as e:
            refused = e
        try:
            stored = _StoredRecord.model_validate_json(raw, context={STORED: True})
        except ValidationError:
            raise refused from None
        spec = ModelSpec.model_construct(stored.spec.model_fields_set, **dict(stored.spec))
        rec = cls.model_construct(stored.model_fields_set, **{**dict(stored), "spec": spec})
        reasons = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in refused.errors())
        rec.policy_warning = (f"today's policy refuses its spec ({reasons}); it keeps running as deployed "
                              f"until DELETE /admin/models/{rec.model_id}")
        if rec.policy_warning not in rec.message:
            rec.message = rec.policy_warning + (f"; {rec.message}" if rec.message else "")
        return rec

    def books(self, r: Reservation) -> bool:
        """This record accounts for the reservation: a live replica, on the devices its plan gives it, of
        a model that holds its memory; or a level-1 sleeper's weights in that replica's host RAM."""
        rp = next((rp for rp in self.live_replicas if rp.index == r.replica), None)
        if rp is None or self.status in ENDED:
            return False
        if r.host:
            return self.sleep_mode is SleepMode.LEVEL1 and r.devices == [host_id(rp.node_name)]
        # asleep in place, its engine's residual stays booked on the replica's devices
        asleep = self.sleeps_in_place and r.state is ReservationState.ASLEEP
        return (self.resident or asleep) and r.devices == rp.devices

    @property
    def resident_since(self) -> float:
        return self.woke_at or self.ready_at or self.created_at

    @property
    def live_replicas(self) -> list[ReplicaPlan]:
        """The planned replicas whose node has not died."""
        return [rp for rp in self.plan.replicas if names.replica_label(rp.index) not in self.lost_replicas]

    @property
    def releasing(self) -> bool:
        """It still holds memory another model waits for: draining or dozing, or kept processes stopping."""
        return self.resident or bool(self.cooling)

    @property
    def sleeps_in_place(self) -> bool:
        """Its engines stay on their devices while it sleeps (vLLM sleep level 1 or 2, or warm)."""
        return self.sleep_mode is not None and self.sleep_mode.keeps_engine

    @property
    def holds_memory(self) -> bool:
        return self.resident and self.status in HOLDING


class AdapterRecord(BaseModel):
    """One LoRA adapter as the registry owns it (``POST /admin/adapters``): stored under its own key,
    served by its base's engines, which load it on demand (``serving/engine/adapters.py``)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model_id: str  # the adapter's name on /v1
    base: str  # the model_id of the model it runs on
    source: str  # as the deploy named it
    weights: Manifest  # the files and revision every replica loads (pinned at deploy)
    rank: int
    alpha: float
    target_modules: list[str]
    base_model_name: str | None = None  # adapter_config.json's base_model_name_or_path
    bytes: int = 0  # of its tensors
    version: int = 0  # the book's version when it was created: never the same twice (``ModelBook.create_adapter``)
    created_at: float = Field(default_factory=time.time)

    @property
    def revision_key(self) -> str:
        """What identifies this adapter's weights on an engine: a new deploy under the same name (or new
        files at the source) is another key, and the engine loads it again."""
        return f"{self.weights.key}@{self.weights.revision}@v{self.version}"


class AdapterDeletion(str, Enum):
    """What deleting a base does to its adapters."""

    REFUSE = "refuse"  # 409 while it has any (DELETE /admin/models/{id})
    CASCADE = "cascade"  # they go with it (?cascade=true, DELETE /admin/models)
    KEEP = "keep"  # they stay for the base that comes back (a recreate; a declared model dropped from the config)


# ModelSpec's fields and types without its validators or constraints: how a stored spec that today's
# policy refuses is still read (``ModelRecord.from_stored``)
_StoredSpec = create_model(  # type: ignore[call-overload]  # fields built at import
    "StoredSpec", __config__=ConfigDict(extra="ignore", protected_namespaces=()),
    **{name: (f.annotation, Field(default_factory=f.default_factory) if f.default_factory else f.default)
       for name, f in ModelSpec.model_fields.items()})
_StoredRecord = create_model("StoredModelRecord", __base__=ModelRecord, spec=(_StoredSpec, ...))


class _Bookings(BaseModel):
    """What a model's stored value holds beside its record (every other key is the record's)."""

    # None: a value stored before reservations moved into it (they were ``reservation/<key>`` keys then)
    reservations: list[Reservation] | None = None


@dataclass
class StoredModel:
    record: ModelRecord
    reservations: list[Reservation] | None  # None: stored by an older registry (read its reservation keys)


def dump_stored(rec: ModelRecord, reservations: list[Reservation]) -> bytes:
    """A model's KV value: the record's own JSON plus the reservations it books, so a reader of the
    record alone (``ModelRecord.from_stored``, an older registry) ignores them."""
    body = rec.model_dump(mode="json")
    body["reservations"] = [r.model_dump(mode="json") for r in reservations if r.model_id == rec.model_id]
    return json.dumps(body).encode()


def load_stored(raw: bytes, settings: HiveSettings | None = None) -> StoredModel:
    """A model's KV value read back (raises, like ``ModelRecord.from_stored``, when it does not parse)."""
    return StoredModel(ModelRecord.from_stored(raw, settings), _Bookings.model_validate_json(raw).reservations)
