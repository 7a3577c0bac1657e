"""The ``hive-gateway`` Serve app at ``/v1``: one OpenAI endpoint for every model.

Stateless: it reads the set of ready models from the registry (cached for a second) and
routes each request straight to an engine replica of the model its ``model`` field names,
with the same ``ReplicaSet`` the model's own router uses. Any number of gateway replicas
can run; each keeps its own load view, rebuilt from the registry after a restart.
"""

from __future__ import annotations

import logging
import time

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hive_apps.auth import check_api_key, warn_if_open
from hive_apps.openai_errors import openai_error
from hive_apps.registry.records import SERVING, ModelRecord
from hive_apps.routing.http import BodyTooLarge, body_fields, read_forwarded, respond, too_large
from hive_apps.routing.replica_set import ReplicaSet, default_queue_bound, replica_fingerprint
from hive_apps.settings import get_settings

log = logging.getLogger("ray.serve")

MODELS_TTL_S = 1.0


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class Gateway:
    def __init__(self):
        self.settings = get_settings()
        warn_if_open(self.settings, "hive-gateway")
        self._models: dict[str, ModelRecord] = {}
        self._models_at = 0.0
        self._sets: dict[str, tuple[tuple, ReplicaSet]] = {}

    async def ready_models(self, refresh: bool = False) -> dict[str, ModelRecord]:
        if refresh or time.monotonic() - self._models_at > MODELS_TTL_S:
            records = await serve.get_app_handle("hive-registry").list_models.remote()
            self._models = {r.model_id: r for r in records if r.status in SERVING}
            self._models_at = time.monotonic()
            for gone in set(self._sets) - set(self._models):
                self._sets.pop(gone)[1].close()
        return self._models

    def _replicas(self, rec: ModelRecord) -> ReplicaSet:
        """The model's replica set, rebuilt when its plan changed (a healed replica moved)."""
        fingerprint = replica_fingerprint(rec.plan)
        known = self._sets.get(rec.model_id)
        if known is None or known[0] != fingerprint:
            if known is not None:
                known[1].close()
            bound = default_queue_bound(rec.plan, rec.spec.max_queued_requests)
            replicas = ReplicaSet.of_app(rec.model_id, rec.plan, bound)
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
            models = await self.ready_models(refresh=True)
        if fields.model not in models:
            known = ", ".join(models) or "none yet"
            return openai_error(404, f"The model `{fields.model}` does not exist or is not ready (ready models: {known}).", "model")
        return await respond(self._replicas(models[fields.model]), req, fields)


def build(_: dict | None = None):
    return Gateway.bind()
