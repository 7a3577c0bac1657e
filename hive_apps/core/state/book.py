"""Model records and their reservations, changed only by named transitions. Pure: no Ray.

The registry is the only writer of model records and reservations; the admin (and the
registry's own monitoring) ask it for transitions. Each transition names where it may start,
and callers other than the registry itself pass the record version they read: a transition
from a stale version, or from a status it does not start from, is refused with a
``TransitionError`` and the caller re-reads and decides again. So a node that dies while a
heal is in flight can never be overwritten by the healer's older copy of the record. Callers ask
for one with a typed message; ``core/state/transitions.py`` maps each onto its method below.

    transition    from                          to                      asked by
    create        (none) | failed               deploying               admin: POST /models
    applied       deploying | healing           (same)                  admin: app built for the plan
    started       deploying | healing           ready | degraded        admin: every live replica up
    fail          deploying                     failed                  admin: start failed or timed out
    heal          degraded (not retiring ones)  healing                 admin: replacements placed
    heal_failed   healing                       degraded                admin: a replacement failed
    note          any                           (same)                  admin: a message, a back-off
    delete        any (adapters on it: refused  deleting                admin: DELETE /models/{id}
                  unless cascade or kept)
    deleted       deleting                      (removed) | destroyed   admin: its engines stop (the app goes next)
    sleep         ready | degraded              sleeping, none retiring admin: idle past sleep_timeout, or evicted
    doze          sleeping (resident)           (same), level 1 or 2    admin: drained; its engines can sleep
    dozed         sleeping (level, resident)    (same), not resident    admin: its engines slept (what each
                                                (its residual booked)   still holds, measured)
    parked        sleeping | waking             (same), parked          admin: engines drained and removed
    wake          sleeping                      waking                  gateway, router: a request came
    placed        waking (not resident)         waking, resident        admin: planned (or room made in place)
    wake_failed   waking                        sleeping                admin: no room, or the engine failed
    destroy       ready | degraded | sleeping   deleting (destroying)   admin: idle past idle_timeout
    scale_up      ready                         scaling                 admin: every replica busy for a window
    scale_failed  scaling                       ready                   admin: the added replica did not start
    retire        ready                         (same), one retiring    admin: every replica idle for a window
    retired       ready | degraded (retiring)   one fewer; degraded     admin: it drained and its engine is gone
                                                only if others are lost
    respec        any but deleting | ended      (same), new spec        admin: PUT /models/{id}, declared models
                                                and origin              (only changes that need no new engines)
    create_adapter  (an adapter: the base any   an adapter record       admin: POST /adapters
                    but deleting | ended, lora)
    delete_adapter  (an adapter)                (removed)               admin: DELETE /adapters/{id}
    node_lost     any                           degraded where serving  registry: a node died (a retiring replica
                                                                        only waits for ``retired``)
    drift         any                           (same)                  registry: measured vs reserved
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from dataclasses import dataclass, field

from hive_apps.core import names
from hive_apps.core.planning.drift import Loaded
from hive_apps.core.planning.memory import sleep_residual_bytes, warm_residual_bytes
from hive_apps.core.planning.types import Plan, ReplicaPlan
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.changes import spec_change
from hive_apps.core.state.ledger import DeviceState, Ledger, ReservationError
from hive_apps.core.state.namespace import alias_conflict, holder_of
from hive_apps.core.state.records import (
    DORMANT,
    ENDED,
    SERVING,
    STARTING,
    AdapterDeletion,
    AdapterRecord,
    ModelRecord,
    ModelStatus,
    Origin,
    Reservation,
    ReservationState,
    SleepMode,
    StoredModel,
    WakeReport,
)

HEAL_BACKOFF_BASE_S = 2.0
ANY = tuple(ModelStatus)
RESPEC_FROM = tuple(s for s in ModelStatus if s not in ENDED and s is not ModelStatus.DELETING)


class TransitionError(Exception):
    """A refused transition: the record changed since it was read, or it is in the wrong status."""

    def __init__(self, message: str, status_code: int = 409):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass
class Change:
    """What one transition did, for the registry to persist (the record with ``reservations``: one KV
    write) and announce."""

    model_id: str
    record: ModelRecord | None  # None: the record was removed
    forgotten: list[str] = field(default_factory=list)  # reservation keys released by it
    # every reservation the model holds after the change, as the ledger had them then
    reservations: list[Reservation] = field(default_factory=list)
    # adapters it created, changed (the record) or removed (None), each stored under its own key
    adapters: dict[str, AdapterRecord | None] = field(default_factory=dict)
    model: bool = True  # it changed the model ``model_id`` (False: adapters only)


def heal_backoff_s(attempts: int, cap_s: float) -> float:
    """2 s, 4 s, 8 s... after each failed self-healing attempt in a row, at most ``cap_s``."""
    return min(cap_s, HEAL_BACKOFF_BASE_S * 2.0 ** max(0, attempts - 1))


def asleep_residual(rp: ReplicaPlan, measured: dict[str, int] | None = None, warm: bool = False) -> int:
    """What a replica asleep in place keeps booked on each of its devices: the most its engine measured
    on any of them once it slept, else the plan's estimate (``warm``: of its kept process); never more
    than its reservation (what is above it shows as foreign use), never less than 0."""
    on_its = [b for dev, b in (measured or {}).items() if dev in rp.devices]
    by_plan = warm_residual_bytes(rp) if warm else sleep_residual_bytes(rp)
    return min(rp.reservation_bytes, max(0, max(on_its) if on_its else by_plan))


class ModelBook:
    def __init__(self, ledger: Ledger, records: list[ModelRecord] | None = None,
                 adapters: list[AdapterRecord] | None = None):
        self.ledger = ledger
        self.records: dict[str, ModelRecord] = {r.model_id: r for r in records or []}
        self.adapters: dict[str, AdapterRecord] = {a.model_id: a for a in adapters or []}
        self.version = 0  # of the whole book: goes up with every change (watchers wait on it)

    # --- reading ----------------------------------------------------------------------------
    def get(self, model_id: str) -> ModelRecord | None:
        rec = self.records.get(model_id)
        return rec.model_copy(deep=True) if rec is not None else None

    def list(self) -> list[ModelRecord]:
        return [r.model_copy(deep=True) for r in sorted(self.records.values(), key=lambda r: r.created_at)]

    def get_adapter(self, model_id: str) -> AdapterRecord | None:
        rec = self.adapters.get(model_id)
        return rec.model_copy(deep=True) if rec is not None else None

    def list_adapters(self) -> builtins.list[AdapterRecord]:
        return [a.model_copy(deep=True) for a in sorted(self.adapters.values(), key=lambda a: a.created_at)]

    def adapters_of(self, base: str) -> builtins.list[str]:
        return sorted(a.model_id for a in self.adapters.values() if a.base == base)

    def device_states(self) -> builtins.list[DeviceState]:
        """Each device as the ledger sees it, plus what sleeping models would need back there
        (their last plan's reservation, less what an engine asleep in place still books: ``dormant``)."""
        states = {s.device.id: s for s in self.ledger.states()}
        for rec in self.records.values():
            if rec.status in DORMANT and not rec.resident:
                for rp in rec.plan.replicas:
                    key = names.replica_key(rec.model_id, rp.index)
                    booked = self.ledger.reservations.get(key)
                    need = rp.reservation_bytes - (booked.held_bytes if booked is not None else 0)
                    for dev in rp.devices:
                        if dev in states:
                            states[dev].dormant_bytes += need
                            states[dev].dormant.append(key)
        return list(states.values())

    def restore(self, stored: builtins.list[StoredModel], legacy: builtins.list[Reservation]) -> tuple[set[str], dict[str, str]]:
        """Rebuild the ledger at start from the stored models: each record's own reservations. A model
        an older registry stored takes its reservations from the ``reservation/`` keys it wrote beside
        the records (``legacy``), measured bytes and states as they were; any left unbooked (that layout
        wrote a change key by key, so a crash could leave one behind) is released. Returns the models
        whose stored value must be written again (older layout, or a reservation released) and what
        was released, with why."""
        own = {s.record.model_id: s.reservations for s in stored if s.reservations is not None}
        self.ledger.reservations = {r.key: r for r in legacy if r.model_id not in own}
        for model_id, rs in own.items():
            self.ledger.reservations.update({r.key: r for r in rs if r.model_id == model_id})
        owner = {k: r.model_id for k, r in self.ledger.reservations.items()}
        gone = self.release_unbooked()
        rewrite = {m for m in self.records if m not in own} | {owner[k] for k in gone}
        return rewrite & set(self.records), gone

    def snapshot(self, model_id: str) -> builtins.list[Reservation]:
        """Copies of what the model books now: what its stored value holds beside the record."""
        return [r.model_copy() for r in self.ledger.of_model(model_id)]

    def release_unbooked(self) -> dict[str, str]:
        """Free the reservations no record accounts for, and say why for each: a record quarantined
        with its reservations kept elsewhere, or reservations stored by an older registry, which wrote
        a change key by key (a crash between them could leave one behind a record that let it go)."""
        gone = {}
        for r in list(self.ledger.reservations.values()):
            rec = self.records.get(r.model_id)
            if rec is None or not rec.books(r):
                self.ledger.release_key(r.key)
                gone[r.key] = ("no record of its model" if rec is None
                               else f"its record ({rec.status.value}) does not hold it")
        return gone

    # --- helpers ----------------------------------------------------------------------------
    def _current(self, model_id: str, name: str, version: int | None, allowed: tuple[ModelStatus, ...]) -> ModelRecord:
        rec = self.records.get(model_id)
        if rec is None:
            raise TransitionError(f"{name}: no model {model_id!r}", 404)
        if version is not None and rec.version != version:
            raise TransitionError(f"{name}: the record of {model_id!r} changed (now version {rec.version}, "
                                  f"you read {version}); read it again and retry")
        if rec.status not in allowed:
            raise TransitionError(f"{name}: {model_id!r} is {rec.status.value}; {name} starts only from "
                                  + " | ".join(s.value for s in allowed))
        return rec.model_copy(deep=True)

    def _commit(self, rec: ModelRecord, forgotten: Iterable[str] = ()) -> Change:
        rec.check_state()  # a transition that leaves an illegal state (records.LEGAL) is a bug: never stored
        rec.version += 1
        self.records[rec.model_id] = rec
        self.version += 1
        return Change(rec.model_id, rec.model_copy(deep=True), list(forgotten), self.snapshot(rec.model_id))

    def _same(self, rec: ModelRecord) -> Change:
        """An idempotent transition that changed nothing (persisted again all the same)."""
        return Change(rec.model_id, rec.model_copy(deep=True), reservations=self.snapshot(rec.model_id))

    def _release(self, keys: builtins.list[str]) -> builtins.list[str]:
        return [k for k in keys if self.ledger.release_key(k) is not None]

    def _keys(self, model_id: str, indices: Iterable[int]) -> builtins.list[str]:
        return [names.replica_key(model_id, i) for i in indices]

    def _release_host(self, model_id: str) -> builtins.list[str]:
        """Free what a level-1 sleeper held in host RAM."""
        return self._release([r.key for r in self.ledger.of_model(model_id) if r.host])

    # --- transitions the admin asks for -------------------------------------------------------
    def create(self, record: ModelRecord, reservations: builtins.list[Reservation], now: float) -> Change:
        """A new deploy: the id must be free (or hold a failed deploy) and every replica must fit."""
        existing = self.records.get(record.model_id)
        if existing is not None and existing.status not in ENDED:
            raise TransitionError(f"model_id {record.model_id!r} is already {existing.status.value}; "
                                  "DELETE /admin/models/{id} first or choose another model_id")
        if record.model_id in self.adapters:
            raise TransitionError(f"model_id {record.model_id!r} is a LoRA adapter's name; DELETE "
                                  "/admin/adapters/{id} first or choose another model_id")
        conflict = alias_conflict(record.spec, self.records.values(), self.adapters.values())
        if conflict:
            raise TransitionError(conflict)
        try:
            self.ledger.reserve(reservations)
        except ReservationError as e:
            raise TransitionError(e.message, e.status_code) from None
        rec = record.model_copy(deep=True, update={
            # a new record starts past every version the book has given out, so a stale writer of an
            # earlier record under this id (deleted, then deployed again) can never match it
            "status": ModelStatus.DEPLOYING, "version": existing.version if existing else self.version,
            "created_at": now, "starting_since": now, "plan_generation": 1, "applied_generation": 0})
        return self._commit(rec)

    def applied(self, model_id: str, version: int, generation: int, now: float) -> Change:
        rec = self._current(model_id, "applied", version, STARTING)
        if generation != rec.plan_generation:
            raise TransitionError(f"applied: plan generation {generation} is not the current {rec.plan_generation}")
        rec.applied_generation, rec.applied_at = generation, now
        return self._commit(rec)

    def started(self, model_id: str, version: int, now: float, engine_start_s: dict[str, float] | None = None,
                warm_up_s: dict[str, float] | None = None, wake_s: dict[str, float] | None = None,
                loaded: dict[str, builtins.list[Loaded]] | None = None) -> Change:
        """Every replica that should run is up: reservations become active (``wake_s``: an engine
        that slept woke in place, and its host RAM is released)."""
        rec = self._current(model_id, "started", version, STARTING)
        if rec.applied_generation != rec.plan_generation:
            raise TransitionError("started: the app was not built from the current plan yet")
        if not rec.resident:
            raise TransitionError("started: the model is parked; it must be placed first")
        if rec.status is ModelStatus.DEPLOYING:
            rec.ready_at = now
        elif rec.status is ModelStatus.WAKING:
            self._woke(rec, wake_s or engine_start_s or {}, warm_up_s or {}, now)
        else:
            rec.heal_attempts, rec.next_heal_at = 0, 0.0
        forgotten = self._release_host(model_id)
        self.ledger.activate(model_id)
        rec.engine_start_s = {**rec.engine_start_s, **(engine_start_s or {})}
        rec.warm_up_s = {**rec.warm_up_s, **(warm_up_s or {})}
        rec.loaded = {**rec.loaded, **(loaded or {})}
        rec.healing_replicas = []
        rec.status = ModelStatus.DEGRADED if rec.lost_replicas else ModelStatus.READY
        rec.message = rec.message if rec.lost_replicas else ""
        return self._commit(rec, forgotten=forgotten)

    @staticmethod
    def _woke(rec: ModelRecord, engine_start_s: dict[str, float], warm_up_s: dict[str, float], now: float) -> None:
        requested = rec.wake_requested_at or now
        if rec.wake_placed:  # it was parked: record how the wake went
            rec.last_wake = WakeReport(
                how=rec.sleep_mode or SleepMode.PARKED, requested_at=requested, ready_at=now,
                placement_s=round(rec.wake_placement_s, 3),
                engine_start_s=max(engine_start_s.values(), default=None),
                warm_up_s=max(warm_up_s.values(), default=None),
                total_s=round(now - requested, 3), evicted=rec.wake_evicted)
        rec.woke_at = now
        rec.sleep_mode, rec.slept_at, rec.sleep_reason, rec.wake_placed = None, None, "", False

    def fail(self, model_id: str, version: int, reason: str) -> Change:
        """A deploy that cannot start: nothing stays reserved; the record says why."""
        rec = self._current(model_id, "fail", version, (ModelStatus.DEPLOYING,))
        forgotten = [r.key for r in self.ledger.release(model_id)]
        rec.status, rec.message, rec.healing_replicas = ModelStatus.FAILED, reason, []
        return self._commit(rec, forgotten=forgotten)

    def heal(self, model_id: str, version: int, replacements: builtins.list[ReplicaPlan], now: float) -> Change:
        """Replacements for lost replicas are placed: reserve them and move the plan, at once."""
        rec = self._current(model_id, "heal", version, (ModelStatus.DEGRADED,))
        indices = [rp.index for rp in replacements]
        not_lost = [i for i in indices if names.replica_label(i) not in rec.lost_replicas]
        if not indices or not_lost:
            raise TransitionError(f"heal: replicas {not_lost or indices} of {model_id!r} are not lost")
        if going := [i for i in indices if i in rec.retiring]:  # ``retired`` drops it: a replacement would
            # serve what load let go, and its loss would leave the model healing with nothing starting
            raise TransitionError(f"heal: {model_id!r} retires replicas {going}: a retiring replica is never replaced")
        new = [Reservation.for_replica(model_id, rp) for rp in replacements]
        try:
            self.ledger.reserve(new)
        except ReservationError as e:
            raise TransitionError(e.message, e.status_code) from None
        by_index = {rp.index: rp for rp in rec.plan.replicas}
        by_index.update({rp.index: rp for rp in replacements})
        rec.plan = rec.plan.model_copy(update={"replicas": [by_index[i] for i in sorted(by_index)]})
        rec.plan_generation += 1
        rec.placed_at.update({i: rec.plan_generation for i in indices})
        rec.status, rec.healing_replicas, rec.starting_since = ModelStatus.HEALING, sorted(indices), now
        for i in indices:
            rec.lost_replicas.pop(names.replica_label(i), None)
        rec.message = "replacing " + ", ".join(f"{names.replica_label(rp.index)} on {'+'.join(rp.devices)}"
                                               for rp in replacements)
        return self._commit(rec)

    def heal_failed(self, model_id: str, version: int, reason: str, now: float, backoff_cap_s: float) -> Change:
        """A replacement did not start: free it, mark it lost again and back off."""
        rec = self._current(model_id, "heal_failed", version, (ModelStatus.HEALING,))
        forgotten = self._release(self._keys(model_id, rec.healing_replicas))
        for i in rec.healing_replicas:
            rec.lost_replicas[names.replica_label(i)] = f"replacement failed: {reason}"
        rec.heal_attempts += 1
        wait = heal_backoff_s(rec.heal_attempts, backoff_cap_s)
        rec.next_heal_at = now + wait
        rec.status, rec.healing_replicas = ModelStatus.DEGRADED, []
        rec.message = f"self-healing failed (attempt {rec.heal_attempts}, next in {wait:.0f}s): {reason}"
        return self._commit(rec, forgotten=forgotten)

    def note(self, model_id: str, version: int, message: str, next_heal_at: float | None = None) -> Change:
        rec = self._current(model_id, "note", version, ANY)
        rec.message = message
        if next_heal_at is not None:
            rec.next_heal_at = next_heal_at
        return self._commit(rec)

    def delete(self, model_id: str, adapters: AdapterDeletion = AdapterDeletion.REFUSE) -> Change:
        """Delete wins over anything in flight: no version check; deleting twice is one delete. A base
        with adapters: refused (409), or its adapters removed with it (``cascade``), or kept (``keep``)."""
        rec = self._current(model_id, "delete", None, ANY)
        on_it = self.adapters_of(model_id)
        if on_it and adapters is AdapterDeletion.REFUSE:
            raise TransitionError(f"delete: {model_id!r} serves the LoRA adapters {on_it}; DELETE them first "
                                  "(DELETE /admin/adapters/{id}) or delete them with it (?cascade=true)")
        gone: dict[str, AdapterRecord | None] = {}
        if adapters is AdapterDeletion.CASCADE:
            for a in on_it:
                del self.adapters[a]
                gone[a] = None
        if rec.status is ModelStatus.DELETING and not rec.destroy_reason:
            change = self._same(rec)
            self.version += 1 if gone else 0  # followers must see the adapters go
        else:
            rec.status, rec.message, rec.destroy_reason = ModelStatus.DELETING, "stopping its engines, then releasing its reservations", ""
            change = self._commit(rec)
        change.adapters = gone
        return change

    # --- LoRA adapters --------------------------------------------------------------------
    def create_adapter(self, record: AdapterRecord, now: float) -> Change:
        """A new adapter on a base that serves LoRA: its name must be free among models and adapters."""
        name, base = record.model_id, record.base
        if name in self.adapters:
            raise TransitionError(f"create_adapter: {name!r} is already an adapter (on {self.adapters[name].base!r}); "
                                  "DELETE /admin/adapters/{id} first or choose another model_id")
        model = self.records.get(name)
        if model is not None and model.status not in ENDED:
            raise TransitionError(f"create_adapter: {name!r} is a model's name; choose another model_id")
        holder = holder_of(name, self.records.values(), ())
        if holder is not None:
            raise TransitionError(f"create_adapter: {name!r} is taken by {holder}; choose another model_id")
        rec = self.records.get(base)
        if rec is None or rec.status in ENDED:
            raise TransitionError(f"create_adapter: no model {base!r} to serve it; GET /admin/models lists them", 404)
        if rec.status is ModelStatus.DELETING:
            raise TransitionError(f"create_adapter: {base!r} is being deleted")
        if rec.spec.lora is None:
            raise TransitionError(f"create_adapter: {base!r} was deployed without lora", 422)
        self.version += 1
        stored = record.model_copy(deep=True, update={"created_at": now, "version": self.version})
        self.adapters[name] = stored
        return Change(name, None, adapters={name: stored.model_copy(deep=True)}, model=False)

    def delete_adapter(self, model_id: str) -> Change:
        if model_id not in self.adapters:
            raise TransitionError(f"delete_adapter: no adapter {model_id!r}; GET /admin/adapters lists them", 404)
        del self.adapters[model_id]
        self.version += 1
        return Change(model_id, None, adapters={model_id: None}, model=False)

    def deleted(self, model_id: str, version: int) -> Change:
        rec = self._current(model_id, "deleted", version, (ModelStatus.DELETING,))
        forgotten = [r.key for r in self.ledger.release(model_id)]
        if rec.destroy_reason:  # destroyed for idleness: the record stays to tell later requests
            rec.status, rec.message, rec.resident = ModelStatus.DESTROYED, rec.destroy_reason, False
            rec.sleep_mode = None
            change = self._commit(rec, forgotten=forgotten)
            return change
        del self.records[model_id]
        self.version += 1
        return Change(model_id, None, forgotten=forgotten)

    # --- lifecycle (``hive_apps/core/lifecycle.py`` decides; these record) --------------------------
    def sleep(self, model_id: str, version: int, reason: str, now: float, last_request_at: float | None = None) -> Change:
        """Start putting a serving model to sleep: routers hold new requests from now on. How it
        sleeps is decided once it drained (``doze``: in place, level 1 or 2; else ``parked``)."""
        rec = self._current(model_id, "sleep", version, (ModelStatus.READY, ModelStatus.DEGRADED))
        if not rec.spec.can_sleep:
            raise TransitionError(f"sleep: {model_id!r} has no sleep_timeout", 422)
        rec.status, rec.sleep_mode, rec.slept_at, rec.sleep_reason = ModelStatus.SLEEPING, None, now, reason
        rec.retiring = []  # a pending scale-down is moot: it wakes with the replicas it needs then
        rec.last_request_at = last_request_at if last_request_at is not None else rec.last_request_at
        rec.wake_failed_at, rec.message = None, f"going to sleep ({reason}): draining"
        return self._commit(rec)

    def doze(self, model_id: str, version: int, warm: bool = False) -> Change:
        """Its drained engines can sleep in place (vLLM sleep mode): level 1 when the host RAM of
        every replica's node can hold its weights (reserved there now, before they move), else
        level 2 (weights discarded, nothing held). ``warm``: they have no sleep mode; vLLM stops in
        their kept processes (nothing moves to host RAM). Its device memory stays reserved until ``dozed``."""
        rec = self._current(model_id, "doze", version, (ModelStatus.SLEEPING,))
        if not rec.resident or rec.sleep_mode is not None:
            raise TransitionError(f"doze: {model_id!r} is not a drained, resident model deciding how to sleep")
        if warm:
            rec.sleep_mode = SleepMode.WARM
            rec.message = "going to sleep warm: vLLM stops, its replicas' processes stay for the next wake"
            return self._commit(rec)
        live = rec.live_replicas
        host = [Reservation.on_host(model_id, rp) for rp in live]
        try:
            self.ledger.reserve(host)
            rec.sleep_mode = SleepMode.LEVEL1
            nodes = sorted({rp.node_name for rp in live})
            rec.message = f"going to sleep at level 1: weights to the host RAM of {', '.join(nodes)}"
        except ReservationError as e:
            rec.sleep_mode = SleepMode.LEVEL2
            rec.message = f"going to sleep at level 2 (weights discarded): {e.message}"
        return self._commit(rec)

    def dozed(self, model_id: str, version: int, now: float,
              residuals: dict[int, dict[str, int]] | None = None) -> Change:
        """Its engines sleep: their device memory is free (the weights of level 1 are in host RAM) but
        for what each still holds there, which stays booked (``asleep_residual``): what it measured
        (``residuals``: replica index -> device id -> bytes), by plan where it measured nothing."""
        rec = self._current(model_id, "dozed", version, (ModelStatus.SLEEPING,))
        if not rec.resident or not rec.sleeps_in_place:
            raise TransitionError(f"dozed: {model_id!r} is not dozing")
        live = {rp.index: rp for rp in rec.live_replicas}
        devices = [r for r in self.ledger.of_model(model_id) if not r.host]
        forgotten = self._release([r.key for r in devices if r.replica not in live])
        self.ledger.activate(model_id)  # level 1: its weights are in host RAM now
        for r in devices:
            if r.replica in live:
                self.ledger.doze(r.key, asleep_residual(live[r.replica], (residuals or {}).get(r.replica),
                                                        rec.sleep_mode is SleepMode.WARM))
        rec.resident, rec.drift = False, {}
        assert rec.sleep_mode is not None  # sleeps_in_place: it has one
        rec.message = (f"sleeping ({rec.sleep_mode.value}): {rec.sleep_reason}; "  # since when: slept_at, a machine field
                       "the next request wakes it in place")
        return self._commit(rec, forgotten=forgotten)

    def cool(self, model_id: str, version: int, reason: str) -> Change:
        """A model asleep warm must stop its kept processes (``reason``: who needs what they hold); the
        reconciler parks it, which releases their memory. Idempotent."""
        rec = self._current(model_id, "cool", version, (ModelStatus.SLEEPING,))
        if rec.resident or rec.sleep_mode is not SleepMode.WARM:
            raise TransitionError(f"cool: {model_id!r} is not asleep warm")
        if rec.cooling:
            return self._same(rec)
        rec.cooling, rec.message = reason, f"sleeping (warm): its processes stop ({reason})"
        return self._commit(rec)

    def parked(self, model_id: str, now: float) -> Change:
        """Its engines are gone: release what they held, host RAM included. Idempotent."""
        rec = self._current(model_id, "parked", None, (ModelStatus.SLEEPING, ModelStatus.WAKING))
        if not rec.resident and rec.sleep_mode is SleepMode.PARKED:
            return self._same(rec)
        forgotten = [r.key for r in self.ledger.release(model_id)]
        rec.resident, rec.lost_replicas, rec.healing_replicas, rec.retiring, rec.drift = False, {}, [], [], {}
        rec.sleep_mode, rec.wake_placed, rec.cooling = SleepMode.PARKED, False, ""
        if rec.status is ModelStatus.SLEEPING:
            rec.message = f"sleeping (parked): {rec.sleep_reason}; the next request wakes it"
        else:
            rec.message = "waking: starting its engines again (parked)"
        return self._commit(rec, forgotten=forgotten)

    def wake(self, model_id: str, now: float) -> Change:
        """A request came for a sleeping model. Idempotent: waking or serving models stay as they are."""
        rec = self.records.get(model_id)
        if rec is None:
            raise TransitionError(f"wake: no model {model_id!r}", 404)
        if rec.status is not ModelStatus.SLEEPING:
            if rec.status in (*SERVING, ModelStatus.WAKING, ModelStatus.DEPLOYING):
                return self._same(rec)
            raise TransitionError(f"wake: {model_id!r} is {rec.status.value}: {rec.message}")
        rec = rec.model_copy(deep=True)
        rec.status, rec.wake_requested_at, rec.starting_since = ModelStatus.WAKING, now, now
        rec.wake_evicted, rec.wake_placement_s, rec.wake_failed_at, rec.wake_placed = [], 0.0, None, False
        rec.cooling = ""  # its kept processes serve again: whoever wanted them stopped makes room anew
        rec.message = ("waking: it had not gone to sleep yet" if rec.resident else
                       "waking: placing its replicas" if rec.sleep_mode is SleepMode.PARKED else
                       "waking: starting vLLM again in its kept processes" if rec.sleep_mode is SleepMode.WARM else
                       "waking: taking its memory back in place")
        return self._commit(rec)

    def placed(self, model_id: str, version: int, plan: Plan, reservations: builtins.list[Reservation],
               placement_s: float, evicted: builtins.list[str], now: float) -> Change:
        """A model that wakes holds its memory again: where it was planned now (parked), or on the
        devices its sleeping engines are on (level 1 or 2: the same plan)."""
        rec = self._current(model_id, "placed", version, (ModelStatus.WAKING,))
        if rec.resident:
            raise TransitionError(f"placed: {model_id!r} still holds its memory (not parked)")
        in_place = rec.sleeps_in_place
        if in_place and [rp.devices for rp in plan.replicas] != [rp.devices for rp in rec.plan.replicas]:
            raise TransitionError(f"placed: {model_id!r} sleeps in place; it wakes only on its own devices")
        if not in_place:
            rec.plan, rec.plan_generation = plan, rec.plan_generation + 1
            rec.placed_at = {rp.index: rec.plan_generation for rp in plan.replicas}
        rec.resident, rec.wake_placed, rec.starting_since = True, True, now
        # exactly one booking per live replica, on its devices: a replica lost while it slept in
        # place has no engine to wake (park it and place it again), and a booking the record does
        # not hold would stay behind (and block healing that replica) until a restart freed it
        live = self._keys(model_id, [rp.index for rp in rec.live_replicas])
        if sorted(r.key for r in reservations) != sorted(live) or not all(rec.books(r) for r in reservations):
            raise TransitionError(f"placed: the reservations of {model_id!r} are not one per live replica of "
                                  f"its plan ({', '.join(live)}), on their devices")
        try:
            self.ledger.reserve(reservations)
        except ReservationError as e:
            raise TransitionError(e.message, e.status_code) from None
        rec.wake_placement_s, rec.wake_evicted = placement_s, list(evicted)
        rec.message = ("waking: " + ("waking its engines on " if in_place else "starting ")
                       + ", ".join(f"{names.replica_label(rp.index)} on {'+'.join(rp.devices)}" for rp in plan.replicas))
        return self._commit(rec)

    def wake_failed(self, model_id: str, version: int, reason: str, now: float) -> Change:
        """No room, or its engine did not start: back to sleep; held requests get 503. An engine
        asleep in place keeps sleeping (and its weights in host RAM); a parked one holds nothing."""
        rec = self._current(model_id, "wake_failed", version, (ModelStatus.WAKING,))
        in_place = rec.sleeps_in_place
        if in_place:  # its engines sleep on, keeping their residual (by plan for one woken before it slept)
            live = {rp.index: rp for rp in rec.live_replicas}
            devices = [r for r in self.ledger.of_model(model_id) if not r.host]
            forgotten = self._release([r.key for r in devices if r.replica not in live])
            for r in devices:
                if r.replica in live and r.state is not ReservationState.ASLEEP:
                    kept = r.residual_bytes if r.state is ReservationState.WAKING else \
                        asleep_residual(live[r.replica], warm=rec.sleep_mode is SleepMode.WARM)
                    self.ledger.doze(r.key, kept)
        else:
            forgotten = [r.key for r in self.ledger.release(model_id)]
        rec.status, rec.resident, rec.wake_failed_at, rec.wake_placed = ModelStatus.SLEEPING, False, now, False
        if not in_place:  # parked now, as ``parked`` leaves it: the next wake places every replica anew,
            # so none may stay lost (its new placement would hold a reservation its record does not book)
            rec.lost_replicas, rec.healing_replicas, rec.retiring, rec.drift = {}, [], [], {}
        rec.sleep_mode = rec.sleep_mode or SleepMode.PARKED
        rec.message = f"sleeping; the last wake failed: {reason}"
        return self._commit(rec, forgotten=forgotten)

    def destroy(self, model_id: str, version: int, reason: str) -> Change:
        """Remove an idle model's apps and memory but keep its record, so requests learn why."""
        rec = self._current(model_id, "destroy", version, (ModelStatus.READY, ModelStatus.DEGRADED, ModelStatus.SLEEPING))
        rec.status, rec.destroy_reason = ModelStatus.DELETING, reason
        rec.message = f"destroying: {reason}"
        return self._commit(rec)

    # --- load-driven replicas ---------------------------------------------------------------
    def scale_up(self, model_id: str, version: int, replica: ReplicaPlan, now: float) -> Change:
        """One more replica, placed where the planner put it: reserve it and extend the plan."""
        rec = self._current(model_id, "scale_up", version, (ModelStatus.READY,))
        if rec.retiring or replica.index in {rp.index for rp in rec.plan.replicas}:
            raise TransitionError(f"scale_up: {model_id!r} is retiring a replica, or r{replica.index} exists")
        new = Reservation.for_replica(model_id, replica)
        try:
            self.ledger.reserve([new])
        except ReservationError as e:
            raise TransitionError(e.message, e.status_code) from None
        rec.plan = rec.plan.model_copy(update={"replicas": [*rec.plan.replicas, replica]})
        rec.plan_generation += 1
        rec.placed_at[replica.index] = rec.plan_generation
        rec.status, rec.healing_replicas, rec.starting_since = ModelStatus.SCALING, [replica.index], now
        rec.message = f"scaling up: starting {names.replica_label(replica.index)} on {'+'.join(replica.devices)}"
        return self._commit(rec)

    def _without(self, rec: ModelRecord, indices: builtins.list[int]) -> builtins.list[str]:
        """Drop replicas from the plan (their app was already rebuilt without them) and free them."""
        rec.plan = rec.plan.model_copy(update={"replicas": [rp for rp in rec.plan.replicas if rp.index not in indices]})
        rec.plan_generation += 1
        rec.applied_generation = rec.plan_generation
        for i in indices:
            rec.placed_at.pop(i, None)
            rec.engine_start_s.pop(names.replica_label(i), None)
            rec.warm_up_s.pop(names.replica_label(i), None)
        return self._release(self._keys(rec.model_id, indices))

    def scale_failed(self, model_id: str, version: int, reason: str) -> Change:
        rec = self._current(model_id, "scale_failed", version, (ModelStatus.SCALING,))
        forgotten = self._without(rec, rec.healing_replicas)
        rec.status = ModelStatus.DEGRADED if rec.lost_replicas else ModelStatus.READY
        rec.healing_replicas, rec.message = [], f"could not add a replica for load: {reason}"
        return self._commit(rec, forgotten=forgotten)

    def retire(self, model_id: str, version: int, index: int) -> Change:
        """Routers stop sending to this replica from now on; the admin drains and removes it."""
        rec = self._current(model_id, "retire", version, (ModelStatus.READY,))
        if index not in {rp.index for rp in rec.plan.replicas} or len(rec.plan.replicas) - len(rec.retiring) <= 1:
            raise TransitionError(f"retire: {model_id!r} has no replica r{index} to spare")
        rec.retiring = sorted({*rec.retiring, index})
        rec.message = f"scaling down: draining {names.replica_label(index)}"
        return self._commit(rec)

    def retired(self, model_id: str, version: int) -> Change:
        """The retiring replicas are gone from the app: drop them from the plan, lost ones too (their
        node died while they drained: they were going anyway, so self-healing never brings them back)."""
        rec = self._current(model_id, "retired", version, (ModelStatus.READY, ModelStatus.DEGRADED))
        if not rec.retiring:
            raise TransitionError(f"retired: {model_id!r} retires no replica")
        done = [names.replica_label(i) for i in rec.retiring]
        forgotten = self._without(rec, rec.retiring)
        for label in done:
            rec.lost_replicas.pop(label, None)
        rec.status = ModelStatus.DEGRADED if rec.lost_replicas else ModelStatus.READY
        rec.retiring, rec.message = [], f"scaled down: removed {', '.join(done)}"
        return self._commit(rec, forgotten=forgotten)

    # --- settings ---------------------------------------------------------------------------------
    def respec(self, model_id: str, version: int, spec: ModelSpec, origin: Origin) -> Change:
        """New settings that take effect in place (``core/state/changes.py``: what the lifecycle loop and
        the routers read from the record), and who asked for the model (``origin``)."""
        rec = self._current(model_id, "respec", version, RESPEC_FROM)
        if spec.model_id != model_id:
            raise TransitionError(f"respec: the spec is of {spec.model_id!r}, not {model_id!r}", 422)
        restart = spec_change(rec, spec).restart
        if restart:
            raise TransitionError(f"respec: {', '.join(restart)} of {model_id!r} cannot change in place: "
                                  + "; ".join(f"{f}: {why}" for f, why in restart.items()))
        conflict = alias_conflict(spec, self.records.values(), self.adapters.values())
        if conflict:
            raise TransitionError(f"respec: {conflict}")
        rec.spec, rec.origin = spec, origin
        return self._commit(rec)

    # --- transitions the registry makes itself --------------------------------------------------
    def node_lost(self, dead_node_ids: set[str], dead_names: set[str], alive_names: set[str]) -> builtins.list[Change]:
        """Free what replicas on dead nodes held and mark them lost.

        A replica is on a dead node when the Ray node it was placed on is dead, even if a new
        node has joined under the same name; old reservations without a node id go by name.
        """
        changes: dict[str, Change] = {}
        for r in self.ledger.on_nodes(dead_names - alive_names, dead_node_ids):
            self.ledger.release_key(r.key)
            rec = self.records.get(r.model_id)
            if rec is None:
                changes.setdefault(r.model_id, Change(r.model_id, None)).forgotten.append(r.key)
                continue
            rec = rec.model_copy(deep=True)
            label = names.replica_label(r.replica)
            rec.lost_replicas[label] = f"node of {', '.join(r.devices)} died"
            rec.healing_replicas = [i for i in rec.healing_replicas if i != r.replica]
            going = r.replica in rec.retiring  # draining to go: ``retired`` drops it from the plan, nothing heals it
            if not going and (rec.status is ModelStatus.READY or (
                    rec.status in (ModelStatus.HEALING, ModelStatus.SCALING) and not rec.healing_replicas)):
                rec.status = ModelStatus.DEGRADED
            if rec.status in SERVING or rec.status is ModelStatus.DEPLOYING:
                rec.message = f"lost replicas {sorted(rec.lost_replicas)}: their node died; reservations released"
            change = self._commit(rec, forgotten=[r.key])
            if r.model_id in changes:
                change.forgotten = changes[r.model_id].forgotten + change.forgotten
            changes[r.model_id] = change
        return list(changes.values())

    def drift(self, drifted: dict[str, float]) -> builtins.list[Change]:
        """Show in each model's status where an engine uses > 5 % more or less than reserved."""
        out = []
        for rec in list(self.records.values()):
            now = {}
            for r in self.ledger.of_model(rec.model_id):
                if r.key in drifted:
                    assert r.measured_bytes is not None  # drift is measured
                    now[names.replica_label(r.replica)] = (
                        f"{drifted[r.key]:+.0%}: measured {r.measured_bytes / 2**30:.2f} GiB "
                        f"vs reserved {r.bytes_per_device / 2**30:.2f} GiB")
            if now != rec.drift:
                rec = rec.model_copy(deep=True)
                rec.drift = now
                out.append(self._commit(rec))
        return out

    def rebuild_reservations(self, measured: dict[str, int | None]) -> builtins.list[Reservation]:
        """The reservations the records imply: every replica of a model that holds memory,
        except lost ones; active where the engine is up (left pending, they would expire). A replica
        asleep in place books its residual: as booked before, else by plan."""
        residual = {k: r.residual_bytes for k, r in self.ledger.reservations.items() if r.state is ReservationState.ASLEEP}
        self.ledger.reservations.clear()
        for rec in self.records.values():
            if rec.status in DORMANT and not rec.resident and rec.sleeps_in_place:
                for rp in rec.live_replicas:
                    key = names.replica_key(rec.model_id, rp.index)
                    r = Reservation.for_replica(rec.model_id, rp, measured.get(key))
                    r.state, r.residual_bytes = ReservationState.ASLEEP, residual.get(
                        key, asleep_residual(rp, warm=rec.sleep_mode is SleepMode.WARM))
                    self.ledger.reservations[r.key] = r
            if not rec.holds_memory:
                continue
            for rp in rec.live_replicas:
                r = Reservation.for_replica(rec.model_id, rp, measured.get(names.replica_key(rec.model_id, rp.index)))
                if (rec.status in SERVING or rec.status is ModelStatus.SLEEPING) and rp.index not in rec.healing_replicas:
                    r.state = ReservationState.ACTIVE
                self.ledger.reservations[r.key] = r
        for rec in self.records.values():  # level-1 sleepers' weights in host RAM
            if rec.status in DORMANT and rec.sleep_mode is SleepMode.LEVEL1:
                for r in (Reservation.on_host(rec.model_id, rp) for rp in rec.live_replicas):
                    if not rec.resident:  # dozed: the weights are there (else they may still be moving)
                        r.state = ReservationState.ACTIVE
                    self.ledger.reservations[r.key] = r
        self.version += 1
        return list(self.ledger.reservations.values())
