"""The gateway's request logic as an ASGI app, built by ``make_gateway_app`` from its seam, settings
and clock: the Serve deployment (``serving/gateway/app.py``) wraps it, unit tests drive it in-process.

Stateless: it follows the registry's model records by long-poll (``Registry.watch``), so a model
that becomes ready, or a replica that moves, is routable as soon as the registry records it, and
routes each request straight to an engine replica of the model its ``model`` field names, with
the same ``ReplicaSet`` the model's own router uses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hive_apps.control.cluster import Cluster
from hive_apps.core import names
from hive_apps.core.auth import check_api_key
from hive_apps.core.openai_errors import openai_error
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import ENDED, LISTED, SERVING, AdapterRecord, ModelRecord
from hive_apps.ops.metrics import Publisher
from hive_apps.serving import request_ids
from hive_apps.serving.edge import config as edge
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.routing.follow import (
    FIRST_VIEW_TIMEOUT_S,
    ModelReplicas,
    NewModelLookup,
    adapter_object,
    alias_object,
    aliases_of,
    follow_registry,
    listed_adapters,
    mark_adapter,
    model_object,
    model_objects,
    registry_adapter,
    registry_record,
)
from hive_apps.serving.routing.hold import WakeHold, gone_message, wake_asker
from hive_apps.serving.routing.http import BodyFields, body_fields, request_problem, serve_as
from hive_apps.serving.routing.paths import SERVED, engine_route, is_models_list, model_object_id, split_model_route
from hive_apps.serving.routing.pipeline import OpenAIEntry, asgi


class GatewayApp(OpenAIEntry):
    """``/v1`` for every model the registry lists. An ASGI app; ``answer`` takes a Starlette request."""

    entry = "gateway"
    requires_model = True

    def __init__(self, cluster: Cluster, settings: HiveSettings, clock: Callable[[], float] = time.time,
                 replicas: int = 1, *, publisher: Publisher):
        self.settings = settings
        self.publisher = publisher
        self._records: dict[str, ModelRecord] = {}
        self._replicas = ModelReplicas(cluster, settings=settings, publisher=publisher)
        self.replicas_of = self._replicas.of
        self.hold = WakeHold(settings, wake_asker(cluster), entry="gateway", clock=clock, replicas=replicas,
                             publisher=publisher)
        self._new_models = NewModelLookup(lambda model_id: registry_record(model_id, cluster))
        self._adapters: dict[str, AdapterRecord] = {}  # LoRA adapters, served by their bases' replicas
        self._aliases: dict[str, str] = {}  # alias -> model_id
        self._new_adapters: NewModelLookup[AdapterRecord] = NewModelLookup(
            lambda name: registry_adapter(name, cluster), usable=lambda a: True)
        self._seen = asyncio.Event()
        self._follower = asyncio.get_event_loop().create_task(
            follow_registry(self._on_models, cluster, on_adapters=self._on_adapters))

    async def __call__(self, scope, receive, send) -> None:
        await asgi(self, scope, receive, send)

    def close(self) -> None:
        """Stop following the registry and close the replica sets (tests; a Serve replica just ends)."""
        self._follower.cancel()
        self._replicas.keep_only(set())

    def _on_adapters(self, adapters: list[AdapterRecord]) -> None:
        self._adapters = {a.model_id: a for a in adapters}

    def _on_models(self, records: list[ModelRecord]) -> None:
        self._records = {r.model_id: r for r in records}
        self._aliases = aliases_of({r.model_id: r for r in records if r.status not in ENDED})
        self._replicas.keep_only({r.model_id for r in records if r.status in SERVING})
        self.hold.on_models(self._records)
        self._seen.set()

    async def listed_models(self) -> dict[str, ModelRecord]:
        """Models a client may name: serving ones, and sleeping ones (a request wakes them)."""
        if not self._seen.is_set():
            await asyncio.wait_for(self._seen.wait(), FIRST_VIEW_TIMEOUT_S)
        return {k: r for k, r in self._records.items() if r.status in LISTED}

    async def before_body(self, request: Request, path: str) -> Response | None:
        if is_models_list(request.method, path):
            models = await self.listed_models()
            adapters = listed_adapters(self._adapters, models)
            return JSONResponse({"object": "list", "data": [o for r in models.values() for o in model_objects(r)]
                                 + [adapter_object(a, models[a.base]) for a in adapters.values()]})
        wanted = model_object_id(request.method, path)
        if wanted is not None:
            models = await self.listed_models()
            rec = models.get(self._aliases.get(wanted, wanted))
            adapter = listed_adapters(self._adapters, models).get(wanted)
            if adapter is not None:
                return JSONResponse(adapter_object(adapter, models[adapter.base]))
            if rec is None:
                return openai_error(404, f"The model `{wanted}` does not exist or is not ready.", "model")
            return JSONResponse(model_object(rec) if wanted == rec.model_id else alias_object(wanted, rec))
        if engine_route(request.method, path) is None:
            return openai_error(404, f"no OpenAI route {request.method} {path}; the hive serves {SERVED}")
        return None

    async def route(self, request: Request, req: ForwardedRequest, fields: BodyFields) -> ModelRecord | Response:
        assert fields.model is not None  # requires_model
        models = await self.listed_models()
        model_id = self._aliases.get(fields.model, fields.model)  # an alias is served as its model
        rec = models.get(model_id)
        if rec is None:
            adapter = self._adapters.get(model_id) or await self._new_adapters.find(model_id)
            if adapter is not None:  # a LoRA adapter: its base's replicas serve it, the name kept
                return await self._adapter_base(request, req, adapter, models)
            rec = await self._new_models.find(model_id)
        if rec is None:
            gone = gone_message(self._records.get(model_id), model_id, request_ids.of_headers(req.headers))
            known = ", ".join(models) or "none yet"
            return openai_error(404, gone or f"The model `{fields.model}` does not exist or is not ready (models: {known}).",
                                "model")
        if model_id != fields.model:
            await serve_as(req, fields, model_id)
        request.state.model = model_id
        return rec

    async def edge_choice(self, request: Request) -> Response:
        """For the edge (``serving/edge``): 200 naming the engine replica a request goes to, with the
        path vLLM serves it on, or 204 when the Serve path should answer it: a bad key, a body to
        refuse, an alias or adapter, a model not serving now (held while it wakes), a split, a 429.
        Those answers and their counts stay the Serve path's, so they are written once."""
        decline = Response(status_code=204)
        if check_api_key(self.settings, request.headers.get("authorization")) is not None:
            return decline
        if self.settings.cors_origins and "origin" in request.headers:  # CORS headers are the pipeline's
            return decline
        model_id, path = split_model_route(request.headers.get(edge.FORWARDED_PATH_HEADER, ""))
        route = engine_route("POST", path)
        if route is None:
            return decline
        raw = await request.body()
        req = ForwardedRequest(path=route, headers=[("content-type", request.headers.get("content-type", ""))], body=raw)
        fields = body_fields(req)
        name = model_id or fields.model
        if fields.body is None or name is None or fields.model not in (None, name):
            return decline
        if await request_problem(route, req, fields, self.settings.media_hosts) is not None:
            return decline
        rec = self._records.get(name)
        if rec is None or rec.status not in SERVING:
            return decline
        picked = self.replicas_of(rec).pick(route, raw, fields.body)
        if picked is None:
            return decline
        view, why, endpoint = picked
        url = urlsplit(endpoint.url)
        self.publisher.count("hive_edge_routed", model=name, route=why)
        return Response(status_code=200, headers={
            edge.DST_HEADER: url.hostname or "", edge.PORT_HEADER: str(url.port), edge.TOKEN_HEADER: endpoint.token,
            edge.PATH_HEADER: route, edge.REPLICA_HEADER: names.replica_label(view.index), edge.ROUTE_HEADER: why})

    async def _adapter_base(self, request: Request, req: ForwardedRequest, adapter: AdapterRecord,
                            models: dict[str, ModelRecord]) -> ModelRecord | Response:
        """The record of the adapter's base, with the request marked for the adapter (its engine loads it)."""
        base = models.get(adapter.base) or await self._new_models.find(adapter.base)
        if base is None:
            gone = gone_message(self._records.get(adapter.base), adapter.base, request_ids.of_headers(req.headers))
            return openai_error(404, f"The model `{adapter.model_id}` is a LoRA adapter of `{adapter.base}`, which "
                                     f"is not serving" + (f": {gone}" if gone else "."), "model")
        mark_adapter(req, adapter)
        request.state.model = adapter.model_id
        return base


def make_gateway_app(cluster: Cluster, settings: HiveSettings, clock: Callable[[], float] = time.time,
                     replicas: int = 1, *, publisher: Publisher) -> GatewayApp:
    """The gateway on ``cluster`` (its registry and engines), under ``settings`` (API keys, hold
    bounds, media hosts), with ``clock`` for wall time, as one of ``replicas`` gateway replicas
    (they share the hold bound), counting its requests on ``publisher``. Call it on a running event
    loop: the app starts following the registry at once."""
    return GatewayApp(cluster, settings, clock, replicas, publisher=publisher)
