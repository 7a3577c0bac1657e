"""The ``hive-gateway`` Serve app at ``/v1``: one OpenAI endpoint for every model.

A thin Serve shell around ``make_gateway_app`` (``serving/gateway/ingress.py``), which holds the request
logic. Two replicas by default (``args: {replicas: N}`` in serve_configs/hive.yaml), so the
request path has no single point of failure: behind Serve's HAProxy ingress a request the killed
one closed unanswered is retried on the other (hive_apps/ops/serve_env.py). Each keeps its own load
view, rebuilt from the registry after a restart, and its part of each model's hold bound.
With ``HIVE_EDGE_PORT`` set, each replica also runs the edge on its node (``serving/edge``): an
HAProxy that asks it where a request goes and carries the bytes to that engine replica itself.
"""

from __future__ import annotations

import asyncio
import logging

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from hive_apps.control.cluster import get_cluster
from hive_apps.core import names
from hive_apps.core.auth import warn_if_open
from hive_apps.core.settings import HiveSettings, get_settings
from hive_apps.ops.metrics import Publisher
from hive_apps.serving.edge.config import EdgeConfig
from hive_apps.serving.edge.service import Edge, start_edge
from hive_apps.serving.gateway.ingress import make_gateway_app

log = logging.getLogger("ray.serve")

REPLICAS = 2
EDGE_DRAIN_S = 15.0  # within Serve's graceful_shutdown_timeout_s (20 s by default)


class GatewayArgs(BaseModel):
    """The gateway app's ``args`` in serve_configs/hive.yaml."""

    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(REPLICAS, ge=1, le=64, description="gateway replicas (Serve spreads them over the cluster)")


@serve.deployment(max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class Gateway:
    def __init__(self, replicas: int = REPLICAS):
        settings = get_settings()
        warn_if_open(settings, names.GATEWAY_APP)
        self.app = make_gateway_app(get_cluster(), settings, replicas=replicas, publisher=Publisher())
        self.edge: Edge | None = None
        if settings.edge_port is not None:
            asyncio.get_event_loop().create_task(self._start_edge(settings))

    async def _start_edge(self, settings: HiveSettings) -> None:
        """HAProxy on HIVE_EDGE_PORT, deciding here; without it the Serve path still serves everything."""
        assert settings.edge_port is not None
        try:
            serve_addr = await asyncio.to_thread(get_cluster().serve_ingress)
            cfg = EdgeConfig(port=settings.edge_port, serve_addr=serve_addr,
                             read_timeout_s=settings.engine_read_timeout_s)
            self.edge = await start_edge(cfg, self.app.edge_choice)
        except Exception as e:  # EdgeUnavailable, or Serve not answering where its ingress is
            log.error("no edge on port %d (HIVE_EDGE_PORT): %s", settings.edge_port, e)

    async def __del__(self) -> None:
        """Serve calls it when it stops the replica (a redeploy, a scale-down, shutdown): the edge stops
        taking connections at once and finishes the answers it is streaming, within Serve's graceful
        shutdown. A replica killed outright takes its edge with it (PR_SET_PDEATHSIG)."""
        if self.edge is not None:
            await self.edge.stop(grace_s=EDGE_DRAIN_S)

    async def __call__(self, request: Request) -> Response:
        return await self.app.answer(request)


def build(args: dict | None = None):
    replicas = GatewayArgs.model_validate(args or {}).replicas
    return Gateway.options(num_replicas=replicas).bind(replicas)  # type: ignore[attr-defined]  # added by @serve.deployment
