"""The ``hive-gateway`` Serve app at ``/v1``: one OpenAI endpoint for every model.

Stateless: it follows the registry's model records by long-poll (``Registry.watch``), so a
model that becomes ready, or a replica that moves, is routable as soon as the registry
records it, and routes each request straight to an engine replica of the model its
``model`` field names, with the same ``ReplicaSet`` the model's own router uses. Any number
of gateway replicas can run; each keeps its own load view, rebuilt from the registry after
a restart.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hive_apps import names
from hive_apps.auth import check_api_key, warn_if_open
from hive_apps.cluster import get_cluster
from hive_apps.openai_errors import openai_error
from hive_apps.registry.records import SERVING, ModelRecord
from hive_apps.routing.http import BodyTooLarge, body_fields, read_forwarded, respond, too_large
from hive_apps.routing.replica_set import ReplicaSet, default_queue_bound, replica_fingerprint
from hive_apps.settings import get_settings

log = logging.getLogger("ray.serve")

WATCH_S = 30.0
FIRST_VIEW_TIMEOUT_S = 10.0


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class Gateway:
    def __init__(self):
        self.settings = get_settings()
        warn_if_open(self.settings, "hive-gateway")
        self._models: dict[str, ModelRecord] = {}
        self._sets: dict[str, tuple[tuple, ReplicaSet]] = {}
        self._seen = asyncio.Event()
        self._follower = asyncio.get_event_loop().create_task(self._follow())

    async def _follow(self) -> None:
        """Keep the set of serving models as the registry announces changes."""
        registry = get_cluster().app_handle(names.REGISTRY_APP)
        after = -1
        while True:
            try:
                view = await registry.watch.remote(after, WATCH_S)
                after = view.version
                self._models = {r.model_id: r for r in view.models if r.status in SERVING}
                for gone in set(self._sets) - set(self._models):
                    self._sets.pop(gone)[1].close()
                self._seen.set()
            except Exception as e:  # the registry is restarting: ask again shortly
                log.warning("following the registry failed: %s", e)
                await asyncio.sleep(0.5)

    async def ready_models(self) -> dict[str, ModelRecord]:
        if not self._seen.is_set():
            await asyncio.wait_for(self._seen.wait(), FIRST_VIEW_TIMEOUT_S)
        return self._models

    def _replicas(self, rec: ModelRecord) -> ReplicaSet:
        """The model's replica set, rebuilt when its live replicas changed (one was lost or moved)."""
        live = rec.plan.model_copy(update={"replicas": [
            rp for rp in rec.plan.replicas if names.replica_label(rp.index) not in rec.lost_replicas]})
        fingerprint = replica_fingerprint(live)
        known = self._sets.get(rec.model_id)
        if known is None or known[0] != fingerprint:
            if known is not None:
                known[1].close()
            bound = default_queue_bound(rec.plan, rec.spec.max_queued_requests)
            replicas = ReplicaSet.of_app(rec.model_id, live, bound)
            replicas.start()
            self._sets[rec.model_id] = (fingerprint, replicas)
        return self._sets[rec.model_id][1]

    async def __call__(self, request: Request) -> Response:
        reason = check_api_key(self.settings, request.headers.get("authorization"))
        if reason:
            return openai_error(401, reason)
        path = request.url.path
        if request.method == "GET" and path.rstrip("/") == "/v1/models":
            models = await self.ready_models()
            return JSONResponse({"object": "list", "data": [
                {"id": m, "object": "model", "created": int(r.created_at), "owned_by": "ray-hive",
                 "max_model_len": r.plan.replicas[0].settings.max_model_len if r.plan.replicas else None}
                for m, r in models.items()]})
        try:
            req = await read_forwarded(request, path)
        except BodyTooLarge:
            return too_large()
        fields = body_fields(req)
        if fields.model is None:
            return openai_error(400, "the request body must be JSON with a 'model' field naming a model from GET /v1/models", "model")
        models = await self.ready_models()
        if fields.model not in models:
            known = ", ".join(models) or "none yet"
            return openai_error(404, f"The model `{fields.model}` does not exist or is not ready (ready models: {known}).", "model")
        return await respond(self._replicas(models[fields.model]), req, fields)


def build(_: dict | None = None):
    return Gateway.bind()
