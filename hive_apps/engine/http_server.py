"""An engine replica's own HTTP server: the short path from a router or gateway to the engine.

A Serve handle call costs about 8 ms and much CPU on a small machine (benchmarks/
bench_gateway.py); a keep-alive HTTP request to uvicorn costs about 0.5 ms. So every
engine replica also serves its ASGI app on a port of its node, and routers send requests
and load polls there, keeping the Serve handle for learning the port, lifecycle and as the
fallback.

The port is closed to everyone without the replica's token: a random secret made at start
that only travels over Ray (``endpoint()`` on the handle), so nothing outside the cluster's
Ray traffic can call an engine around the gateway's API keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from pydantic import BaseModel

from hive_apps import request_ids

log = logging.getLogger("ray.serve")

TOKEN_HEADER = "x-hive-engine-token"
MAX_CONNECTIONS = 2048
LOAD_PATH = "/hive/load"


class EngineEndpoint(BaseModel):
    url: str  # http://<node ip>:<port>
    token: str


class _QuietServer(uvicorn.Server):
    """The replica's process owns its signals; the server must not take them over."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def guarded(app: Any, token: str, on_request: Callable[[int], None], load: Callable[[], BaseModel]) -> Any:
    """The engine's ASGI app behind the replica token; ``on_request(+1/-1)`` counts requests in flight.

    ``GET /hive/load`` answers the replica's live load, so routers poll it without a Serve call.
    """
    expected = token.encode()

    async def asgi(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        given = dict(scope["headers"]).get(TOKEN_HEADER.encode(), b"")
        if not hmac.compare_digest(given, expected):
            await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "engine port: use the hive gateway"}'})
            return
        if scope["path"] == LOAD_PATH:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": load().model_dump_json().encode()})
            return
        on_request(1)
        t0, status = time.perf_counter(), 0

        async def send_seen(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_seen)
        finally:
            on_request(-1)
            # Serve logs each handle call with its request id; this is the same line for the short
            # path. Method, path, status and id only: never a header value or the body.
            rid = dict(scope["headers"]).get(request_ids.HEADER.encode())
            rid = rid.decode() if request_ids.well_formed(rid) else "-"
            log.info("engine %s %s %d %.1fms request_id=%s", scope["method"], scope["path"], status,
                     (time.perf_counter() - t0) * 1000, rid)

    return asgi


class RunningServer:
    def __init__(self, endpoint: EngineEndpoint, server: uvicorn.Server, task: asyncio.Task):
        self.endpoint, self.server, self.task = endpoint, server, task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http_server(app: Any, on_request: Callable[[int], None], load: Callable[[], BaseModel]) -> RunningServer:
    """Serve ``app`` on a free port of this node (in HIVE_ENGINE_PORT_RANGE if set), in the running event loop."""
    import ray

    from hive_apps.engine.ports import listen_in_range
    from hive_apps.settings import get_settings

    token = secrets.token_urlsafe(24)
    host = ray.util.get_node_ip_address()  # the node's cluster address, not every interface
    sock = listen_in_range(get_settings().engine_port_range, host)  # HIVE_ENGINE_PORT_RANGE, else any free port
    port = sock.getsockname()[1]
    # Bounded: connections and requests in flight past MAX_CONNECTIONS get a 503, headers past
    # h11's 16 KiB are refused, idle keep-alive connections close after 75 s. log_config=None:
    # uvicorn's default runs logging.config.dictConfig, which closes every handler of the process,
    # Serve's replica log file among them (the replica's log then ended at this line).
    config = uvicorn.Config(guarded(app, token, on_request, load), lifespan="off", log_level="warning", log_config=None,
                            access_log=False, timeout_keep_alive=75, server_header=False, date_header=False,
                            limit_concurrency=MAX_CONNECTIONS, h11_max_incomplete_event_size=16 * 1024)
    server = _QuietServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises the reason it could not start
    endpoint = EngineEndpoint(url=f"http://{host}:{port}", token=token)
    log.info("engine HTTP server on %s", endpoint.url)
    return RunningServer(endpoint, server, task)
