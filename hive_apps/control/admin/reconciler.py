"""The admin's reconciler: one loop per model that makes Serve match the model's record.

The registry's record is the desired state (spec, plan, status); Serve's applications and
the engines are what exists. Each pass reads the record, looks at Serve, and takes the next
idempotent step, asking the registry for the transition that records it. Any pass can be
killed at any point: a new admin replica reads the same record and takes the same step.

    deploying/healing  weights not yet on every replica's node -> fetch them there (``fetching``: each
                       node downloads into its own cache; a failed fetch fails the deploy)
                       app not built from the current plan -> build it, then ``applied``
                       every replica that should run is healthy -> ``started``
                       an engine failed, or the deadline passed -> ``fail`` / ``heal_failed``
    degraded           replicas lost, self-healing on, not pinned -> plan replacements, ``heal``
    deleting           drain (bounded), rebuild the app without engines -> ``deleted`` (or destroyed, for
                       idleness), then remove the app (its router may drain 30 s behind HAProxy)
    sleeping           resident: drain (bounded); engines that can sleep (vLLM sleep mode) -> ``doze``
                       (the registry picks level 1 or 2), put them to sleep -> ``dozed`` with what each
                       still holds (it stays booked); others: rebuild the app with its router only -> ``parked``
    waking             parked: plan, making room by putting others to sleep -> ``placed``, then as
                       deploying; asleep in place: make room on its own devices -> ``placed``, wake
                       the engines and check their answer -> ``started`` (a failed wake in place
                       parks it and starts it again); no room -> ``wake_failed``
    failed, destroyed  remove the app if one is left
    (no record)        remove the app if one is left

Every Ray and Serve call goes through the cluster seam (``hive_apps/control/cluster.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import TYPE_CHECKING, Any

from hive_apps.control.admin.failures import failure_reason
from hive_apps.control.admin.model_app import build_model_app
from hive_apps.control.cluster import MISSING, AppState, Cluster, ControlPlane, off_loop
from hive_apps.core import names
from hive_apps.core.planning.drift import Loaded
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state import transitions as t
from hive_apps.core.state.book import heal_backoff_s
from hive_apps.core.state.records import ENDED, STARTING, ModelRecord, ModelStatus, Reservation, SleepMode
from hive_apps.core.weights.types import FetchProgress, FetchState
from hive_apps.serving.engine.protocol import SleepReport

if TYPE_CHECKING:
    from hive_apps.control.admin.lifecycle import Lifecycle

log = logging.getLogger("ray.serve")

POLL_S = 0.5  # how often a starting model's Serve status is read
ERROR_RETRY_S = 2.0
INFO_TIMEOUT_S = 10.0
SERVE_TIMEOUT_S = 120.0
SLEEP_TIMEOUT_S = 300.0  # an engine's own sleep or wake (level 1 of a large model: seconds per 10 GiB)
REST_TIMEOUT_S = 60.0  # vLLM stopping in a kept process (asleep warm)
APPLY_GRACE_S = 3.0
HEALTHY = "HEALTHY"
BROKEN = ("UNHEALTHY", "DEPLOY_FAILED")


def residuals(slept: dict[str, Any]) -> dict[int, dict[str, int]]:
    """What each engine said it still holds once asleep (``SleepReport``), by replica index; an engine
    that measured nothing (or one started before engines reported it) is left to the plan's estimate."""
    return {names.replica_index(label): report.residual_bytes for label, report in slept.items()
            if isinstance(report, SleepReport) and report.residual_bytes is not None}


def is_model_app(state: AppState) -> bool:
    """An app shaped as the hive builds a model (a router and engine replicas); other Serve
    apps on the cluster are the user's and never touched."""
    deps = set(state.deployments)
    return names.ROUTER_DEPLOYMENT in deps and all(
        d == names.ROUTER_DEPLOYMENT or names.is_engine_deployment(d) for d in deps)


class Reconciler(ControlPlane):
    def __init__(self, cluster: Cluster, settings: HiveSettings, lifecycle: Lifecycle,
                 apply_grace_s: float = APPLY_GRACE_S, clock: Callable[[], float] = time.time):
        self.cluster = cluster
        self.clock = clock  # wall time, as the registry stamps records with it
        self.settings = settings
        self.lifecycle = lifecycle
        self.apply_grace_s = apply_grace_s
        self.loops: dict[str, asyncio.Task] = {}
        self.evicted_for: dict[str, set[str]] = {}  # waking model -> models put to sleep for it
        self.kicks: dict[str, asyncio.Event] = {}
        self.fetching: dict[str, dict[str, FetchProgress]] = {}  # model id -> node name -> its fetch, while any runs

    # --- loops ------------------------------------------------------------------------------
    def ensure(self, model_id: str) -> None:
        """Start the model's loop, or wake it if it runs."""
        kick = self.kicks.setdefault(model_id, asyncio.Event())
        kick.set()
        task = self.loops.get(model_id)
        if task is None or task.done():
            self.loops[model_id] = asyncio.get_running_loop().create_task(self._run(model_id))

    async def _run(self, model_id: str) -> None:
        kick = self.kicks[model_id]
        while True:
            kick.clear()
            try:
                rec = await self.registry.get_model.remote(model_id)
                delay = await self.step(model_id, rec)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconciling %s failed; retrying", model_id)
                delay = ERROR_RETRY_S
            if delay is None:
                if not kick.is_set():
                    self.loops.pop(model_id, None)
                    return
                continue
            if delay > 0:
                try:
                    await asyncio.wait_for(kick.wait(), delay)
                except TimeoutError:
                    pass

    async def idle(self, model_id: str, timeout_s: float) -> bool:
        """Wait until the model's loop has nothing left to do (a failed deploy's app is gone)."""
        task = self.loops.get(model_id)
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        return bool(done)

    def stop(self) -> None:
        for task in self.loops.values():
            task.cancel()

    # --- one step ---------------------------------------------------------------------------
    async def step(self, model_id: str, rec: ModelRecord | None) -> float | None:
        """Take the next step for one model; answer how long to wait before the next, or None
        when the model needs nothing until its record changes."""
        if rec is None or rec.status in ENDED:
            await self._remove_app(model_id)
            return None
        if rec.status is ModelStatus.DELETING:
            await self._drain(rec)
            await self._stop_engines(rec)
            await self._ask(t.Deleted(model_id=rec.model_id, version=rec.version))
            await self._remove_app(model_id)  # the record is gone already: the router may drain at leisure
            return None
        if rec.retiring and rec.status in (ModelStatus.READY, ModelStatus.DEGRADED):
            return await self._retire(rec)
        if rec.status is ModelStatus.SLEEPING:
            return await self._sleeping(rec)
        if rec.status is ModelStatus.WAKING and rec.sleeps_in_place and rec.resident:
            return await self._rouse(rec)
        if rec.status is ModelStatus.WAKING and not rec.resident:
            return await self._wake(rec)
        if rec.status in STARTING:
            return await self._starting(rec)
        if rec.status is ModelStatus.DEGRADED:
            return await self._degraded(rec)
        return None

    async def _ask(self, msg: t.Transition) -> Any:
        """One transition; a refused one (stale version) means: read again and decide again."""
        outcome = await self.registry.transition.remote(msg)
        if not outcome.ok:
            log.info("%s of %s refused: %s", msg.name, msg.model_id, outcome.message)
        return outcome

    async def _remove_app(self, model_id: str) -> None:
        """Remove the model's app and wait until Serve no longer lists it (a new deploy of the same
        id must not meet the old app), at most SERVE_TIMEOUT_S; the wait holds no thread."""
        app = names.model_app(model_id)
        states = await off_loop(self.cluster.app_states, timeout=SERVE_TIMEOUT_S)
        if app not in states:
            return
        await off_loop(self.cluster.delete_app, app, timeout=SERVE_TIMEOUT_S)
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while app in await off_loop(self.cluster.app_states, timeout=SERVE_TIMEOUT_S):
            if time.monotonic() > deadline:
                log.warning("the app of %s is still being removed after %.0fs", model_id, SERVE_TIMEOUT_S)
                return
            await asyncio.sleep(POLL_S)
        log.info("removed the app of %s", model_id)

    async def _stop_engines(self, rec: ModelRecord) -> None:
        """Take a deleted model's engines away before its app: behind Serve's HAProxy ingress
        (the quickstart's and the manifests' setting) a removed ingress replica, the model's
        router, stays reachable for 30 s so load balancers can deregister it (Ray 2.60's
        ``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``), and removing the whole app waited
        that long before the record ended and its reservations were released. The engines are
        not ingress: rebuilt router-only, as a parked model is, they stop within seconds, and
        what they still hold until then counts as measured memory, as after a park."""
        state = await self._app_state(rec.model_id)
        if any(names.is_engine_deployment(d) for d in state.deployments):
            await self._build_router_only(rec)
            log.info("%s deleted: engines removed, the app goes next", rec.model_id)

    async def _drain(self, rec: ModelRecord, indices: list[int] | None = None) -> None:
        """Wait until no request is in flight in the model's engines (or only these replicas), at
        most HIVE_DRAIN_GRACE_S (routers hold, refuse or skip new ones from the moment the record
        said so)."""
        state = await self._app_state(rec.model_id)
        if not rec.resident or not any(names.is_engine_deployment(d) for d in state.deployments):
            return
        deadline = self.clock() + self.settings.drain_grace_s
        while True:
            act = await self.lifecycle.read(rec, self.clock(), indices)
            if act is None or act.in_flight == 0:
                return
            if self.clock() >= deadline:
                log.warning("%s: %d requests still in flight after the drain grace (HIVE_DRAIN_GRACE_S=%g)",
                            rec.model_id, act.in_flight, self.settings.drain_grace_s)
                return
            await asyncio.sleep(POLL_S)

    async def _retire(self, rec: ModelRecord) -> float | None:
        """Scale down: routers already skip the retiring replicas; drain them, rebuild the app
        without them (the other engines keep their versions, so they stay), then ``retired``."""
        await self._drain(rec, rec.retiring)
        await self._build(rec, leave_out=rec.retiring)
        await self._ask(t.Retired(model_id=rec.model_id, version=rec.version))
        return 0.0

    async def _build(self, rec: ModelRecord, leave_out: Collection[int] = ()) -> None:
        """Build (or rebuild) the model's app from its plan, without the replicas in ``leave_out``
        (all of them: parked, the router alone)."""
        plan = rec.plan if not leave_out else rec.plan.model_copy(
            update={"replicas": [rp for rp in rec.plan.replicas if rp.index not in leave_out]})
        build = partial(build_model_app, model_env=rec.spec.env)  # the deploy's env, for every engine
        await off_loop(self.cluster.run_model_app, rec.model_id, plan, rec.spec.max_queued_requests,
                       rec.placed_at, build, timeout=SERVE_TIMEOUT_S)

    async def _sleeping(self, rec: ModelRecord) -> float | None:
        """Drain, then sleep in place where the engines can (``doze``, their sleep, ``dozed``), or
        park: the app keeps its router (route, held requests) and loses its engines."""
        if not rec.resident:
            if rec.cooling:  # asleep warm, and another model needs what its processes hold
                await self._park(rec)
            return None  # asleep: a request wakes it, the lifecycle loop may destroy it
        if rec.sleep_mode is None:
            await self._drain(rec)
            now = await self.registry.get_model.remote(rec.model_id)
            if now is None or now.status is not ModelStatus.SLEEPING or now.sleep_mode is not None:
                return 0.0  # woken, deleted or decided while it drained: decide again
            how = await self._how_in_place(now)
            if how is not None:
                await self._ask(t.Doze(model_id=now.model_id, version=now.version, warm=how is SleepMode.WARM))
                return 0.0
        elif rec.sleeps_in_place:
            level = 1 if rec.sleep_mode is SleepMode.LEVEL1 else 2
            try:
                if rec.sleep_mode is SleepMode.WARM:  # vLLM stops; the processes stay
                    slept = await self._each_engine(rec, lambda engine: engine.rest.remote(), REST_TIMEOUT_S)
                else:  # vLLM's sleep mode
                    slept = await self._each_engine(rec, lambda engine: engine.sleep.remote(level))
            except Exception as e:
                log.warning("%s: its engines did not sleep (%s); parking it instead", rec.model_id, e)
            else:
                await self._ask(t.Dozed(model_id=rec.model_id, version=rec.version, residuals=residuals(slept)))
                return None
        await self._park(rec)
        return None

    async def _how_in_place(self, rec: ModelRecord) -> SleepMode | None:
        """How its drained engines stay in place: vLLM's sleep mode (level 1 or 2, the registry picks),
        warm (no sleep mode, HIVE_WARM_PARK: vLLM stops, the processes stay), or not at all (None: parked)."""
        answers = list((await self._engine_infos(rec, [rp.index for rp in rec.live_replicas])).values())
        infos = [i for i in answers if i is not None]
        if not infos or len(infos) < len(answers):
            return None
        if all(i.get("can_sleep") for i in infos):
            return SleepMode.LEVEL1
        if self.settings.warm_park and all(i.get("can_rest") for i in infos):
            return SleepMode.WARM
        return None

    async def _each_engine(self, rec: ModelRecord, call, timeout_s: float = SLEEP_TIMEOUT_S) -> dict[str, Any]:
        """``call(handle)`` on every live engine at once; the first failure raises."""
        live = [rp.index for rp in rec.live_replicas]
        results = await asyncio.gather(*(asyncio.wait_for(call(self.cluster.engine_handle(rec.model_id, i)),
                                                          timeout_s) for i in live))
        return {names.replica_label(i): r for i, r in zip(live, results)}

    async def _rouse(self, rec: ModelRecord) -> float | None:
        """Its engines sleep in place and their memory is booked again: wake them, check that they
        answer as before they slept, serve. One that does not is restarted (parked, then started)."""
        try:  # warm: vLLM starts again in each kept process, a start's deadline
            timeout_s = self.settings.deploy_timeout_s if rec.sleep_mode is SleepMode.WARM else SLEEP_TIMEOUT_S
            woke = await self._each_engine(rec, lambda engine: engine.wake_up.remote(), timeout_s)
        except Exception as e:
            log.warning("%s: waking in place failed (%s); starting its engines again", rec.model_id, e)
            await self._park(rec)
            return 0.0
        await self._ask(t.Started(model_id=rec.model_id, version=rec.version, wake_s={k: w["wake_s"] for k, w in woke.items()},
                        warm_up_s={k: w["warm_up_s"] for k, w in woke.items()}))
        return 0.0

    async def _park(self, rec: ModelRecord) -> None:
        """Remove its engines and record it parked (its memory, host RAM included, is released)."""
        await self._park_app(rec)
        await self._ask(t.Parked(model_id=rec.model_id))

    async def _park_app(self, rec: ModelRecord) -> None:
        await self._build_router_only(rec)
        log.info("%s parked: engines removed, router kept", rec.model_id)

    async def _build_router_only(self, rec: ModelRecord) -> None:
        """The model's app without its engines: they stop, the router (its route, held requests) stays."""
        await self._build(rec, leave_out=[rp.index for rp in rec.plan.replicas])

    async def _wake(self, rec: ModelRecord) -> float | None:
        """A parked model must run again: plan it where there is room, making room if need be."""
        waited = self.clock() - (rec.wake_requested_at or self.clock())
        if waited > self.settings.hold_timeout_s:
            await self._ask(t.WakeFailed(model_id=rec.model_id, version=rec.version,
                            reason=f"no room within {self.settings.hold_timeout_s:.0f}s (HIVE_HOLD_TIMEOUT_S)"))
            return 0.0
        # with load-driven replicas, the fewest wake first; load adds the others
        if rec.sleeps_in_place and rec.lost_replicas:
            log.info("%s: replicas %s were lost while it slept; starting it again", rec.model_id, sorted(rec.lost_replicas))
            await self._park(rec)
            return 0.0
        if rec.sleep_mode is SleepMode.WARM and not await self.lifecycle.fits_in_place_now(rec.model_id, rec.plan):
            # its kept processes save one process start (seconds), less than waiting for room made on
            # their devices: placed anew, as a parked model is (benchmarks/RESULTS_lifecycle.md)
            log.info("%s: no room on the devices its processes are kept on; starting it where there is room",
                     rec.model_id)
            await self._park(rec)
            return 0.0
        bounds = rec.spec.replica_bounds
        spec = rec.spec if bounds is None or rec.sleeps_in_place else rec.spec.model_copy(update={"replicas": bounds[0]})
        room = await self.lifecycle.make_room(spec, rec.wake_requested_at, in_place=rec.plan if rec.sleeps_in_place else None,
                                              weights=rec.plan.weights)
        if room.plan is None and rec.sleeps_in_place and not room.waiting_for and room.retry_at is None:
            # no room on its own devices now: start it again elsewhere if it fits there now, or if
            # its devices could never take it; else wait for a request on them to end
            if not room.blocked or (await self.planner.plan.remote(spec, await self.registry.capacities.remote(),
                                                                   weights=rec.plan.weights)).plan:
                log.info("%s: no room where its engines sleep (%s); starting it again elsewhere", rec.model_id, room.error)
                await self._park(rec)
                return 0.0
            message = f"waking: {room.error}; waiting for their requests to end"
            if rec.message != message:
                await self._ask(t.Note(model_id=rec.model_id, version=rec.version, message=message))
            return POLL_S
        evicted = self.evicted_for.setdefault(rec.model_id, set())
        evicted.update(room.evicting)
        if room.plan is None:
            if room.waiting_for:
                for model_id in room.waiting_for:
                    self.ensure(model_id)
                message = f"waking: waiting for {', '.join(room.waiting_for)} to go to sleep to make room"
            elif room.retry_at is not None:
                message = f"waking: {room.error}; trying again in {room.retry_at - self.clock():.0f}s"
            else:
                await self._ask(t.WakeFailed(model_id=rec.model_id, version=rec.version, reason=room.error))
                return 0.0
            if rec.message != message:
                await self._ask(t.Note(model_id=rec.model_id, version=rec.version, message=message))
            return POLL_S if room.retry_at is None else max(POLL_S, room.retry_at - self.clock())
        reservations = [Reservation.for_replica(rec.model_id, rp) for rp in room.plan.replicas]
        plan = room.plan.model_copy(update={"weights": rec.plan.weights})  # the revision its deploy pinned
        await self._ask(t.Placed(model_id=rec.model_id, version=rec.version, plan=plan, reservations=reservations,
                        placement_s=self.clock() - (rec.wake_requested_at or self.clock()),
                        evicted=sorted(self.evicted_for.pop(rec.model_id, set()))))
        return 0.0

    async def _app_state(self, model_id: str) -> AppState:
        states = await off_loop(self.cluster.app_states, timeout=SERVE_TIMEOUT_S)
        return states.get(names.model_app(model_id), MISSING)

    async def _weights_on_nodes(self, rec: ModelRecord) -> bool:
        """Each node of a live replica fetches the plan's weights into its own cache (a node that has
        them answers at once); True once every node has them. A failed fetch fails the start."""
        manifest = rec.plan.weights
        if manifest is None:
            return True
        began = time.perf_counter()
        in_use = await self.weights_in_use()
        nodes = {rp.node_id: rp.node_name for rp in rec.live_replicas}
        progress = dict(zip(nodes.values(), await asyncio.gather(*(
            off_loop(self.cluster.fetcher_call, node_id, "ensure", manifest, in_use, timeout=SERVE_TIMEOUT_S)
            for node_id in nodes))))
        failed = {name: p.error for name, p in progress.items() if p.state is FetchState.FAILED}
        if failed:
            self.fetching.pop(rec.model_id, None)
            await self._fail(rec, "fetching its weights failed: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
            return False
        if all(p.state is FetchState.READY for p in progress.values()):
            self.fetching.pop(rec.model_id, None)
            # benchmarks/bench_fetch.py reads this line (what a cached source adds to a deploy)
            log.info("%s: weights on %s: ready (asked in %.3fs)", rec.model_id, ", ".join(progress),
                     time.perf_counter() - began)
            return True
        self.fetching[rec.model_id] = progress
        return False

    async def weights_in_use(self) -> set[str]:
        """Cache keys a model that is not ended names, and every LoRA adapter's: never evicted, never deleted."""
        models = {r.plan.weights.key for r in await self.registry.list_models.remote()
                  if r.status not in ENDED and r.plan.weights is not None}
        return models | {a.weights.key for a in await self.registry.list_adapters.remote()}

    async def _starting(self, rec: ModelRecord) -> float | None:
        if rec.applied_generation != rec.plan_generation:
            if not await self._weights_on_nodes(rec):
                return POLL_S
            await self._build(rec)
            await self._ask(t.Applied(model_id=rec.model_id, version=rec.version, generation=rec.plan_generation))
            return 0.0
        live = [rp.index for rp in rec.live_replicas]
        fresh = rec.status in (ModelStatus.DEPLOYING, ModelStatus.WAKING)  # every live replica starts
        if fresh and not live:
            what = "deploy" if rec.status is ModelStatus.DEPLOYING else "wake"
            await self._fail(rec, f"every replica's node died during the {what}: " + ", ".join(sorted(rec.lost_replicas)))
            return 0.0
        watched = live if fresh else rec.healing_replicas
        state = await self._app_state(rec.model_id)
        if rec.status is ModelStatus.WAKING and not any(names.is_engine_deployment(d) for d in state.deployments) \
                and self.clock() - rec.applied_at >= self.apply_grace_s:
            await self._ask(t.Parked(model_id=rec.model_id))  # it parked before the wake was seen: place it again
            return 0.0
        if state.status == "MISSING":  # removed behind our back: build it again
            await self._build(rec)
            return POLL_S
        deployments = [names.engine_deployment(i) for i in watched] + [names.ROUTER_DEPLOYMENT]
        if all(state.deployments.get(d) == HEALTHY for d in deployments):
            infos = await self._engine_infos(rec, watched)
            if all(info is not None for info in infos.values()):
                def times(key: str) -> dict[str, float]:
                    return {k: round(i[key], 3) for k, i in infos.items() if i is not None and i.get(key) is not None}

                loaded = {k: [Loaded.model_validate(r) for r in i["loaded"]]
                          for k, i in infos.items() if i is not None and i.get("loaded")}
                await self._ask(t.Started(model_id=rec.model_id, version=rec.version, engine_start_s=times("engine_start_s"),
                                warm_up_s=times("warm_up_s"), loaded=loaded or None))
                return 0.0  # degraded models go on to heal
        # Serve's status can lag a rebuild: judge a failure only once it had time to take the new plan
        settled = self.clock() - rec.applied_at >= self.apply_grace_s
        broken = [d for d in deployments if state.deployments.get(d) in BROKEN] if settled else []
        # the deadline counts from the build: fetching the weights before it is bounded by its own retries
        late = self.clock() > max(rec.starting_since, rec.applied_at) + self.settings.deploy_timeout_s
        if not broken and not late:
            return POLL_S
        messages = [state.message] + [state.deployment_messages.get(d, "") for d in deployments]
        detail = failure_reason(" | ".join(m for m in messages if m))
        reason = (f"an engine failed to start: {detail}" if broken else
                  f"not ready within {self.settings.deploy_timeout_s:.0f}s (HIVE_DEPLOY_TIMEOUT_S); "
                  f"last status {state.status}: {detail}")
        log.warning("%s of %s failed: %s", rec.status.value, rec.model_id, reason)
        await self._fail(rec, reason)
        return 0.0

    async def _fail(self, rec: ModelRecord, reason: str) -> None:
        failed: dict[ModelStatus, type[t.Fail | t.WakeFailed | t.ScaleFailed | t.HealFailed]] = {
            ModelStatus.DEPLOYING: t.Fail, ModelStatus.WAKING: t.WakeFailed, ModelStatus.SCALING: t.ScaleFailed}
        kind = failed.get(rec.status, t.HealFailed)
        if kind is t.WakeFailed:
            await self._park_app(rec)  # nothing of the failed start stays
        elif kind is t.ScaleFailed:
            await self._build(rec, leave_out=rec.healing_replicas)
        await self._ask(kind(model_id=rec.model_id, version=rec.version, reason=reason))

    async def _engine_infos(self, rec: ModelRecord, indices: list[int]) -> dict[str, dict | None]:
        """Each engine's own account of itself, or None where the replica that answers is not
        yet the one the plan placed (Serve can call a healthy-looking replica of a dead node)."""
        planned = {rp.index: rp.devices for rp in rec.plan.replicas}

        async def one(i: int) -> tuple[str, dict | None]:
            try:
                info = await asyncio.wait_for(self.cluster.engine_handle(rec.model_id, i).info.remote(), INFO_TIMEOUT_S)
            except Exception as e:
                log.info("engine %s/r%d does not answer yet: %s", rec.model_id, i, e)
                return names.replica_label(i), None
            return names.replica_label(i), info if info.get("devices") == planned[i] else None

        return dict(await asyncio.gather(*(one(i) for i in indices)))

    async def _degraded(self, rec: ModelRecord) -> float | None:
        if not self.settings.self_heal or not rec.lost_replicas:
            return None
        if rec.spec.gpu is not None:
            note = "pinned replicas are not replaced automatically; redeploy with other pins"
            if note not in rec.message:
                await self._ask(t.Note(model_id=rec.model_id, version=rec.version, message=f"{rec.message}; {note}"))
            return None
        wait = rec.next_heal_at - self.clock()
        if wait > 0:
            return wait
        lost = sorted(names.replica_index(k) for k in rec.lost_replicas)
        spec = rec.spec.model_copy(update={"replicas": len(lost)})
        devices = await self.registry.capacities.remote()
        outcome = await self.planner.plan.remote(spec, devices, weights=rec.plan.weights)
        if outcome.plan is None:
            wait = heal_backoff_s(rec.heal_attempts + 1, self.settings.heal_backoff_max_s)
            await self._ask(t.Note(model_id=rec.model_id, version=rec.version, next_heal_at=self.clock() + wait,
                            message=f"no capacity to replace {sorted(rec.lost_replicas)} yet "
                                    f"(next try in {wait:.0f}s): {outcome.error}"))
            return wait
        replacements = [rp.model_copy(update={"index": i}) for rp, i in zip(outcome.plan.replicas, lost)]
        result = await self._ask(t.Heal(model_id=rec.model_id, version=rec.version, replacements=replacements))
        if result.ok:
            log.info("%s: %s", rec.model_id, result.record.message)
        return 0.0 if result.ok else POLL_S

    # --- orphans ----------------------------------------------------------------------------
    async def sweep(self, records: list[ModelRecord]) -> list[str]:
        """Remove model apps that no record explains (a deploy that died half-made)."""
        known = {names.model_app(r.model_id) for r in records if r.status is not ModelStatus.FAILED}
        states = await off_loop(self.cluster.app_states, timeout=SERVE_TIMEOUT_S)
        orphans = [a for a, s in states.items() if a not in known and is_model_app(s)]
        for app in orphans:
            if app in self.loops:  # its own loop is on it
                continue
            log.warning("removing app %s: no model record explains it", app)
            await off_loop(self.cluster.delete_app, app, timeout=SERVE_TIMEOUT_S)
        return orphans
