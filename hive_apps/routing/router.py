"""The per-model router: ingress of the model's app at ``/<model_id>``.

A thin Serve shell around ``ReplicaSet``: it checks the API key, cuts the route prefix
and passes the request to the best replica.
"""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from hive_apps import names
from hive_apps.auth import check_api_key
from hive_apps.openai_errors import openai_error
from hive_apps.planning.types import ReplicaPlan
from hive_apps.routing.http import BodyTooLarge, body_fields, read_forwarded, respond, too_large
from hive_apps.routing.replica_set import ReplicaSet
from hive_apps.settings import get_settings


class Router:
    def __init__(self, model_id: str, engines: list[DeploymentHandle], replicas: list[ReplicaPlan], queue_bound: int):
        self.settings = get_settings()
        self.replicas = ReplicaSet(model_id, {rp.index: h for rp, h in zip(replicas, engines)}, replicas, queue_bound)
        self.replicas.start()

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
        return await respond(self.replicas, req, body_fields(req))


def router_deployment():
    return serve.deployment(Router, name=names.ROUTER_DEPLOYMENT, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
