"""The per-model router: ingress of the model's app at ``/<model_id>``.

A thin Serve shell around ``ReplicaSet`` on the request pipeline it shares with the gateway
(``serving/routing/pipeline.py``): it checks the API key, cuts the route prefix and passes the request
to the best replica. It starts from the engines its app was built
with and follows the model's record in the registry, so a replica lost with its node stops
getting requests as soon as the registry records the loss.
"""

from __future__ import annotations

import asyncio
import contextlib

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hive_apps.core import names
from hive_apps.core.openai_errors import openai_error
from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.core.settings import get_settings
from hive_apps.core.state.records import LISTED, SERVING, AdapterRecord, ModelRecord, ModelStatus
from hive_apps.ops import metrics
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.routing.follow import (
    FIRST_VIEW_TIMEOUT_S,
    ModelReplicas,
    NewModelLookup,
    alias_object,
    follow_registry,
    mark_adapter,
    model_object,
)
from hive_apps.serving.routing.hold import WakeHold
from hive_apps.serving.routing.http import BodyFields, respond, serve_as
from hive_apps.serving.routing.paths import engine_route, is_models_list, model_object_id
from hive_apps.serving.routing.pipeline import OpenAIEntry
from hive_apps.serving.routing.replica_set import ReplicaSet


class Router(OpenAIEntry):
    entry = "router"

    def __init__(self, model_id: str, engines: list[DeploymentHandle], replicas: list[ReplicaPlan], queue_bound: int):
        """A composition root (Serve builds it): the settings and the metrics publisher are made here."""
        self.settings = get_settings()
        self.publisher = metrics.Publisher()
        self.model_id = model_id
        self.record: ModelRecord | None = None  # the model's record, in whatever state
        self._sets = ModelReplicas(settings=self.settings, publisher=self.publisher)
        self.replicas: ReplicaSet | None = None
        if replicas:  # a parked model's app has its router only
            first = ReplicaSet(model_id, {rp.index: h for rp, h in zip(replicas, engines)}, replicas, queue_bound,
                               settings=self.settings, publisher=self.publisher)
            first.on_refresh = self._publish_load
            first.start()
            self.replicas = first
            self._sets.adopt(model_id, replicas, first)
        self.hold = WakeHold(self.settings, publisher=self.publisher)
        self.replicas_of = self._sets.of
        self._first_view = asyncio.Event()  # the registry's first answer came
        self._newer: NewModelLookup[ModelRecord] = NewModelLookup()
        self.adapters: dict[str, AdapterRecord] = {}  # the LoRA adapters served on this model
        self._follower = asyncio.get_event_loop().create_task(
            follow_registry(self._on_models, on_adapters=self._on_adapters))

    async def _current(self) -> ModelRecord | None:
        """The model's record as this router follows it; while that still says deploying, asked of the
        registry once (bounded): the deploy may have answered ready a moment before the long-poll came
        here, and the client's next request is already on its way (seen in the cluster tier: a chat on
        /<id>/v1 right after one on /v1 got "deploying and not ready yet")."""
        rec = self.record
        if rec is not None and rec.status is ModelStatus.DEPLOYING:
            return await self._newer.find(self.model_id) or rec
        return rec

    def _on_adapters(self, adapters: list[AdapterRecord]) -> None:
        self.adapters = {a.model_id: a for a in adapters if a.base == self.model_id}

    def _on_models(self, records: list[ModelRecord]) -> None:
        self._first_view.set()
        rec = next((r for r in records if r.model_id == self.model_id), None)
        self.hold.on_models({rec.model_id: rec} if rec is not None else {})
        if rec is None:
            return
        self.record = rec
        if rec.status in SERVING:
            self.replicas = self._sets.of(rec)
            self.replicas.on_refresh = self._publish_load
        else:
            self._sets.keep_only(set())
            self.replicas = None
            self._publish_load(None)

    def _publish_load(self, replicas: ReplicaSet | None) -> None:
        """Per-replica gauges after each load poll; a replica gone (or the model asleep) goes to 0."""
        samples = [] if replicas is None else metrics.replica_samples(
            self.model_id, replicas.replica_views(), replicas.loads, replicas.devices)
        self.publisher.gauges("replicas", samples)

    async def __call__(self, request: Request) -> Response:
        """HTTP entry at /<model_id>/...: the path below the prefix goes to the engine as is."""
        return await self.answer(request)

    def path_of(self, request: Request) -> str:
        root = request.scope.get("root_path", "")
        path = request.url.path[len(root):] if root and request.url.path.startswith(root) else request.url.path
        return path or "/"

    def model_tag(self, request: Request) -> str:
        return self.model_id

    async def before_body(self, request: Request, path: str) -> Response | None:
        if not self._first_view.is_set():  # a router just started: its model's record is on its way
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first_view.wait(), FIRST_VIEW_TIMEOUT_S)
        wanted = model_object_id(request.method, path)
        if wanted is not None:
            rec = await self._current()  # a deploy that just answered ready: its record may not be here yet
            if rec is None or rec.status not in LISTED or wanted not in (self.model_id, *rec.spec.aliases):
                return openai_error(404, f"The model `{wanted}` does not exist here; this route serves `{self.model_id}`.", "model")
            return JSONResponse(model_object(rec) if wanted == self.model_id else alias_object(wanted, rec))
        if not is_models_list(request.method, path) and engine_route(request.method, path) is None:
            return openai_error(404, f"no OpenAI route {request.method} {path} under /{self.model_id}")
        return None

    async def route(self, request: Request, req: ForwardedRequest, fields: BodyFields) -> ModelRecord | Response:
        adapter = self.adapters.get(fields.model) if fields.model else None
        if adapter is not None:  # /<base>/v1 with model: <adapter>: the engine loads it first
            mark_adapter(req, adapter)
        rec = await self._current()
        if rec is None:  # the first view of the registry has not come yet: the engines it was built with
            if self.replicas is None:
                return openai_error(503, f"model '{self.model_id}' is starting; retry shortly", headers={"retry-after": "1"})
            return await respond(self.replicas, req, fields)
        if fields.model in rec.spec.aliases:  # the engines know the model by its id only
            await serve_as(req, fields, self.model_id)
        return rec


def router_deployment():
    return serve.deployment(Router, name=names.ROUTER_DEPLOYMENT, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
