"""How a replica set reaches its engine replicas: one interface, two ways, as vLLM's
``EngineCoreClient`` has one client interface over in-process and multiprocess engines.

``HttpTransport``: a keep-alive HTTP request to each replica's own token-guarded port
(``serving/engine/http_server.py``: about 0.5 ms, against about 8 ms for a Serve handle call), a port it
learns over Serve; a replica whose port it does not know yet is called over Serve meanwhile.
``ServeTransport``: Serve handle calls only (unary when not streaming). ``make_transport`` picks
one from the settings it is given (``HIVE_ENGINE_HTTP``).
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Coroutine, Mapping, Sequence
from typing import Any

import aiohttp
from ray.serve.handle import DeploymentHandle

from hive_apps.core.settings import HiveSettings
from hive_apps.serving.engine.http_server import LOAD_PATH, OVERLOADED_HEADER, PREFIX_PATH, TOKEN_HEADER, EngineEndpoint
from hive_apps.serving.engine.protocol import EngineLoad, ForwardedRequest, ResponseStart

LOAD_TIMEOUT_S = 0.5  # with the poll period, a dead or hung replica is skipped within 1 s
PROBE_TIMEOUT_S = 5.0  # a busy engine's load answer while a long unary request waits on it
PREFIX_TIMEOUT_S = 5.0  # reading what an engine was sent, once per replica a router reaches

Reply = tuple[ResponseStart, bytes]
Replies = AsyncGenerator[ResponseStart | bytes, None]


class EngineOverloaded(Exception):
    """The engine port's own 503 at its connection limit: nothing ran, so another replica may answer."""


class EngineHung(Exception):
    """A unary request's engine stopped answering its liveness probe: it may still be generating,
    so the request is not run again elsewhere."""


class EngineTransport(ABC):
    """The calls a replica set makes to its replica ``i``; each raises when the replica fails before answering."""

    @abstractmethod
    async def load(self, i: int) -> EngineLoad:
        """The replica's load now, within LOAD_TIMEOUT_S: the load poll's liveness probe."""

    @abstractmethod
    async def prefix_keys(self, i: int) -> list[int]:
        """The prompt blocks replica ``i``'s engine was sent (``serving/engine/prefix_memory.py``)."""

    @abstractmethod
    async def call(self, i: int, req: ForwardedRequest) -> Reply:
        """A non-streaming request, its reply whole. ``EngineHung``: it may still run, so never send it again."""

    @abstractmethod
    def stream(self, i: int, req: ForwardedRequest) -> Replies:
        """A reply as it comes (its start, then body chunks); closing it closes the engine's stream."""

    @abstractmethod
    def failed(self, i: int, error: Exception) -> None:
        """A request to replica ``i`` failed before answering with ``error``."""

    @abstractmethod
    def close(self) -> None:
        """Stop; a connection closes once the requests still on it are answered."""


class ServeTransport(EngineTransport):
    def __init__(self, handles: Mapping[int, DeploymentHandle]):
        self.handles = dict(handles)
        self.streams = {i: h.options(stream=True) for i, h in handles.items()}

    async def endpoint(self, i: int) -> EngineEndpoint | None:
        """The replica's own port (None when it serves none: ``HIVE_ENGINE_HTTP=0`` there)."""
        return await asyncio.wait_for(self.handles[i].endpoint.remote(), timeout=LOAD_TIMEOUT_S)

    async def load(self, i: int) -> EngineLoad:
        return await asyncio.wait_for(self.handles[i].load.remote(), timeout=LOAD_TIMEOUT_S)

    async def prefix_keys(self, i: int) -> list[int]:
        return await asyncio.wait_for(self.handles[i].prefix_keys.remote(), timeout=PREFIX_TIMEOUT_S)

    async def call(self, i: int, req: ForwardedRequest) -> Reply:
        start, body = await self.handles[i].forward_unary.remote(req)
        return start, body

    def stream(self, i: int, req: ForwardedRequest) -> Replies:
        return _relay(self.streams[i].forward.remote(req))

    def failed(self, i: int, error: Exception) -> None:
        pass  # a handle outlives its replica's restarts: nothing to forget

    def close(self) -> None:
        pass  # Serve owns the handles' connections


class HttpTransport(EngineTransport):
    def __init__(self, serve: ServeTransport, read_timeout_s: float):
        """``read_timeout_s``: HIVE_ENGINE_READ_TIMEOUT_S, the longest an engine may send nothing."""
        self.serve = serve  # learns each replica's port, and answers for one whose port is not known
        self.endpoints: dict[int, EngineEndpoint | None] = {i: None for i in serve.handles}
        self._http: aiohttp.ClientSession | None = None
        self._read_timeout_s = read_timeout_s  # the connections' idle limit
        self._in_flight = 0  # requests on the connections now
        self._late: set[int] = set()  # replicas whose last poll on their port was late

    async def load(self, i: int) -> EngineLoad:
        """Over the replica's own port when it is known (cheap); else ask Serve, and learn the port.
        One late answer on the known port raises ``TimeoutError`` and keeps the port: a busy engine's
        port is still its port (forgetting it sent its requests the slow way until Serve answered).
        Late twice in a row, Serve is asked again (the replica may have moved to another node)."""
        endpoint = self.endpoints[i]
        if endpoint is not None:
            try:
                async with await self._request(endpoint, "GET", LOAD_PATH, timeout=LOAD_TIMEOUT_S) as resp:
                    if resp.status == 200:
                        self._late.discard(i)
                        return EngineLoad.model_validate_json(await resp.read())
            except TimeoutError:
                if i not in self._late:
                    self._late.add(i)
                    raise
            except Exception:
                pass
            self._late.discard(i)
            self.endpoints[i] = None  # refused or reset: gone or restarted, the handle says which
        self.endpoints[i] = await self.serve.endpoint(i)
        return await self.serve.load(i)

    async def prefix_keys(self, i: int) -> list[int]:
        endpoint = self.endpoints.get(i)
        if endpoint is None:
            return await self.serve.prefix_keys(i)
        async with await self._request(endpoint, "GET", PREFIX_PATH, timeout=PREFIX_TIMEOUT_S) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the engine's {PREFIX_PATH} answered {resp.status}")
            return [int(k) for k in json.loads(await resp.read())]

    async def call(self, i: int, req: ForwardedRequest) -> Reply:
        endpoint = self.endpoints.get(i)
        if endpoint is None:
            return await self.serve.call(i, req)
        self._in_flight += 1
        try:
            return await self._while_alive(endpoint, self._unary(endpoint, req))
        finally:
            self._in_flight -= 1

    def stream(self, i: int, req: ForwardedRequest) -> Replies:
        endpoint = self.endpoints.get(i)
        return self.serve.stream(i, req) if endpoint is None else self._stream(endpoint, req)

    def failed(self, i: int, error: Exception) -> None:
        if not isinstance(error, EngineOverloaded):  # a full port is still the replica's port
            self.endpoints[i] = None  # a restarted replica has a new port

    def close(self) -> None:
        if self._http is not None:
            asyncio.get_running_loop().create_task(self._close_when_idle())

    async def _close_when_idle(self) -> None:
        deadline = time.monotonic() + self._read_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        if self._http is not None:
            await self._http.close()

    async def _request(self, endpoint: EngineEndpoint, method: str, path: str, body: bytes = b"",
                       headers: Sequence[tuple[str, str]] = (), timeout: float | None = None,
                       unary: bool = False) -> aiohttp.ClientResponse:
        """One request to a replica's own port; the caller reads and releases the response.
        ``unary``: no idle limit on the answer (``_while_alive`` watches the engine instead)."""
        if self._http is None:
            # no total deadline (answers stream for as long as they take), but a hung engine that
            # sends nothing for HIVE_ENGINE_READ_TIMEOUT_S fails the request instead of holding it
            idle_limit = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=self._read_timeout_s)
            self._http = aiohttp.ClientSession(timeout=idle_limit, connector=aiohttp.TCPConnector(limit=0),
                                               auto_decompress=False)
        extra: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        if unary:
            extra = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=None)}
        return await self._http.request(method, endpoint.url + path, data=body,
                                        headers=[*headers, (TOKEN_HEADER, endpoint.token)], **extra)

    async def _post(self, endpoint: EngineEndpoint, req: ForwardedRequest, unary: bool = False) -> aiohttp.ClientResponse:
        path = req.path + (f"?{req.query}" if req.query else "")
        return await self._request(endpoint, req.method, path, req.body, req.headers, unary=unary)

    async def _unary(self, endpoint: EngineEndpoint, req: ForwardedRequest) -> Reply:
        async with await self._post(endpoint, req, unary=True) as resp:
            return _start_of(_checked(resp)), await resp.read()

    async def _stream(self, endpoint: EngineEndpoint, req: ForwardedRequest) -> Replies:
        """An engine's HTTP reply in the shape a Serve stream has: its start, then body chunks."""
        self._in_flight += 1
        try:
            async with await self._post(endpoint, req) as resp:
                yield _start_of(_checked(resp))
                async for chunk in resp.content.iter_any():
                    yield chunk
        finally:
            self._in_flight -= 1

    async def _while_alive(self, endpoint: EngineEndpoint, work: Coroutine[Any, Any, Reply]) -> Reply:
        """A non-streaming answer arrives whole when its generation ends, which may take longer than
        any idle limit: wait for it for as long as the engine's port answers a load probe every
        HIVE_ENGINE_READ_TIMEOUT_S. A probe that fails means the engine hung (``EngineHung``); an
        engine that died resets the connection, which fails ``work`` itself."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                idle_s = self._read_timeout_s
                done, _ = await asyncio.wait({task}, timeout=idle_s)
                if done:
                    return task.result()
                try:
                    async with await self._request(endpoint, "GET", LOAD_PATH,
                                                   timeout=min(PROBE_TIMEOUT_S, idle_s)) as probe:
                        if probe.status == 200:
                            continue
                except (TimeoutError, aiohttp.ClientError):
                    pass
                raise EngineHung(f"the engine sent nothing for {idle_s:.0f}s "
                                 "(HIVE_ENGINE_READ_TIMEOUT_S) and does not answer its load probe")
        finally:
            if not task.done():
                task.cancel()


def make_transport(handles: Mapping[int, DeploymentHandle], settings: HiveSettings) -> EngineTransport:
    """The one place the way to the engines is chosen: their own ports unless HIVE_ENGINE_HTTP=0."""
    serve = ServeTransport(handles)
    return HttpTransport(serve, settings.engine_read_timeout_s) if settings.engine_http else serve


def _checked(resp: aiohttp.ClientResponse) -> aiohttp.ClientResponse:
    if resp.status == 503 and OVERLOADED_HEADER in resp.headers:
        resp.release()
        raise EngineOverloaded(f"{resp.url.host}:{resp.url.port} at its connection limit")
    return resp


def _start_of(resp: aiohttp.ClientResponse) -> ResponseStart:
    return ResponseStart(status=resp.status, headers=list(resp.headers.items()))


async def _relay(items: Any) -> Replies:
    async for item in items:
        yield item
