"""The ``hive-gateway`` Serve app at ``/v1``: one OpenAI endpoint for every model.

A thin Serve shell around ``make_gateway_app`` (``gateway/ingress.py``), which holds the request
logic. Any number of gateway replicas can run; each keeps its own load view, rebuilt from the
registry after a restart.
"""

from __future__ import annotations

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from hive_apps import names
from hive_apps.auth import warn_if_open
from hive_apps.cluster import get_cluster
from hive_apps.gateway.ingress import make_gateway_app
from hive_apps.settings import get_settings


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class Gateway:
    def __init__(self):
        settings = get_settings()
        warn_if_open(settings, names.GATEWAY_APP)
        self.app = make_gateway_app(get_cluster(), settings)

    async def __call__(self, request: Request) -> Response:
        return await self.app.answer(request)


def build(_: dict | None = None):
    return Gateway.bind()  # type: ignore[attr-defined]  # added by @serve.deployment
