"""The admin's request logic as an ASGI app, built by ``make_admin_app`` from its seam, settings
and clock: the Serve deployment (``control/admin/app.py``) wraps it, unit tests drive it in-process.

Validate, plan, and ask the registry for transitions. The registry owns every model record and
reservation; the admin only asks it for named transitions (``core/state/book.py``) and runs one
reconciler loop per model (``control/admin/reconciler.py``) that builds, watches, heals and removes model
apps. Any of that can be killed at any time: a new admin long-polls the registry, finds every
model whose record is not settled and resumes its loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hive_apps.control.admin import status_page
from hive_apps.control.admin.adapters import adapter_status, admit_adapter, remove_adapter
from hive_apps.control.admin.declared import DeclaredModels
from hive_apps.control.admin.guard import AdminGuard
from hive_apps.control.admin.history import HistoryKeeper
from hive_apps.control.admin.lifecycle import Lifecycle
from hive_apps.control.admin.reconciler import Reconciler
from hive_apps.control.admin.schemas import (
    AdminError,
    DeclaredReport,
    ModelStatusResponse,
    MonitorToken,
    MonitorTokenRequest,
    error_responses,
    validation_problems,
)
from hive_apps.control.admin.updates import Amendment, amend, without_model
from hive_apps.control.admin.weights import CALL_TIMEOUT_S, NodeCaches, PrefetchRequest
from hive_apps.control.cluster import Cluster, ControlPlane, off_loop
from hive_apps.core.auth import monitor_token_node, node_monitor_token
from hive_apps.core.devices import NodeSample
from hive_apps.core.planning.report import render_plan_table
from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import AdapterSpec, ModelSpec
from hive_apps.core.state.changes import spec_change
from hive_apps.core.state.ledger import DeviceState
from hive_apps.core.state.namespace import alias_conflict
from hive_apps.core.state.records import (
    ENDED,
    SERVING,
    AdapterDeletion,
    ModelRecord,
    ModelStatus,
    Origin,
    Reservation,
)
from hive_apps.core.state.transitions import Create, Delete, Sleep, Wake
from hive_apps.core.weights.types import SourceError

log = logging.getLogger("ray.serve")

WATCH_S = 30.0  # longest single long-poll of the registry
SWEEP_S = 30.0  # how often apps that no record explains are looked for
DELETE_WAIT_S = 60.0  # a DELETE answers 202 "deleting" past this
FAILED_CLEANUP_WAIT_S = 60.0
MAX_KEY_CHARS = 1024  # a weights cache key (source + revision) is far shorter; bounds what reaches the nodes


def error_response(status: int, message: str, field: str | None = None, headers: dict | None = None, **extra) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "status": status, **extra}},
                        status_code=status, headers=headers)


class AdminService(ControlPlane):
    """The admin's state and background loops, and what more than one route needs; the routes
    (``make_admin_app``) are closures over one of these."""

    def __init__(self, cluster: Cluster, settings: HiveSettings, clock: Callable[[], float] = time.time,
                 declared: list[Any] | None = None):
        self.cluster, self.settings, self.clock = cluster, settings, clock
        self.lifecycle = Lifecycle(cluster, settings, clock)
        self.reconciler = Reconciler(cluster, settings, self.lifecycle, clock=clock)
        self.caches = NodeCaches(cluster)
        self.records: list[ModelRecord] = []  # as the registry last announced them
        self.history = HistoryKeeper(cluster, settings, self.lifecycle, clock)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_records()), loop.create_task(self._lifecycle_loop()),
                       loop.create_task(self.history.run())]
        self._background: set[asyncio.Task] = set()
        self.declared = DeclaredModels(self, declared)  # the Serve config's models (control/admin/declared.py)
        self._tasks.append(loop.create_task(self.declared.run()))

    def close(self) -> None:
        """Stop the loops and the reconciler's (tests; a Serve replica just ends)."""
        for task in [*self._tasks, *self.reconciler.loops.values(), *self._background]:
            task.cancel()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` beside the requests (a prefetch): kept until it ends, cancelled by ``close``."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_records(self) -> None:
        """Wake the loop of every model whose record changed; sweep orphan apps now and then.

        On start this resumes every deploy, heal and delete a previous admin left in flight.
        """
        after, swept_at, seen = -1, 0.0, {}  # type: int, float, dict[str, int]
        while True:
            try:
                view = await self.registry.watch.remote(after, WATCH_S)
                after, self.records = view.version, view.models
                for rec in view.models:  # wake only the loops of records that changed
                    if seen.get(rec.model_id) != rec.version and (rec.status is not ModelStatus.READY or rec.retiring):
                        self.reconciler.ensure(rec.model_id)
                seen = {rec.model_id: rec.version for rec in view.models}
                if self.clock() - swept_at > SWEEP_S:
                    swept_at = self.clock()
                    await self.reconciler.sweep(view.models)
            except Exception as e:  # e.g. the registry is restarting
                log.warning("watching the registry failed: %s", e)
                await asyncio.sleep(1.0)

    async def _lifecycle_loop(self) -> None:
        """Every HIVE_LIFECYCLE_TICK_S: put idle models to sleep, destroy long-idle ones."""
        while True:
            await asyncio.sleep(self.settings.lifecycle_tick_s)
            try:
                for model_id in await self.lifecycle.tick(self.records):
                    self.reconciler.ensure(model_id)
            except Exception as e:  # e.g. the registry is restarting
                log.warning("lifecycle tick failed: %s", e)

    async def place(self, spec: ModelSpec):
        """Plan a deploy; when the memory it needs is taken, put models that can sleep to sleep
        first (``control/admin/lifecycle.py``), waiting for them to park, at most HIVE_HOLD_TIMEOUT_S."""
        try:
            return await self.plan(spec)
        except AdminError as first:
            planning_error = first
        deadline, began = time.monotonic() + self.settings.hold_timeout_s, self.clock()
        while time.monotonic() < deadline:
            room = await self.lifecycle.make_room(spec, began, as_asked=True)
            if room.plan is not None:
                return room.plan
            if room.waiting_for:
                for model_id in room.waiting_for:
                    self.reconciler.ensure(model_id)
                parking = set(room.waiting_for)
                await self.wait_for(lambda records: all(m not in records or not records[m].releasing for m in parking),  # noqa: B023 (awaited in this iteration)
                                    deadline - time.monotonic())
            elif room.retry_at is not None and room.retry_at - self.clock() < deadline - time.monotonic():
                await asyncio.sleep(max(0.0, room.retry_at - self.clock()))
            elif room.status_code == 503:
                raise AdminError(503, room.error, retry_after=max(1, int(self.settings.min_residency_s)))
            else:
                raise planning_error
        raise AdminError(503, f"no room for {spec.model_id} within {self.settings.hold_timeout_s:.0f}s "
                              "(HIVE_HOLD_TIMEOUT_S) while other models went to sleep", retry_after=5)

    async def wait_for(self, done: Callable[[dict[str, ModelRecord]], bool], timeout_s: float) -> dict[str, ModelRecord]:
        """Long-poll the registry until ``done(records by id)`` or the timeout; the last records seen."""
        deadline = time.monotonic() + timeout_s
        after = -1
        while True:
            view = await self.registry.watch.remote(after, max(0.0, min(WATCH_S, deadline - time.monotonic())))
            after = view.version
            records = {r.model_id: r for r in view.models}
            if done(records) or time.monotonic() >= deadline:
                return records

    async def plan(self, spec: ModelSpec, freeing: ModelRecord | None = None):
        """Plan leaving room for the replicas self-healing still waits to place (``core/planning/packing.py``);
        ``freeing``: as if that model's replicas were gone (a recreate checks its new settings fit)."""
        devices = await self.registry.capacities.remote()
        if freeing is not None:
            devices = without_model(devices, freeing)
        waiting = [rec.spec.model_copy(update={"replicas": len(rec.lost_replicas)})
                   for rec in await self.registry.list_models.remote()
                   if rec.status is ModelStatus.DEGRADED and rec.lost_replicas and rec.spec.gpu is None
                   and rec.model_id != spec.model_id]
        outcome = await self.planner.plan.remote(spec, devices, waiting or None, True)
        if outcome.plan is None:
            raise AdminError(outcome.status_code, outcome.error, rejected=[r.model_dump() for r in outcome.rejected])
        return outcome.plan

    def status(self, rec: ModelRecord) -> ModelStatusResponse:
        return ModelStatusResponse.of(rec, self.reconciler.fetching.get(rec.model_id))

    async def admit(self, spec: ModelSpec, origin: Origin = Origin.API) -> ModelRecord:
        """Deploy a validated spec: the id must be free (or hold an ended deploy), the plan must place it
        (making room), its weights must fit the nodes; then the registry creates its record and the
        reconciler starts it. ``POST /admin/models``, ``PUT`` (recreate) and declared models all come here."""
        existing = await self.registry.get_model.remote(spec.model_id)
        if existing is not None and existing.status not in ENDED:
            raise AdminError(409, f"model_id {spec.model_id!r} is already {existing.status.value}; "
                                  "DELETE /admin/models/{id} first or choose another model_id", "model_id")
        if await self.registry.get_adapter.remote(spec.model_id) is not None:
            raise AdminError(409, f"model_id {spec.model_id!r} is a LoRA adapter's name; DELETE "
                                  f"/admin/adapters/{spec.model_id} first or choose another model_id", "model_id")
        await self.check_names(spec)
        began = time.perf_counter()
        plan = await self.place(spec)
        placed = time.perf_counter()
        problems = await self.caches.room_problems(plan, await self.reconciler.weights_in_use())
        log.info("%s: planned in %.3fs, room for its weights checked in %.3fs", spec.model_id, placed - began,
                 time.perf_counter() - placed)
        if problems:
            raise AdminError(422, f"the weights of {spec.model!r} cannot go where the plan puts its replicas: "
                                  + "; ".join(problems), "model")
        record = ModelRecord(model_id=spec.model_id, spec=spec, plan=plan, origin=origin)
        reservations = [Reservation.for_replica(spec.model_id, rp) for rp in plan.replicas]
        outcome = await self.registry.transition.remote(Create(model_id=spec.model_id, record=record,
                                                               reservations=reservations))
        if not outcome.ok:
            field = "aliases" if outcome.message.startswith("alias") else "model_id" if "model_id" in outcome.message else None
            raise AdminError(outcome.status_code, outcome.message, field)
        self.reconciler.ensure(spec.model_id)
        return outcome.record

    async def check_names(self, spec: ModelSpec) -> None:
        """409 naming the holder when ``spec``'s model_id is another model's alias or one of its aliases is
        taken (``core/state/namespace.py``); the registry checks again as it records the spec."""
        conflict = alias_conflict(spec, await self.registry.list_models.remote(),
                                  await self.registry.list_adapters.remote())
        if conflict:
            raise AdminError(409, conflict, "aliases" if conflict.startswith("alias") else "model_id")

    async def respond(self, rec: ModelRecord, wait: bool, **extra: Any) -> JSONResponse:
        """A deploy's answer: 202 while it deploys, 200 once ready; with ``wait``, once it is ready or
        failed (422, its app removed first). ``extra``: keys added to the status body."""
        model_id = rec.model_id
        if wait:
            def settled(records: dict[str, ModelRecord]) -> bool:
                r = records.get(model_id)
                return r is None or r.status is not ModelStatus.DEPLOYING

            found = (await self.wait_for(settled, self.settings.deploy_timeout_s + 60)).get(model_id)
            if found is None:
                raise AdminError(409, f"model {model_id!r} was deleted while it deployed", "model_id")
            rec = found
        body = {**self.status(rec).model_dump(mode="json"), **extra}
        if rec.status is ModelStatus.FAILED:
            await self.reconciler.idle(model_id, FAILED_CLEANUP_WAIT_S)  # its app is removed first
            return error_response(422, f"deploy of {model_id!r} failed: {rec.message}", status_detail=body)
        return JSONResponse(body, status_code=202 if rec.status is ModelStatus.DEPLOYING else 200)

    async def deleted(self, ids: list[str], single: bool):
        """Wait (bounded) until the reconciler removed the apps and the registry the records;
        past the bound, answer 202 with what is still being removed."""
        for model_id in ids:
            self.reconciler.ensure(model_id)
        records = await self.wait_for(lambda records: not set(ids) & set(records), DELETE_WAIT_S)
        left = sorted(set(ids) & set(records))
        if left:
            return JSONResponse({"deleted": [i for i in ids if i not in left], "deleting": left}, status_code=202)
        return {"deleted": ids[0] if single else ids}


def _handle_errors(app: FastAPI) -> None:
    """Every error in the hive's body: ``{"error": {"message", "field", "status", ...}}``."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        """Framework errors (unknown path, wrong method, unparsable body) get the hive's error body."""
        hints = {404: "unknown path; GET /admin/docs lists the admin API",
                 405: "this method is not allowed on this path; GET /admin/docs lists the admin API",
                 400: "the body is not a JSON document (UTF-8, nested less than a thousand levels); "
                      "send a JSON object with 'Content-Type: application/json'"}
        return error_response(e.status_code, hints.get(e.status_code, str(e.detail)), headers=getattr(e, "headers", None))

    @app.exception_handler(AdminError)
    async def _admin_error(_: Request, e: AdminError):
        headers = {"retry-after": str(e.extra.pop("retry_after"))} if "retry_after" in e.extra else None
        return error_response(e.status, e.message, e.field, headers=headers, **e.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        problems = validation_problems(list(e.errors()))
        message = "; ".join(f"{f}: {m}" for f, m in problems)
        return error_response(422, message, problems[0][0] if problems else None)


def under_policy(spec: ModelSpec, settings: HiveSettings) -> ModelSpec:
    """A body FastAPI parsed (it validates without context: shape only) checked again against the
    operator's policy (``core/spec.py``); a refusal is the same 422 as a shape error. Every route
    that takes a ``ModelSpec`` body calls this first."""
    try:
        return ModelSpec.under_policy(spec.model_dump(exclude_unset=True), settings)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def make_admin_app(cluster: Cluster, settings: HiveSettings, clock: Callable[[], float] = time.time,
                   declared: list[Any] | None = None) -> FastAPI:
    """The admin on ``cluster`` (its registry, planner, Serve apps and nodes), under ``settings``
    (tokens, lifecycle and hold bounds), with ``clock`` for the admin's own wall time (its
    reconciler and lifecycle read ``time.time``). ``declared``: the models the hive's Serve config
    lists (``control/admin/declared.py``), reconciled at once; None: none are (the declared records
    are left as they are). Call it on a running event loop: the app starts following the registry at
    once; ``app.state.admin.close()`` stops it."""
    admin = AdminService(cluster, settings, clock, declared)
    app = FastAPI(
        title="Ray Hive admin",
        description="Deploy, plan and remove models; inspect the GPU registry.",
        docs_url="/docs",
        openapi_url="/openapi.json",
    )
    app.state.admin = admin
    app.add_middleware(AdminGuard, settings=lambda: settings)
    _handle_errors(app)

    # --- deploy ------------------------------------------------------------------------
    @app.post("/models", status_code=202, responses=error_responses(400, 401, 404, 409, 413, 422, 503))
    async def deploy(spec: ModelSpec, wait: bool = Query(False, description="Wait until every replica is ready or failed.")):
        spec = under_policy(spec, settings)
        return await admin.respond(await admin.admit(spec), wait)

    @app.put("/models/{model_id}", responses=error_responses(400, 401, 404, 409, 413, 422, 503))
    async def update(model_id: str, spec: ModelSpec,
                     recreate: bool = Query(False, description="When a change needs new engines: delete the model "
                                                               "and deploy it with the new settings (downtime)."),
                     wait: bool = Query(False, description="After a recreate (or a deploy of an ended model): wait "
                                                           "until every replica is ready or failed.")):
        """Change a model's settings; the body is its whole spec, as POSTed (``control/admin/updates.py``).
        The same settings: 200, nothing done. Settings that take effect in place (sleep_timeout,
        idle_timeout, priority, keep_resident, routing, aliases, min/max_replicas around what runs): 200, applied.
        Anything else needs new engines: 409 saying what to do, or with ``recreate=true`` the model is
        drained, deleted and deployed again with them (202). A failed or destroyed model is deployed
        again with the body. Every 2xx answer is the model's status plus ``changed`` (the fields whose
        values differ) and ``applied``: unchanged | in_place | recreated | deployed."""
        if spec.model_id != model_id:
            raise AdminError(422, f"the body's model_id {spec.model_id!r} is not the path's {model_id!r}; a model_id "
                                  "cannot change: POST the new one and DELETE this one", "model_id")
        spec = under_policy(spec, settings)
        rec = await admin.registry.get_model.remote(model_id)
        if rec is None:
            raise AdminError(404, f"no model {model_id!r}; POST /admin/models deploys one", "model_id")
        if rec.status is ModelStatus.DELETING:
            raise AdminError(409, f"{model_id!r} is being deleted; POST /admin/models once it is gone", "model_id")
        if rec.status in ENDED:
            changed = list(spec_change(rec, spec).changed)
            return await admin.respond(await admin.admit(spec, rec.origin), wait, changed=changed, applied="deployed")
        amended = await amend(admin, rec, spec, rec.origin, recreate)
        extra = {"changed": list(amended.change.changed), "applied": amended.how}
        if amended.how is Amendment.RECREATED:
            return await admin.respond(amended.record, wait, **extra)
        return {**admin.status(amended.record).model_dump(mode="json"), **extra}

    @app.get("/declared", response_model=DeclaredReport, responses=error_responses(401))
    async def declared_models():
        """The models the hive's Serve config declares (hive-admin's ``models`` arg) and what this admin
        did about each at its start: deployed, unchanged, updated, adopted, replaced, retrying or error
        (with the message); and the declared models it deleted because the list no longer names them."""
        return admin.declared.view()

    # --- read and delete ----------------------------------------------------------------
    @app.post("/plan", responses=error_responses(400, 401, 404, 409, 413, 422, 503))
    async def plan(spec: ModelSpec, format: str = Query("json", pattern="^(json|text)$")):
        spec = under_policy(spec, settings)
        plan = await admin.plan(spec)
        if format == "text":
            return PlainTextResponse(render_plan_table(plan))
        return plan.model_dump(mode="json")

    @app.get("/models", responses=error_responses(401))
    async def list_models():
        return {"models": [admin.status(r).model_dump(mode="json") for r in await admin.registry.list_models.remote()]}

    @app.get("/models/{model_id}", responses=error_responses(401, 404))
    async def get_model(model_id: str):
        rec = await admin.registry.get_model.remote(model_id)
        if rec is None:
            raise AdminError(404, f"no model {model_id!r}; GET /admin/models lists them", "model_id")
        return admin.status(rec).model_dump(mode="json")

    @app.delete("/models/{model_id}", responses=error_responses(401, 404, 409))
    async def delete_model(model_id: str,
                           cascade: bool = Query(False, description="Delete the LoRA adapters served on it too; "
                                                                    "without it a model with adapters is a 409.")):
        how = AdapterDeletion.CASCADE if cascade else AdapterDeletion.REFUSE
        adapters = [a for a in await admin.registry.list_adapters.remote() if a.base == model_id]
        outcome = await admin.registry.transition.remote(Delete(model_id=model_id, adapters=how))
        if not outcome.ok:
            if outcome.status_code == 409:
                raise AdminError(409, outcome.message.removeprefix("delete: "), "model_id")
            raise AdminError(outcome.status_code, f"no model {model_id!r}; GET /admin/models lists them", "model_id")
        answer = await admin.deleted([model_id], single=True)
        if cascade and adapters and isinstance(answer, dict):
            answer["adapters_deleted"] = sorted(a.model_id for a in adapters)
        return answer

    # --- LoRA adapters (control/admin/adapters.py, docs/lora.md) ---------------------------------
    @app.post("/adapters", status_code=201, responses=error_responses(400, 401, 404, 409, 413, 422, 502))
    async def deploy_adapter(spec: AdapterSpec):
        """Serve a LoRA adapter on a base deployed with ``lora``: checked against the base (its config,
        rank, target modules and tensor shapes), then recorded; the base's engines load it on its first
        request. Its ``model_id`` is its name on ``/v1`` (and in ``GET /v1/models``, with the base as parent)."""
        try:
            spec = AdapterSpec.under_policy(spec.model_dump(), settings)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        rec = await admit_adapter(admin, spec)
        return JSONResponse((await adapter_status(admin, rec)).model_dump(mode="json"), status_code=201)

    @app.get("/adapters", responses=error_responses(401))
    async def list_adapters():
        held: dict[str, dict[str, list[str]]] = {}
        return {"adapters": [(await adapter_status(admin, a, held)).model_dump(mode="json")
                             for a in await admin.registry.list_adapters.remote()]}

    @app.get("/adapters/{model_id}", responses=error_responses(401, 404))
    async def get_adapter(model_id: str):
        rec = await admin.registry.get_adapter.remote(model_id)
        if rec is None:
            raise AdminError(404, f"no adapter {model_id!r}; GET /admin/adapters lists them", "model_id")
        return (await adapter_status(admin, rec)).model_dump(mode="json")

    @app.delete("/adapters/{model_id}", responses=error_responses(401, 404))
    async def delete_adapter(model_id: str):
        """Stop serving the adapter: it is gone from ``/v1`` at once, and each engine of its base unloads it."""
        rec = await remove_adapter(admin, model_id)
        return {"deleted": rec.model_id, "base": rec.base}

    # --- sleep and wake now (the status page's buttons) -----------------------------------
    @app.post("/models/{model_id}/sleep", status_code=202, responses=error_responses(401, 404, 409, 422))
    async def sleep_model(model_id: str):
        """Put a serving model to sleep now, as its sleep_timeout would: it drains, then sleeps; the
        next request wakes it (422 for a model deployed without sleep_timeout)."""
        rec = await admin.registry.get_model.remote(model_id)
        if rec is None:
            raise AdminError(404, f"no model {model_id!r}; GET /admin/models lists them", "model_id")
        outcome = await admin.registry.transition.remote(Sleep(
            model_id=model_id, version=rec.version, reason="put to sleep by an operator (POST /admin/models/{id}/sleep)"))
        if not outcome.ok:
            raise AdminError(outcome.status_code, outcome.message, "model_id")
        admin.reconciler.ensure(model_id)
        return admin.status(outcome.record).model_dump(mode="json")

    @app.post("/models/{model_id}/wake", status_code=202, responses=error_responses(401, 404, 409))
    async def wake_model(model_id: str):
        """Wake a sleeping model now, as its next request would (a serving one stays as it is)."""
        outcome = await admin.registry.transition.remote(Wake(model_id=model_id))
        if not outcome.ok:
            raise AdminError(outcome.status_code, outcome.message, "model_id")
        admin.reconciler.ensure(model_id)
        return admin.status(outcome.record).model_dump(mode="json")

    @app.get("/history", responses=error_responses(401))
    async def history():
        """The last hour and a half, in one-minute points: each model's requests/s, running and waiting
        against planned capacity, its wakes; each device's reserved, used and dormant memory. Kept by the
        admin and stored in the KV each minute; ``since`` and ``restarts`` say where it may have gaps."""
        return admin.history.view()

    @app.delete("/models", responses=error_responses(401))
    async def delete_all():
        """Every model, and the LoRA adapters on them."""
        ids = [r.model_id for r in await admin.registry.list_models.remote()]
        for model_id in ids:
            await admin.registry.transition.remote(Delete(model_id=model_id, adapters=AdapterDeletion.CASCADE))
        return await admin.deleted(ids, single=False)

    @app.get("/gpus", responses=error_responses(401))
    async def gpus():
        states: list[DeviceState] = await admin.registry.device_states.remote()
        return {"devices": [s.model_dump(mode="json") for s in states]}

    @app.get("/nodes", responses=error_responses(401))
    async def nodes():
        """Every node's host RAM (CPU engines live there), the devices on it, its weight-cache disk, its
        NVIDIA driver (and the CUDA that driver runs) and the CUDA its torch was built for."""
        disks = await admin.caches.disks()
        return {"nodes": [{**s.model_dump(mode="json"), "weights_disk": disks.get(s.node_name)}
                          for s in await admin.registry.node_states.remote()]}

    # --- weights on nodes ---------------------------------------------------------------
    @app.get("/weights", responses=error_responses(401))
    async def weights():
        """What each node's weight cache holds: source, revision, bytes, last used, in use."""
        caches = await admin.caches.listing(await admin.reconciler.weights_in_use())
        return {"nodes": {name: c.model_dump(mode="json") for name, c in caches.items()}}

    @app.post("/weights", status_code=202, responses=error_responses(400, 401, 404, 413, 422, 502))
    async def prefetch(body: PrefetchRequest):
        """Fetch a source onto nodes now, so a later deploy or wake starts without a download."""
        from hive_apps.core.weights.listing import list_source
        from hive_apps.core.weights.source import parse_source

        try:
            manifest = await off_loop(list_source, parse_source(body.model), timeout=CALL_TIMEOUT_S)
        except SourceError as e:
            raise AdminError(e.status_code, e.message, "model") from None
        alive = await admin.caches.alive()
        if body.nodes is None:
            states = await admin.registry.node_states.remote()
            chosen = [alive[s.node_name].node_id for s in states if s.node_name in alive
                      and any(not d.endswith(":cpu") for d in s.devices)]
        else:
            unknown = [n for n in body.nodes if n not in alive]
            if unknown:
                raise AdminError(404, f"no live node {unknown}; GET /admin/nodes lists them", "nodes")
            chosen = [alive[n].node_id for n in body.nodes]
        progress = await admin.caches.prefetch(manifest, chosen, await admin.reconciler.weights_in_use())
        return {"model": body.model, "key": manifest.key, "revision": manifest.revision,
                "bytes": manifest.total_bytes, "nodes": {n: p.model_dump(mode="json") for n, p in progress.items()}}

    @app.delete("/weights", responses=error_responses(401, 404, 409))
    async def remove_weights(key: str = Query(..., max_length=MAX_KEY_CHARS,
                                              description="The cache key, as GET /admin/weights lists it."),
                             node: str | None = Query(None, description="One node's copy; default: every node's.")):
        """Remove cached weights no deployed model uses (409 while one does)."""
        in_use = await admin.reconciler.weights_in_use()
        if key in in_use:
            users = [r.model_id for r in await admin.registry.list_models.remote()
                     if r.status not in ENDED and r.plan.weights is not None and r.plan.weights.key == key]
            raise AdminError(409, f"{key} is in use by {users}; DELETE those models first", "key")
        alive = await admin.caches.alive()
        if node is not None and node not in alive:
            raise AdminError(404, f"no live node {node!r}; GET /admin/nodes lists them", "node")
        ids = [alive[node].node_id] if node else [n.node_id for n in alive.values()]
        removed = await admin.caches.remove(key, ids, in_use)
        if not removed:
            raise AdminError(404, f"no node holds {key}; GET /admin/weights lists what is cached", "key")
        return {"removed": key, "nodes": removed}

    @app.post("/registry/samples", responses=error_responses(400, 401, 403, 404, 413, 422))
    async def push_sample(sample: NodeSample, request: Request):
        """Where ``python -m hive_apps.ops.monitor`` (the Kubernetes DaemonSet agent) pushes each reading,
        with its node's monitor token (or the admin token)."""
        node = monitor_token_node(settings, request.headers.get("authorization"))
        if node is not None and node != sample.node_name:
            raise AdminError(403, f"this monitor token speaks for node {node!r}, not {sample.node_name!r}: "
                                  "each node's agent pushes with its own node's token", "node_name")
        result = await admin.registry.push_sample.remote(sample)
        if not result.ok:
            raise AdminError(result.status_code, result.message, "node_name" if result.status_code == 404 else "devices")
        return {"accepted": sample.node_name, "devices": len(sample.devices)}

    @app.post("/monitor-tokens", response_model=MonitorToken, responses=error_responses(400, 401, 409, 413, 422))
    async def issue_monitor_token(body: MonitorTokenRequest):
        """The monitor token of one node (derived from ``HIVE_MONITOR_TOKEN``, or the first secret of
        ``HIVE_MONITOR_TOKEN_FILE``): give it to that node's agent only; it pushes samples of that node
        and opens nothing else."""
        secrets = settings.current_monitor_secrets()
        if not secrets:
            raise AdminError(409, "no HIVE_MONITOR_TOKEN (or HIVE_MONITOR_TOKEN_FILE) is set on the hive: set that "
                                  "secret on every Ray node, then issue node tokens from it")
        token = MonitorToken(node_name=body.node_name, token=node_monitor_token(secrets[0], body.node_name))
        return JSONResponse(token.model_dump(), headers={"cache-control": "no-store"})

    @app.post("/registry/reset", responses=error_responses(401))
    async def reset_registry():
        return await admin.registry.reset.remote()

    @app.get("/load", responses=error_responses(401))
    async def load():
        """Every serving model's replicas: running and waiting requests against planned capacity."""
        records = [r for r in await admin.registry.list_models.remote() if r.status in SERVING and r.resident]
        loads = await asyncio.gather(*(admin.lifecycle.replica_loads(r) for r in records))
        return {"models": {r.model_id: {k: v.model_dump() for k, v in ld.items()} for r, ld in zip(records, loads)}}

    @app.get("/", include_in_schema=False)
    async def status_page_shell():
        """The status page shell (no data in it; its script fetches the JSON endpoints with the token)."""
        return HTMLResponse(status_page.PAGE, headers={"cache-control": "no-store",
                                                       "content-security-policy": status_page.CSP})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "registry": await admin.registry.healthz.remote()}

    return app
