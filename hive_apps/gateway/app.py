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

from hive_apps import metrics, names, request_ids
from hive_apps.auth import check_api_key, warn_if_open
from hive_apps.openai_errors import openai_error
from hive_apps.registry.records import LISTED, SERVING, ModelRecord
from hive_apps.routing.follow import FIRST_VIEW_TIMEOUT_S, ModelReplicas, NewModelLookup, follow_registry, model_object
from hive_apps.routing.hold import WakeHold, client_of, gone_message
from hive_apps.routing.http import BodyTooLarge, parse_fields, read_forwarded, request_problem, respond_for, too_large
from hive_apps.routing.paths import engine_route, is_models_list, model_object_id
from hive_apps.settings import get_settings

log = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class Gateway:
    def __init__(self):
        self.settings = get_settings()
        warn_if_open(self.settings, names.GATEWAY_APP)
        self._records: dict[str, ModelRecord] = {}
        self._replicas = ModelReplicas()
        self._hold = WakeHold(self.settings, entry="gateway")
        self._new_models = NewModelLookup()
        self._seen = asyncio.Event()
        self._follower = asyncio.get_event_loop().create_task(follow_registry(self._on_models))

    def _on_models(self, records: list[ModelRecord]) -> None:
        self._records = {r.model_id: r for r in records}
        self._replicas.keep_only({r.model_id for r in records if r.status in SERVING})
        self._hold.on_models(self._records)
        self._seen.set()

    async def listed_models(self) -> dict[str, ModelRecord]:
        """Models a client may name: serving ones, and sleeping ones (a request wakes them)."""
        if not self._seen.is_set():
            await asyncio.wait_for(self._seen.wait(), FIRST_VIEW_TIMEOUT_S)
        return {k: r for k, r in self._records.items() if r.status in LISTED}

    async def __call__(self, request: Request) -> Response:
        response = await self._answer(request)
        # the model tag only for a model the hive serves: a client's made-up names are not series
        metrics.publisher().count("hive_requests", model=getattr(request.state, "model", ""), entry="gateway",
                                  code=str(response.status_code))
        return response

    async def _answer(self, request: Request) -> Response:
        reason = check_api_key(self.settings, request.headers.get("authorization"))
        if reason:
            return openai_error(401, reason)
        path = request.url.path
        if is_models_list(request.method, path):
            models = await self.listed_models()
            return JSONResponse({"object": "list", "data": [model_object(r) for r in models.values()]})
        wanted = model_object_id(request.method, path)
        if wanted is not None:
            rec = (await self.listed_models()).get(wanted)
            if rec is None:
                return openai_error(404, f"The model `{wanted}` does not exist or is not ready.", "model")
            return JSONResponse(model_object(rec))
        if engine_route(request.method, path) is None:
            return openai_error(404, f"no OpenAI route {request.method} {path}; the hive serves "
                                     "POST /v1/chat/completions, /v1/completions, /v1/embeddings and GET /v1/models")
        try:
            req = await read_forwarded(request, path)
        except BodyTooLarge:
            return too_large()
        fields = await parse_fields(req)
        if fields.model is None:
            return openai_error(400, "the request body must be JSON with a 'model' field naming a model from GET /v1/models", "model")
        problem = await request_problem(path, req, fields, self.settings.media_hosts)
        if problem is not None:
            return openai_error(400, *problem)
        models = await self.listed_models()
        rec = models.get(fields.model) or await self._new_models.find(fields.model)
        if rec is None:
            gone = gone_message(self._records.get(fields.model), fields.model, request_ids.of_headers(req.headers))
            known = ", ".join(models) or "none yet"
            return openai_error(404, gone or f"The model `{fields.model}` does not exist or is not ready (models: {known}).", "model")
        request.state.model = fields.model
        return await respond_for(rec, self._replicas.of, self._hold, req, fields,
                                 client_of(request.headers.get("authorization")))


def build(_: dict | None = None):
    return Gateway.bind()  # type: ignore[attr-defined]  # added by @serve.deployment
