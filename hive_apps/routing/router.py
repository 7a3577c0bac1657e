"""The per-model router: ingress of the model's app at ``/<model_id>`` and target of the gateway.

Holds one handle per engine replica, polls their live load every 250 ms and sends each
request to the replica with the lowest load relative to its planned capacity
(``routing/policy.py``). A replica that fails before answering is retried on another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from hive_apps.auth import check_api_key
from hive_apps.engine.protocol import EngineLoad, ForwardedRequest, ResponseStart
from hive_apps.openai_errors import openai_error
from hive_apps.planning.types import ReplicaPlan
from hive_apps.routing.http import BodyTooLarge, read_forwarded, to_response, too_large
from hive_apps.routing.policy import ReplicaView, choose_replica, queue_full
from hive_apps.settings import get_settings

log = logging.getLogger("ray.serve")

LOAD_POLL_S = 0.25
LOAD_TIMEOUT_S = 0.5  # with the poll period, a dead or hung replica is skipped within 1 s
MAX_ATTEMPTS = 2
RETRY_AFTER_S = 1


class Router:
    def __init__(self, model_id: str, engines: list[DeploymentHandle], replicas: list[ReplicaPlan], queue_bound: int):
        self.model_id = model_id
        self.queue_bound = queue_bound
        self.settings = get_settings()
        self.handles = {rp.index: h for rp, h in zip(replicas, engines)}
        self.streams = {i: h.options(stream=True) for i, h in self.handles.items()}
        self.views = {rp.index: ReplicaView.of_plan(rp) for rp in replicas}
        self._poller = asyncio.get_event_loop().create_task(self._poll_load())

    async def _poll_load(self) -> None:
        while True:
            indices = list(self.handles)
            results = await asyncio.gather(
                *(asyncio.wait_for(self.handles[i].load.remote(), timeout=LOAD_TIMEOUT_S) for i in indices), return_exceptions=True
            )
            for i, res in zip(indices, results):
                view = self.views[i]
                if isinstance(res, EngineLoad):
                    view.engine_running, view.engine_waiting, view.healthy = res.running, res.waiting, True
                else:
                    view.healthy = False
            await asyncio.sleep(LOAD_POLL_S)

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Send one request to the best replica; retry elsewhere if it fails before answering."""
        if queue_full(list(self.views.values()), self.queue_bound):
            yield ResponseStart(status=429, headers=[("content-type", "application/json"), ("retry-after", str(RETRY_AFTER_S))])
            yield openai_error(429, f"model '{self.model_id}' is at capacity and {self.queue_bound} requests are "
                                    f"already queued; retry after {RETRY_AFTER_S}s").body
            return
        tried: set[int] = set()
        last_error: Exception | None = None
        for _ in range(MAX_ATTEMPTS):
            view = choose_replica(list(self.views.values()), exclude=tried)
            if view is None:
                break
            tried.add(view.index)
            view.in_flight += 1
            started = False
            try:
                async for item in self.streams[view.index].forward.remote(req):
                    started = True
                    yield item
                return
            except Exception as e:
                if started:
                    raise
                last_error = e
                view.healthy = False  # until the next load poll says otherwise
                log.warning("%s replica r%d failed before answering: %s", self.model_id, view.index, e)
            finally:
                view.in_flight -= 1
        yield ResponseStart(status=503, headers=[("content-type", "application/json")])
        msg = f"no replica of model '{self.model_id}' could take the request"
        if last_error is not None:
            msg += f" (last error: {type(last_error).__name__})"
        yield openai_error(503, msg).body

    def replica_views(self) -> list[ReplicaView]:
        return list(self.views.values())

    async def __call__(self, request: Request) -> Response:
        """HTTP entry at /<model_id>/...: the path below the prefix goes to the engine as is."""
        reason = check_api_key(self.settings, request.headers.get("authorization"))
        if reason:
            return openai_error(401, reason)
        root = request.scope.get("root_path", "")
        path = request.url.path[len(root):] if root and request.url.path.startswith(root) else request.url.path
        try:
            req = await read_forwarded(request, path or "/")
        except BodyTooLarge:
            return too_large()
        stream = self.forward(req)
        return await to_response(stream)


def router_deployment():
    return serve.deployment(Router, name="router", max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})

