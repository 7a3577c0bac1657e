"""The admin's lifecycle loop: reads what models that can sleep are doing, and asks the registry
to put idle ones to sleep or destroy them; makes room for a model that must wake or deploy.

The rules are pure (``hive_apps/core/lifecycle.py``); this is the shell that reads engines (their
own ``load()``: requests taken, last request, in flight) and the registry, and asks for the
transitions ``sleep``, ``destroy``. The reconciler then drains and parks (``control/admin/reconciler.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from pydantic import BaseModel

from hive_apps.control.cluster import Cluster, ControlPlane
from hive_apps.control.planner import PlanOutcome
from hive_apps.core import names
from hive_apps.core.lifecycle import (
    Activity,
    Candidate,
    Refusal,
    ScaleClock,
    choose_victims,
    cold_start_s,
    destroy_due,
    eviction_order,
    idle_since,
    protection_ends,
    replica_to_retire,
    scale_decision,
    sleep_due,
    update_activity,
)
from hive_apps.core.planning.memory import sleep_residual_bytes, warm_residual_bytes
from hive_apps.core.planning.types import DeviceCapacity, Plan, ReplicaPlan
from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import EngineKind, ModelSpec
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import SERVING, ModelRecord, ModelStatus, SleepMode
from hive_apps.core.weights.types import Manifest
from hive_apps.serving.engine.protocol import EngineLoad, TTFTHistogram

log = logging.getLogger("ray.serve")

LOAD_TIMEOUT_S = 2.0


class ReplicaLoad(BaseModel):
    running: int
    waiting: int
    capacity: int  # planned max_num_seqs
    kv_cache_usage: float
    requests_total: int = 0  # taken since its engine started (the admin's history counts per minute from it)
    prompt_tokens_total: int = 0  # and these, as its engine reports them (EngineLoad): tokens/s and p50 TTFT
    generation_tokens_total: int = 0
    ttft: TTFTHistogram = TTFTHistogram()
    adapters: list[str] = []  # LoRA adapters its engine holds now (GET /admin/adapters: loaded_on)


class Room(BaseModel):
    """The answer to "where can this model go": a plan, or the models being put to sleep for it
    (try again once they are parked), or why nothing can be done now."""

    plan: Plan | None = None
    evicting: list[str] = []  # put to sleep for this model just now
    waiting_for: list[str] = []  # every model whose parking it waits for (the evicted ones included)
    retry_at: float | None = None  # a minimum residency ends then: try again
    blocked: bool = False  # room could be made once requests in flight (or protections) end
    error: str = ""
    status_code: int = 200


def fits_in_place(plan: Plan, devices: list[DeviceCapacity]) -> PlanOutcome:
    """Whether the memory of engines asleep on their devices can be booked there again."""
    need: dict[str, int] = {}
    for rp in plan.replicas:
        for dev in rp.devices:
            need[dev] = need.get(dev, 0) + rp.reservation_bytes
    available = {d.device.id: d.available_bytes for d in devices}
    short = [f"{dev} needs {n / 2**30:.2f} GiB, has {available.get(dev, 0) / 2**30:.2f} GiB available"
             for dev, n in sorted(need.items()) if available.get(dev, 0) < n]
    if short:
        return PlanOutcome(status_code=503, error="its engines sleep in place and their devices are full: "
                                                  + "; ".join(short))
    return PlanOutcome(plan=plan)


def with_freed(devices: list[DeviceCapacity], freed: dict[str, int]) -> list[DeviceCapacity]:
    """The devices as if ``freed`` bytes (device id -> bytes) were back on them."""
    if not freed:
        return devices
    return [d.model_copy(update={"available_bytes": d.available_bytes + freed.get(d.device.id, 0),
                                 "free_bytes": d.free_bytes + freed.get(d.device.id, 0)}) for d in devices]


class Lifecycle(ControlPlane):
    def __init__(self, cluster: Cluster, settings: HiveSettings, clock: Callable[[], float] = time.time):
        self.clock = clock  # wall time, as the registry stamps records with it
        self.cluster = cluster
        self.settings = settings
        self.activity: dict[str, Activity] = {}
        self.clocks: dict[str, ScaleClock] = {}  # load-driven replicas: since when all are busy / idle
        self._handles: dict[tuple[str, int, int], Any] = {}

    # --- activity ---------------------------------------------------------------------
    def _handle(self, rec: ModelRecord, index: int) -> Any:
        key = (rec.model_id, index, rec.placed_at.get(index, 0))
        if key not in self._handles:
            self._handles[key] = self.cluster.engine_handle(rec.model_id, index)
        return self._handles[key]

    async def read(self, rec: ModelRecord, now: float, indices: list[int] | None = None) -> Activity | None:
        """Sum the engines' own counts; None when some replica does not answer (no decision then).
        ``indices``: only these replicas (a drain of one), not folded into the model's activity."""
        live = indices if indices is not None else [rp.index for rp in rec.live_replicas]
        loads = await self._loads(rec, live)
        failed = next((ld for ld in loads if isinstance(ld, Exception)), None)
        if failed is not None:
            log.info("activity of %s not readable now: %s", rec.model_id, failed)
            return None
        ready = cast(list[EngineLoad], loads)  # no exception among them
        in_flight = sum(max(ld.in_flight, ld.running + ld.waiting) for ld in ready)
        last = max((ld.last_request_at for ld in ready if ld.last_request_at is not None), default=None)
        pressures = {i: (ld.running + ld.waiting) / max(1, ld.max_num_seqs) for i, ld in zip(live, ready)}
        prev = self.activity.get(rec.model_id) if indices is None else None
        act = update_activity(prev, in_flight, sum(ld.requests_total for ld in ready), last, now, pressures)
        if indices is None:
            self.activity[rec.model_id] = act
        return act

    async def replica_loads(self, rec: ModelRecord) -> dict[str, ReplicaLoad]:
        """Each live replica's load now, against its planned capacity (for ``GET /admin/load``);
        a replica that does not answer within the timeout is left out."""
        live = [rp for rp in rec.plan.replicas
                if names.replica_label(rp.index) not in rec.lost_replicas and rp.index not in rec.healing_replicas]
        loads = await self._loads(rec, [rp.index for rp in live])
        return {names.replica_label(rp.index): ReplicaLoad(running=ld.running, waiting=ld.waiting,
                                                           capacity=rp.settings.max_num_seqs,
                                                           kv_cache_usage=ld.kv_cache_usage,
                                                           requests_total=ld.requests_total,
                                                           prompt_tokens_total=ld.prompt_tokens_total,
                                                           generation_tokens_total=ld.generation_tokens_total,
                                                           ttft=ld.ttft, adapters=ld.adapters)
                for rp, ld in zip(live, loads) if not isinstance(ld, Exception)}

    async def _loads(self, rec: ModelRecord, indices: list[int]) -> list[EngineLoad | Exception]:
        """Each of these replicas' own ``load()``, or why it did not answer within LOAD_TIMEOUT_S."""
        return await asyncio.gather(*(asyncio.wait_for(self._handle(rec, i).load.remote(), LOAD_TIMEOUT_S)
                                      for i in indices), return_exceptions=True)

    def forget(self, keep: set[str]) -> None:
        for model_id in set(self.activity) - keep:
            del self.activity[model_id]
        self._handles = {k: h for k, h in self._handles.items() if k[0] in keep}

    # --- sleep and destroy --------------------------------------------------------------
    async def tick(self, records: list[ModelRecord]) -> list[str]:
        """One look at every model that has a timeout; the ids it asked transitions for."""
        now, asked = self.clock(), []
        self.forget({r.model_id for r in records if r.status in SERVING and r.resident})
        self.clocks = {k: c for k, c in self.clocks.items() if k in self.activity}
        for rec in records:
            spec = rec.spec
            if spec.sleep_timeout is None and spec.idle_timeout is None and spec.replica_bounds is None:
                continue
            if rec.status in (ModelStatus.READY, ModelStatus.DEGRADED) and rec.resident:
                act = await self.read(rec, now)
                if act is None:
                    continue
                if rec.status is ModelStatus.READY and spec.replica_bounds and not rec.retiring \
                        and await self._scale(rec, act, now):
                    asked.append(rec.model_id)
                    continue
                since = idle_since(act.last_request_at, rec.resident_since)
                if destroy_due(spec.idle_timeout, since, act.in_flight, now):
                    await self._ask(t.Destroy(model_id=rec.model_id, version=rec.version, reason=self._idle_reason(spec, since, now)))
                    asked.append(rec.model_id)
                elif sleep_due(spec.sleep_timeout, since, act.in_flight, now):
                    assert since is not None  # sleep_due: it has one
                    await self._ask(t.Sleep(model_id=rec.model_id, version=rec.version, last_request_at=since,
                                    reason=f"no requests for {now - since:.0f}s (sleep_timeout {spec.sleep_timeout:g}s)"))
                    asked.append(rec.model_id)
            elif rec.status is ModelStatus.SLEEPING and not rec.resident:
                since = idle_since(rec.last_request_at, rec.resident_since, rec.wake_requested_at)
                if destroy_due(spec.idle_timeout, since, 0, now):
                    await self._ask(t.Destroy(model_id=rec.model_id, version=rec.version, reason=self._idle_reason(spec, since, now)))
                    asked.append(rec.model_id)
        return asked

    async def _scale(self, rec: ModelRecord, act: Activity, now: float) -> bool:
        """Add or retire one replica when load stayed high or low for the window (docs/lifecycle.md)."""
        assert rec.spec.replica_bounds is not None  # only a model with bounds scales
        step, self.clocks[rec.model_id] = scale_decision(list(act.pressures.values()), rec.spec.replica_bounds,
                                                         self.clocks.get(rec.model_id, ScaleClock()), now,
                                                         self.settings.scale_window_s)
        if step < 0:
            return (await self._ask(t.Retire(model_id=rec.model_id, version=rec.version, index=replica_to_retire(act.pressures)))).ok
        if step > 0:
            one = rec.spec.model_copy(update={"replicas": 1, "min_replicas": None, "max_replicas": None})
            outcome = await self.planner.plan.remote(one, await self.registry.capacities.remote(), weights=rec.plan.weights)
            if outcome.plan is None:
                log.info("%s: no room for another replica: %s", rec.model_id, outcome.error)
                return False
            replica = outcome.plan.replicas[0].model_copy(
                update={"index": max(rp.index for rp in rec.plan.replicas) + 1})
            return (await self._ask(t.ScaleUp(model_id=rec.model_id, version=rec.version, replica=replica))).ok
        return False

    @staticmethod
    def _idle_reason(spec: ModelSpec, since: float | None, now: float) -> str:
        assert since is not None  # destroy_due: it has one
        return (f"destroyed after {now - since:.0f}s without requests (idle_timeout {spec.idle_timeout:g}s); "
                f"deploy it again with POST /admin/models")

    async def _ask(self, msg: t.Transition) -> Any:
        outcome = await self.registry.transition.remote(msg)
        if outcome.ok:
            log.info("%s: %s", msg.model_id, outcome.record.message if outcome.record else msg.name)
        else:
            log.info("%s of %s refused: %s", msg.name, msg.model_id, outcome.message)
        return outcome

    # --- making room ----------------------------------------------------------------------
    @staticmethod
    def _wake_cost(rec: ModelRecord) -> float:
        """Its last wake without the placement (waiting for room is not the wake), else a cold start."""
        w = rec.last_wake
        return w.total_s - w.placement_s if w else cold_start_s(rec.plan.profile.weight_bytes)

    def _candidate(self, rec: ModelRecord) -> Candidate:
        act = self.activity.get(rec.model_id) or Activity()
        wake = self._wake_cost(rec)
        return Candidate(model_id=rec.model_id, can_sleep=rec.spec.can_sleep, status=rec.status,
                         keep_resident=rec.spec.keep_resident,
                         priority=rec.spec.priority, in_flight=act.in_flight, rate_per_s=act.rate_per_s,
                         wake_cost_s=wake, resident_since=rec.resident_since, last_request_at=act.last_request_at,
                         devices=sorted({d for rp in rec.plan.replicas for d in rp.devices}))

    async def _plan_with(self, spec: ModelSpec, devices: list[DeviceCapacity], freed: dict[str, int],
                         as_asked: bool = False, in_place: Plan | None = None, weights: Manifest | None = None) -> Any:
        """Plan as if ``freed`` bytes (device id -> bytes) were back on their devices; ``in_place``:
        a plan whose engines sleep on their devices, which fits there or nowhere; ``weights``: the
        source's listing, once read (the same revision in every plan of one search)."""
        devices = with_freed(devices, freed)
        if in_place is not None:
            return fits_in_place(in_place, devices)
        return await self.planner.plan.remote(spec, devices, None, as_asked, weights)

    async def _held_by(self, model_ids: list[str], records: Sequence[ModelRecord] = ()) -> dict[str, int]:
        """What putting these models to sleep gives back, per device: what they hold, less what an
        engine that will sleep in place keeps there (``memory.sleep_residual_bytes`` of its replica;
        ``records``: theirs, for the plans). Without its record a model counts as parking."""
        plans = {r.model_id: {rp.index: rp for rp in r.plan.replicas} for r in records}
        engines = {r.model_id: r.plan.engine for r in records}
        freed: dict[str, int] = {}
        for model_id in model_ids:
            for r in await self.registry.reservations.remote(model_id):
                rp = plans.get(model_id, {}).get(r.replica)
                keeps = 0 if rp is None or r.in_place else self._keeps_asleep(rp, engines[model_id])
                for dev in r.devices:
                    freed[dev] = freed.get(dev, 0) + max(0, r.held_bytes - keeps)
        return freed

    async def _cool(self, shells: Sequence[ModelRecord], newcomer: str) -> list[str]:
        """Ask the registry to stop these warm models' kept processes; the ones it accepted."""
        cooled = []
        for rec in shells:
            asked = await self._ask(t.Cool(model_id=rec.model_id, version=rec.version,
                                           reason=f"making room for {newcomer}"))
            if asked.ok:
                cooled.append(rec.model_id)
        return cooled

    def _keeps_asleep(self, rp: ReplicaPlan, engine: str) -> int:
        """What a resident replica will still hold on each device once it sleeps: its residual in
        vLLM's sleep mode, its kept process asleep warm (a vLLM engine, HIVE_WARM_PARK), nothing parked
        (the sim engine parks where it has no sleep mode)."""
        if rp.engine_kwargs.get("enable_sleep_mode"):
            return sleep_residual_bytes(rp)
        return warm_residual_bytes(rp) if self.settings.warm_park and engine == EngineKind.VLLM else 0

    async def fits_in_place_now(self, model_id: str, plan: Plan) -> bool:
        """Whether the engines of a model asleep on their devices can take their memory back there
        now, putting nobody to sleep (what they hold asleep is booked already)."""
        devices = with_freed(await self.registry.capacities.remote(), await self._held_by([model_id]))
        return fits_in_place(plan, devices).plan is not None

    async def make_room(self, spec: ModelSpec, waiting_since: float | None = None, as_asked: bool = False,
                        in_place: Plan | None = None, weights: Manifest | None = None) -> Room:
        """Plan ``spec``; when its memory is taken, put the cheapest evictable models to sleep.
        ``waiting_since``: when its first request (or its deploy) began to wait; ``as_asked``:
        ``spec`` is a deploy body as the user sent it (``control/planner.py``); ``in_place``:
        the plan of engines asleep on their devices (room is made there or not at all).

        Models already draining count as freed: their memory is on its way back, so a retry
        never evicts more than needed. A victim whose sleep the registry refuses (its record moved
        on since it was read) is neither reported nor waited for: the search goes on without it."""
        now = self.clock()
        everyone = await self.registry.list_models.remote()
        records = [r for r in everyone if r.model_id != spec.model_id]
        itself = next((r for r in everyone if r.model_id == spec.model_id), None)  # a wake (a deploy has none)
        devices = await self.registry.capacities.remote()
        if in_place is not None:  # what its engines asleep there still hold is booked already: its wake needs the rest
            devices = with_freed(devices, await self._held_by([spec.model_id]))
        outcome = await self._plan_with(spec, devices, {}, as_asked, in_place, weights)
        if outcome.plan is not None:
            return Room(plan=outcome.plan)
        weights = weights or outcome.weights
        draining = [r.model_id for r in records if r.status is ModelStatus.SLEEPING and r.releasing]
        base = await self._held_by(draining, records)
        if base and (await self._plan_with(spec, devices, base, as_asked, in_place, weights)).plan is not None:
            return Room(waiting_for=draining)  # it fits once those park: wait for them
        # kept processes of models asleep warm go first, least recently asked for first: stopping one
        # costs only its next wake's head start
        shells = sorted((r for r in records if r.status is ModelStatus.SLEEPING and not r.releasing
                         and r.sleep_mode is SleepMode.WARM), key=lambda r: r.last_request_at or r.slept_at or 0.0)
        freed = dict(base)
        for n, shell in enumerate(shells, 1):  # what each gives back, read once
            for dev, nbytes in (await self._held_by([shell.model_id], records)).items():
                freed[dev] = freed.get(dev, 0) + nbytes
            if (await self._plan_with(spec, devices, freed, as_asked, in_place, weights)).plan is not None:
                cooled = await self._cool(shells[:n], spec.model_id)
                return Room(waiting_for=cooled + draining)
        if shells:  # all of them, and models put to sleep besides (cooled only once that search finds room)
            draining += [r.model_id for r in shells]
            base = freed
        resident = [r for r in records if r.status in SERVING and r.resident]
        candidates = [self._candidate(r) for r in resident]
        waited = now - waiting_since if waiting_since is not None else 0.0
        own = self._wake_cost(itself) if itself is not None else (
            cold_start_s(weights.weight_bytes) if weights is not None and weights.weight_bytes else None)
        order, refused = eviction_order(candidates, now, self.settings.min_residency_s, waited, own)

        async def fits(victims: list[str]) -> bool:
            freed = {**base}
            for dev, nbytes in (await self._held_by(victims, records)).items():
                freed[dev] = freed.get(dev, 0) + nbytes
            return (await self._plan_with(spec, devices, freed, as_asked, in_place, weights)).plan is not None

        evicting: list[str] = []  # their sleep was accepted: counted as freed from here on

        async def fits_after(victims: list[str]) -> bool:
            return await fits(evicting + victims)

        while (victims := await choose_victims(order, fits_after)) is not None:
            order = [c for c in order if c.model_id not in victims]
            refusals = len(refused)
            for model_id in victims:
                rec = next(r for r in resident if r.model_id == model_id)
                asked = await self._ask(t.Sleep(model_id=rec.model_id, version=rec.version,
                                        reason=f"evicted to make room for {spec.model_id}"))
                if asked.ok:
                    evicting.append(model_id)
                else:  # it changed since it was read (healing, scaling, deleted): search on without it
                    refused.append(Refusal(model_id=model_id, reason=f"its sleep was refused: {asked.message}"))
            if len(refused) == refusals or await fits_after([]):
                await self._cool(shells, spec.model_id)
                return Room(evicting=evicting, waiting_for=evicting + draining)
        if not await fits([c.model_id for c in candidates]):
            return Room(error=outcome.error, status_code=outcome.status_code)  # would not fit even alone
        retry = protection_ends(candidates, now, self.settings.min_residency_s, waiting_since, own)
        holders = "; ".join(f"{r.model_id} ({r.reason})" for r in refused) or "none"
        return Room(evicting=evicting, retry_at=retry, status_code=503, blocked=True,
                    error=f"no room for {spec.model_id}: the memory it needs is held by models that cannot be "
                          f"put to sleep now: {holders}")
