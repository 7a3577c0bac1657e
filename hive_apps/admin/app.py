"""The ``hive-admin`` Serve app at ``/admin``: validate, plan, reserve, add and remove model apps.

Durable state (model records, reservations) lives in the registry, so this replica can be
killed at any time: on start it resumes watching every deploy still in progress.
Model apps are added imperatively with ``serve.run_many`` without blocking, and a watcher
polls ``serve.status()`` against a deadline (``serve.run`` itself has no timeout).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from ray.serve.schema import ApplicationStatus

from hive_apps.admin.failures import failure_reason
from hive_apps.admin.model_app import build_model_app
from hive_apps.admin.schemas import ModelStatusResponse
from hive_apps.auth import check_admin_token, warn_if_open
from hive_apps.planning.report import render_plan_table
from hive_apps.registry.devices import NodeSample
from hive_apps.registry.ledger import DeviceState
from hive_apps.registry.records import STARTING, ModelRecord, ModelStatus, Reservation
from hive_apps.settings import get_settings
from hive_apps.spec import ModelSpec

log = logging.getLogger("ray.serve")

REGISTRY_APP = "hive-registry"
PLANNER_APP = "hive-planner"
STATUS_POLL_S = 1.0
HEAL_PERIOD_S = 2.0
PICKLE_RACE_ATTEMPTS = 4


class AdminError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.field, self.extra = status, message, field, extra


def error_response(status: int, message: str, field: str | None = None, **extra) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "status": status, **extra}}, status_code=status)


app = FastAPI(
    title="Ray Hive admin",
    description="Deploy, plan and remove models; inspect the GPU registry.",
    docs_url="/docs",
    openapi_url="/openapi.json",
)


@app.exception_handler(AdminError)
async def _admin_error(_: Request, e: AdminError):
    return error_response(e.status, e.message, e.field, **e.extra)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    problems = []
    for err in e.errors():
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
        field = ".".join(loc) or "body"
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field; allowed fields are {', '.join(ModelSpec.model_fields)}"
        elif field == "body" and err.get("type") in ("model_attributes_type", "dict_type", "json_invalid"):
            msg = "the body must be a JSON object; send it with 'Content-Type: application/json'"
        problems.append((field, msg))
    message = "; ".join(f"{f}: {m}" for f, m in problems)
    return error_response(422, message, problems[0][0] if problems else None)


def require_admin(request: Request) -> None:
    reason = check_admin_token(get_settings(), request.headers.get("authorization"))
    if reason:
        raise AdminError(401, reason)


async def _engine_start_times(model_id: str, rec: ModelRecord) -> dict[str, float]:
    """How long each engine took to start by itself, as the replicas measured it."""
    out = {}
    for rp in rec.plan.replicas:
        try:
            handle = serve.get_deployment_handle(f"engine-r{rp.index}", app_name=model_id)
            info = await asyncio.wait_for(handle.info.remote(), timeout=10)
            if "engine_start_s" in info:
                out[f"r{rp.index}"] = round(info["engine_start_s"], 2)
        except Exception as e:  # informational only
            log.warning("no start time from %s/r%d: %s", model_id, rp.index, e)
    return out


def _app_status(model_id: str) -> tuple[str, str]:
    apps = serve.status().applications
    app_status = apps.get(model_id)
    if app_status is None:
        return "MISSING", "the app is not known to Serve"
    messages = [app_status.message] + [d.message for d in app_status.deployments.values() if d.message]
    return app_status.status, failure_reason(" | ".join(m for m in messages if m))


def _delete_app(model_id: str) -> None:
    if model_id in serve.status().applications:
        serve.delete(model_id, _blocking=True)


@serve.deployment(num_replicas=1, max_ongoing_requests=200, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Admin:
    def __init__(self):
        self.settings = get_settings()
        warn_if_open(self.settings, "hive-admin")
        self.watchers: dict[str, asyncio.Task] = {}
        self._serve_lock = threading.Lock()
        self.done: dict[str, asyncio.Event] = {}
        self._resume = asyncio.get_event_loop().create_task(self._resume_watchers())
        self._healer = asyncio.get_event_loop().create_task(self._heal_loop())

    @property
    def registry(self):
        return serve.get_app_handle(REGISTRY_APP)

    @property
    def planner(self):
        return serve.get_app_handle(PLANNER_APP)

    async def _resume_watchers(self) -> None:
        for rec in await self.registry.list_models.remote():
            if rec.status in STARTING:
                log.info("resuming the watch of %s", rec.model_id)
                self._watch(rec.model_id)

    # --- deploy ------------------------------------------------------------------------
    async def _plan(self, spec: ModelSpec):
        devices = await self.registry.capacities.remote()
        outcome = await self.planner.plan.remote(spec, devices)
        if outcome.plan is None:
            raise AdminError(outcome.status_code, outcome.error, rejected=[r.model_dump() for r in outcome.rejected])
        return outcome.plan

    @app.post("/models", status_code=202, dependencies=[Depends(require_admin)])
    async def deploy(self, spec: ModelSpec, wait: bool = Query(False, description="Wait until every replica is ready or failed.")):
        existing = await self.registry.get_model.remote(spec.model_id)
        if existing is not None and existing.status is not ModelStatus.FAILED:
            raise AdminError(409, f"model_id {spec.model_id!r} is already {existing.status.value}; "
                                  "DELETE /admin/models/{id} first or choose another model_id", "model_id")
        plan = await self._plan(spec)
        record = ModelRecord(model_id=spec.model_id, spec=spec, plan=plan)
        if existing is not None:  # a failed deploy may be retried under the same id
            await self.registry.delete_model.remote(spec.model_id)
        if not await self.registry.claim_model.remote(record):
            raise AdminError(409, f"model_id {spec.model_id!r} was taken by a concurrent deploy", "model_id")
        result = await self.registry.reserve.remote([Reservation.for_replica(spec.model_id, rp) for rp in plan.replicas])
        if not result.ok:
            await self.registry.delete_model.remote(spec.model_id)
            raise AdminError(result.status_code, result.message)
        try:
            await asyncio.to_thread(self._start_app, spec.model_id, plan, spec.max_queued_requests)
        except Exception as e:  # Serve refused the app: undo everything
            await self._cleanup(spec.model_id, f"Serve refused the app: {e}", delete_app=True)
            raise AdminError(422, f"could not create the model app: {e}")
        self._watch(spec.model_id)
        if wait:
            await self.done[spec.model_id].wait()
        rec = await self.registry.get_model.remote(spec.model_id)
        body = ModelStatusResponse.of(rec).model_dump(mode="json")
        if rec.status is ModelStatus.FAILED:
            return error_response(422, f"deploy of {spec.model_id!r} failed: {rec.message}", status_detail=body)
        return JSONResponse(body, status_code=200 if rec.status is ModelStatus.READY else 202)

    def _start_app(self, model_id: str, plan, max_queued_requests: int | None) -> None:
        # Serve pickles apps with cloudpickle, whose by-value module registry is global and not
        # thread-safe: concurrent run_many calls from the threadpool fail randomly, so they take
        # a lock. Serve's own handle threads touch the same registry (every RequestRouterConfig
        # registers and unregisters its module), which no lock of ours covers; that race fails
        # the build before anything reaches the controller, so it is retried.
        for attempt in range(1, PICKLE_RACE_ATTEMPTS + 1):
            try:
                with self._serve_lock:
                    app = build_model_app(model_id, plan, max_queued_requests)
                    serve.run_many(
                        [serve.RunTarget(app, name=model_id, route_prefix=f"/{model_id}")],
                        wait_for_ingress_deployment_creation=False,
                        wait_for_applications_running=False,
                    )
                return
            except ValueError as e:
                if "registered for pickle by value" not in str(e) or attempt == PICKLE_RACE_ATTEMPTS:
                    raise
                log.warning("building app %s raced Serve's pickle registry (attempt %d): %s", model_id, attempt, e)
                time.sleep(0.2 * attempt)

    def _watch(self, model_id: str) -> None:
        self.done[model_id] = asyncio.Event()
        self.watchers[model_id] = asyncio.get_event_loop().create_task(self._watch_deploy(model_id))

    async def _watch_deploy(self, model_id: str) -> None:
        try:
            deadline = time.time() + self.settings.deploy_timeout_s
            while True:
                rec = await self.registry.get_model.remote(model_id)
                if rec is None or rec.status not in STARTING:
                    return
                status, message = await asyncio.to_thread(_app_status, model_id)
                if status == ApplicationStatus.RUNNING:
                    healed = rec.status is ModelStatus.HEALING
                    rec.status, rec.healing_replicas = ModelStatus.READY, []
                    if not healed:
                        rec.ready_at = time.time()
                    rec.engine_start_s = await _engine_start_times(model_id, rec)
                    await self.registry.put_model.remote(rec)
                    await self.registry.activate.remote(model_id)
                    log.info("model %s ready after %.1fs", model_id, time.time() - rec.created_at)
                    return
                failed = status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)
                if failed or time.time() > deadline:
                    reason = (f"an engine failed to start: {message}" if failed else
                              f"not ready within {self.settings.deploy_timeout_s:.0f}s (HIVE_DEPLOY_TIMEOUT_S); "
                              f"last status {status}: {message}")
                    if rec.status is ModelStatus.HEALING:
                        await self._heal_failed(rec, reason)
                    else:
                        await self._cleanup(model_id, reason, delete_app=True)
                    return
                await asyncio.sleep(STATUS_POLL_S)
        except Exception as e:
            log.exception("watching %s failed", model_id)
            await self._cleanup(model_id, f"internal error while deploying: {e}", delete_app=True)
        finally:
            self.done.setdefault(model_id, asyncio.Event()).set()

    async def _cleanup(self, model_id: str, reason: str, delete_app: bool) -> None:
        """A failed deploy leaves no app and no reservation; the record says why."""
        log.warning("deploy of %s failed: %s", model_id, reason)
        if delete_app:
            await asyncio.to_thread(_delete_app, model_id)
        await self.registry.release.remote(model_id)
        rec = await self.registry.get_model.remote(model_id)
        if rec is not None:
            rec.status, rec.message = ModelStatus.FAILED, reason
            await self.registry.put_model.remote(rec)

    # --- self-healing -------------------------------------------------------------------
    async def _heal_loop(self) -> None:
        while True:
            await asyncio.sleep(HEAL_PERIOD_S)
            if not self.settings.self_heal:
                continue
            try:
                for rec in await self.registry.list_models.remote():
                    if rec.status is ModelStatus.DEGRADED and rec.lost_replicas:
                        await self._heal(rec)
            except Exception as e:  # e.g. the registry is restarting; the next pass retries
                log.warning("self-healing pass failed: %s", e)

    async def _heal(self, rec: ModelRecord) -> None:
        """Place replacements for replicas lost with their node, where capacity exists."""
        lost = sorted(int(k[1:]) for k in rec.lost_replicas)
        if rec.spec.gpu is not None:
            note = "pinned replicas are not replaced automatically; redeploy with other pins"
            if note not in rec.message:
                rec.message = f"{rec.message}; {note}"
                await self.registry.put_model.remote(rec)
            return
        spec = rec.spec.model_copy(update={"replicas": len(lost)})
        outcome = await self.planner.plan.remote(spec, await self.registry.capacities.remote())
        if outcome.plan is None:
            note = f"no capacity to replace {sorted(rec.lost_replicas)} yet: {outcome.error}"
            if rec.message != note:
                rec.message = note
                await self.registry.put_model.remote(rec)
            return
        replacements = [rp.model_copy(update={"index": i}) for rp, i in zip(outcome.plan.replicas, lost)]
        result = await self.registry.reserve.remote([Reservation.for_replica(rec.model_id, rp) for rp in replacements])
        if not result.ok:
            return  # capacity moved under us; the next pass plans again
        kept = [rp for rp in rec.plan.replicas if rp.index not in lost]
        rec.plan = rec.plan.model_copy(update={"replicas": sorted(kept + replacements, key=lambda rp: rp.index)})
        rec.status, rec.healing_replicas = ModelStatus.HEALING, lost
        rec.message = "replacing " + ", ".join(f"r{rp.index} on {'+'.join(rp.devices)}" for rp in replacements)
        rec.lost_replicas = {}
        await self.registry.put_model.remote(rec)
        log.info("%s: %s", rec.model_id, rec.message)
        try:
            await asyncio.to_thread(self._start_app, rec.model_id, rec.plan, rec.spec.max_queued_requests)
        except Exception as e:
            await self._heal_failed(rec, f"Serve refused the new replicas: {e}")
            return
        self._watch(rec.model_id)

    async def _heal_failed(self, rec: ModelRecord, reason: str) -> None:
        await self.registry.release_replicas.remote(rec.model_id, rec.healing_replicas)
        rec.lost_replicas = {f"r{i}": f"replacement failed: {reason}" for i in rec.healing_replicas}
        rec.status, rec.healing_replicas, rec.message = ModelStatus.DEGRADED, [], f"self-healing failed: {reason}"
        await self.registry.put_model.remote(rec)

    # --- read and delete ----------------------------------------------------------------
    @app.post("/plan", dependencies=[Depends(require_admin)])
    async def plan(self, spec: ModelSpec, format: str = Query("json", pattern="^(json|text)$")):
        plan = await self._plan(spec)
        if format == "text":
            return PlainTextResponse(render_plan_table(plan))
        return plan.model_dump(mode="json")

    @app.get("/models", dependencies=[Depends(require_admin)])
    async def list_models(self):
        return {"models": [ModelStatusResponse.of(r).model_dump(mode="json") for r in await self.registry.list_models.remote()]}

    @app.get("/models/{model_id}", dependencies=[Depends(require_admin)])
    async def get_model(self, model_id: str):
        rec = await self.registry.get_model.remote(model_id)
        if rec is None:
            raise AdminError(404, f"no model {model_id!r}; GET /admin/models lists them", "model_id")
        return ModelStatusResponse.of(rec).model_dump(mode="json")

    @app.delete("/models/{model_id}", dependencies=[Depends(require_admin)])
    async def delete_model(self, model_id: str):
        rec = await self.registry.get_model.remote(model_id)
        if rec is None:
            raise AdminError(404, f"no model {model_id!r}; GET /admin/models lists them", "model_id")
        await self._delete(rec)
        return {"deleted": model_id}

    async def _delete(self, rec: ModelRecord) -> None:
        rec.status = ModelStatus.DELETING
        await self.registry.put_model.remote(rec)
        await asyncio.to_thread(_delete_app, rec.model_id)
        await self.registry.release.remote(rec.model_id)
        await self.registry.delete_model.remote(rec.model_id)

    @app.delete("/models", dependencies=[Depends(require_admin)])
    async def delete_all(self):
        recs = await self.registry.list_models.remote()
        await asyncio.gather(*(self._delete(r) for r in recs))
        return {"deleted": [r.model_id for r in recs]}

    @app.get("/gpus", dependencies=[Depends(require_admin)])
    async def gpus(self):
        states: list[DeviceState] = await self.registry.device_states.remote()
        return {"devices": [s.model_dump(mode="json") for s in states]}

    @app.get("/nodes", dependencies=[Depends(require_admin)])
    async def nodes(self):
        """Every node's host RAM (CPU engines live there) and the devices on it."""
        return {"nodes": [s.model_dump(mode="json") for s in await self.registry.node_states.remote()]}

    @app.post("/registry/samples", dependencies=[Depends(require_admin)])
    async def push_sample(self, sample: NodeSample):
        """Where ``python -m hive_apps.monitor`` (the Kubernetes DaemonSet agent) pushes each reading."""
        result = await self.registry.push_sample.remote(sample)
        if not result.ok:
            raise AdminError(result.status_code, result.message, "node_name")
        return {"accepted": sample.node_name, "devices": len(sample.devices)}

    @app.post("/registry/reset", dependencies=[Depends(require_admin)])
    async def reset_registry(self):
        return await self.registry.reset.remote()

    @app.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "registry": await self.registry.healthz.remote()}


def build(_: dict | None = None):
    return Admin.bind()
