"""The gateway replica's side of the edge: its loopback decision port, and the HAProxy that asks it.

``start_edge`` serves ``choose`` (the gateway's ``edge_choice``) on 127.0.0.1 behind a token of its
own, then starts HAProxy on ``HIVE_EDGE_PORT`` with that port and token (``process.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import uvicorn
from starlette.requests import Request
from starlette.responses import Response

from hive_apps.serving.edge.config import DECIDE_TOKEN_HEADER, ROUTE_PATH, EdgeConfig
from hive_apps.serving.edge.process import EdgeProcess
from hive_apps.serving.engine.http_server import serve_on

log = logging.getLogger("ray.serve")

Choose = Callable[[Request], Awaitable[Response]]


def decision_app(choose: Choose, token: str):
    """``POST /hive/route`` with the edge's token, answered by ``choose``; anything else a 403."""
    expected = token.encode()

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        given = dict(scope["headers"]).get(DECIDE_TOKEN_HEADER.encode(), b"")
        if scope["path"] != ROUTE_PATH or not hmac.compare_digest(given, expected):
            await Response(status_code=403)(scope, receive, send)
            return
        await (await choose(Request(scope, receive)))(scope, receive, send)

    return app


@dataclass
class Edge:
    process: EdgeProcess
    server: uvicorn.Server
    task: asyncio.Task

    async def stop(self, grace_s: float = 0.0) -> None:
        """HAProxy first (given ``grace_s`` to finish the answers it streams: they need no decision),
        then the decision port."""
        await asyncio.to_thread(self.process.stop, grace_s)
        self.server.should_exit = True
        await self.task


async def start_edge(cfg: EdgeConfig, choose: Choose) -> Edge:
    """The decision port, then HAProxy; raises ``EdgeUnavailable`` when HAProxy cannot start."""
    token = secrets.token_urlsafe(24)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(decision_app(choose, token), lifespan="off", log_level="warning", log_config=None,
                            access_log=False, server_header=False, date_header=False, ws="none")
    server, task = await serve_on(config, sock)
    process = EdgeProcess(cfg, sock.getsockname()[1], token)
    try:
        process.spawn()  # here, on the loop's thread (see spawn); the wait in a worker thread
        await asyncio.to_thread(process.wait_listening)
    except Exception:
        server.should_exit = True
        await task
        raise
    return Edge(process, server, task)
