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
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from pydantic import BaseModel
from uvicorn.protocols.http.flow_control import service_unavailable

# httptools, not h11: ray[serve] requires uvicorn[standard], which brings it, and it parses a
# request in about half h11's time. Imported here so a missing parser fails the engine's start
# instead of silently serving without the bounds below.
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hive_apps.serving import request_ids

log = logging.getLogger("ray.serve")

TOKEN_HEADER = "x-hive-engine-token"
MAX_CONNECTIONS = 2048
LOAD_PATH = "/hive/load"
PREFIX_PATH = "/hive/prefix"  # GET: the prompt blocks the replica was sent (serving/engine/prefix_memory.py)
# A request line and headers past this get a 431 (uvicorn's h11_max_incomplete_event_size does
# nothing under httptools, which took 24 MB of headers).
MAX_HEAD_BYTES = 16 * 1024
# A connection must finish its request line and headers this long after it opened (or after the
# first byte of its next request), and the body this long after the headers; else it is closed.
# Without them 2,048 idle or half-sent connections took every slot of MAX_CONNECTIONS.
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
# Marks the 503 uvicorn answers itself past MAX_CONNECTIONS (before the app runs): routers fail
# over to another replica on it, and pass on any other 503 (an engine's own answer).
OVERLOADED_HEADER = "x-hive-engine-overloaded"


class EngineEndpoint(BaseModel):
    url: str  # http://<node ip>:<port>
    token: str


class _QuietServer(uvicorn.Server):
    """The replica's process owns its signals; the server must not take them over."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _overloaded(scope: dict, receive: Callable, send: Callable) -> None:
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (OVERLOADED_HEADER.encode(), b"1"),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": b"engine port: connection limit reached"})


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on each request's head size and read time.

    One timer per connection: armed at ``connection_made`` and at the first byte of each later
    request (``on_message_begin``) for HEAD_TIMEOUT_S, re-armed for BODY_TIMEOUT_S at the end
    of the headers, cancelled once the request is read. Idle keep-alive connections between
    requests still close on uvicorn's own ``timeout_keep_alive``.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head, self._head_bytes, self._head_too_large = True, 0, False
        self._read_timer: asyncio.TimerHandle | None = None
        self._arm(HEAD_TIMEOUT_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _arm(self, seconds: float | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = None if seconds is None else self.loop.call_later(seconds, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.close()  # the app, if running, sees http.disconnect

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A head still unfinished after this chunk: llhttp hands a header to on_header only
        # once complete, so an endless one is caught by counting the bytes it came in.
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._read_timer is None:  # a later request on a kept-alive connection
            self._arm(HEAD_TIMEOUT_S)

    def on_headers_complete(self) -> None:
        self._in_head = False
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise ValueError("request head too large")  # httptools stops; uvicorn calls send_400_response
        self._arm(BODY_TIMEOUT_S)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._arm(None)
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def _refuse_head(self) -> None:
        self._in_head = False
        if self.cycle is None or self.cycle.response_complete:  # never inside another response
            body = b"request line and headers too large"
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # uvicorn's own 503 past limit_concurrency, swapped for one that says so (OVERLOADED_HEADER)
        super()._start_asgi_task(cycle, _overloaded if app is service_unavailable else app)  # type: ignore[arg-type]


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
        if scope["path"] == PREFIX_PATH:  # a router reading what the replica holds: not a request of a user
            await app(scope, receive, send)
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
            rid = rid.decode() if rid is not None and request_ids.well_formed(rid) else "-"
            log.info("engine %s %s %d %.1fms request_id=%s", scope["method"], scope["path"], status,
                     (time.perf_counter() - t0) * 1000, rid)

    return asgi


class RunningServer:
    def __init__(self, endpoint: EngineEndpoint, server: uvicorn.Server, task: asyncio.Task):
        self.endpoint, self.server, self.task = endpoint, server, task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve_on(config: uvicorn.Config, sock: socket.socket) -> tuple[uvicorn.Server, asyncio.Task]:
    """Run ``config``'s app on ``sock`` in the running event loop, once it has started; raises why it could not."""
    server = _QuietServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises the reason it could not start
    return server, task


async def start_http_server(app: Any, on_request: Callable[[int], None], load: Callable[[], BaseModel],
                            port_range: tuple[int, int] | None) -> RunningServer:
    """Serve ``app`` on a free port of this node (in ``port_range``, HIVE_ENGINE_PORT_RANGE, if set),
    in the running event loop."""
    import ray

    from hive_apps.core.ports import listen_in_range

    token = secrets.token_urlsafe(24)
    host = ray.util.get_node_ip_address()  # the node's cluster address, not every interface
    sock = listen_in_range(port_range, host)  # HIVE_ENGINE_PORT_RANGE, else any free port
    port = sock.getsockname()[1]
    # Bounded: connections and requests in flight past MAX_CONNECTIONS get a 503 (OVERLOADED_HEADER),
    # a request's head and read time by BoundedHttpProtocol, idle keep-alive connections close
    # after 75 s (the router's pool closes its own after 15 s). log_config=None:
    # uvicorn's default runs logging.config.dictConfig, which closes every handler of the process,
    # Serve's replica log file among them (the replica's log then ended at this line).
    config = uvicorn.Config(guarded(app, token, on_request, load), lifespan="off", log_level="warning", log_config=None,
                            access_log=False, timeout_keep_alive=75, server_header=False, date_header=False,
                            limit_concurrency=MAX_CONNECTIONS, http=BoundedHttpProtocol, ws="none")
    server, task = await serve_on(config, sock)
    endpoint = EngineEndpoint(url=f"http://{host}:{port}", token=token)
    log.info("engine HTTP server on %s", endpoint.url)
    return RunningServer(endpoint, server, task)
