"""The routing state of one model, shared by its router and by the gateway.

Holds one handle per engine replica, polls their live load every 250 ms (every 2 s while no
request came for 2 s) and sends each
request to the replica with the lowest load relative to its planned capacity
(``routing/policy.py``). A replica that fails before answering is retried on another;
when every replica is full and the model's queue bound is reached the answer is a 429.
A request that carries many sequences (a list of prompts, n > 1) is split over replicas
by free capacity (``routing/split.py``).

The gateway keeps one ``ReplicaSet`` per ready model and calls the engines itself, so a
request through ``/v1`` crosses one hop (gateway -> engine), like one through
``/<model_id>/v1`` (router -> engine). That hop is a keep-alive HTTP request to the
replica's own port (``engine/http_server.py``) once the load poll has learnt it; until
then, or with ``HIVE_ENGINE_HTTP=0``, a Serve handle call (unary when not streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any

import aiohttp
from ray.serve.handle import DeploymentHandle

from hive_apps import metrics, names, request_ids
from hive_apps.cluster import Cluster, get_cluster
from hive_apps.engine.http_server import LOAD_PATH, OVERLOADED_HEADER, TOKEN_HEADER, EngineEndpoint
from hive_apps.engine.protocol import EngineLoad, ForwardedRequest, ResponseStart
from hive_apps.openai_errors import openai_error
from hive_apps.planning.types import Plan, ReplicaPlan
from hive_apps.routing.policy import ReplicaView, choose_replica, prompt_tokens_estimate, queue_full
from hive_apps.routing.split import CHAT, COMPLETIONS, Split, merge_answers, plan_split
from hive_apps.settings import get_settings

log = logging.getLogger("ray.serve")

LOAD_POLL_S = 0.25
# Nothing sent for IDLE_AFTER_S and nothing in flight: poll every IDLE_POLL_S only (health and
# other routers' load), and poll at once when the next request comes. Each poll costs both
# processes CPU on the cores the engines use (benchmarks/bench_vs_vllm.py, idle CPU by process).
IDLE_AFTER_S = 2.0
IDLE_POLL_S = 2.0
LOAD_TIMEOUT_S = 0.5  # with the poll period, a dead or hung replica is skipped within 1 s
PROBE_TIMEOUT_S = 5.0  # a busy engine's load answer while a long unary request waits on it
MAX_ATTEMPTS = 2
RETRY_AFTER_S = 1
JSON = ("content-type", "application/json")
REPLICA_HEADER = "x-hive-replica"
SPLITTABLE = (COMPLETIONS, CHAT)

Reply = tuple[ResponseStart, bytes]


class EngineOverloaded(Exception):
    """The engine port's own 503 at its connection limit: nothing ran, so another replica may answer."""


class EngineHung(Exception):
    """A unary request's engine stopped answering its liveness probe: it may still be generating,
    so the request is not run again elsewhere."""


def _checked(resp: aiohttp.ClientResponse) -> aiohttp.ClientResponse:
    if resp.status == 503 and OVERLOADED_HEADER in resp.headers:
        resp.release()
        raise EngineOverloaded(f"{resp.url.host}:{resp.url.port} at its connection limit")
    return resp


def default_queue_bound(plan: Plan, max_queued_requests: int | None) -> int:
    """The model's queue bound: as asked, else one more full batch of its largest replica."""
    if max_queued_requests is not None:
        return max_queued_requests
    return max((rp.settings.max_num_seqs for rp in plan.replicas), default=0)


class ReplicaSet:
    def __init__(self, model_id: str, handles: dict[int, DeploymentHandle], replicas: list[ReplicaPlan], queue_bound: int):
        self.model_id = model_id
        self.queue_bound = queue_bound
        self.handles = handles
        self.streams = {i: h.options(stream=True) for i, h in handles.items()}
        self.views = {rp.index: ReplicaView.of_plan(rp) for rp in replicas}
        self.devices = {rp.index: list(rp.devices) for rp in replicas}
        self.loads: dict[int, EngineLoad] = {}  # the last load each replica reported
        self.on_refresh: Callable[[ReplicaSet], None] | None = None  # after each load poll (the router's metrics)
        self.endpoints: dict[int, EngineEndpoint | None] = {i: None for i in handles}
        self._poller: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None
        self._used_at = 0.0  # monotonic time of the last request
        self._asking: asyncio.Task | None = None  # a poll that requests finding no healthy replica wait on
        self._wake = asyncio.Event()
        self._read_timeout_s = 0.0  # the connections' idle limit, set with them

    @classmethod
    def of_app(cls, model_id: str, plan: Plan, queue_bound: int, cluster: Cluster | None = None) -> ReplicaSet:
        """Handles to the engines of a running model app, found by name."""
        cluster = cluster or get_cluster()
        handles = {rp.index: cluster.engine_handle(model_id, rp.index) for rp in plan.replicas}
        return cls(model_id, handles, plan.replicas, queue_bound)

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_load())

    def close(self) -> None:
        """Stop polling; the connections close once the requests still on them are answered
        (a set is replaced when the model's replicas change, with requests in flight)."""
        if self._poller is not None:
            self._poller.cancel()
        if self._http is not None:
            asyncio.get_running_loop().create_task(self._close_when_idle())

    async def _close_when_idle(self) -> None:
        deadline = time.monotonic() + self._read_timeout_s
        while any(v.in_flight for v in self.views.values()) and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        if self._http is not None:
            await self._http.close()

    async def _poll_load(self) -> None:
        while True:
            await self._refresh()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S if self._idle() else LOAD_POLL_S)

    async def _refresh(self) -> None:
        """Ask every replica for its load now."""
        indices = list(self.handles)
        results = await asyncio.gather(*(self._poll_one(i) for i in indices), return_exceptions=True)
        for i, res in zip(indices, results):
            view = self.views[i]
            if isinstance(res, EngineLoad):
                view.engine_running, view.engine_waiting, view.healthy = res.running, res.waiting, True
                self.loads[i] = res
            else:
                view.healthy = False
        if self.on_refresh is not None:
            self.on_refresh(self)

    async def _any_healthy(self) -> bool:
        """Whether some replica looks healthy; if none does, ask again before giving up: a view is
        at most one poll old, and a replica that just came up was down at the last poll.
        Requests that arrive together share one such poll."""
        if not any(v.healthy for v in self.views.values()):
            if self._asking is None or self._asking.done():
                self._asking = asyncio.get_running_loop().create_task(self._refresh())
            await asyncio.shield(self._asking)
        return any(v.healthy for v in self.views.values())

    def _idle(self) -> bool:
        return time.monotonic() - self._used_at > IDLE_AFTER_S and not any(v.in_flight for v in self.views.values())

    def _touch(self) -> None:
        """A request arrived: back to polling every LOAD_POLL_S, starting now if the set was idle."""
        if self._idle():
            self._wake.set()
        self._used_at = time.monotonic()

    async def _poll_one(self, i: int) -> EngineLoad:
        """Over the replica's own port when it is known (cheap); else ask Serve, and learn the port."""
        endpoint = self.endpoints[i]
        if endpoint is not None:
            try:
                async with await self._request(endpoint, "GET", LOAD_PATH, timeout=LOAD_TIMEOUT_S) as resp:
                    if resp.status == 200:
                        return EngineLoad.model_validate_json(await resp.read())
            except Exception:
                pass
            self.endpoints[i] = None  # gone or restarted: the handle says which
        self.endpoints[i] = await asyncio.wait_for(self.handles[i].endpoint.remote(), timeout=LOAD_TIMEOUT_S)
        return await asyncio.wait_for(self.handles[i].load.remote(), timeout=LOAD_TIMEOUT_S)

    async def _request(self, endpoint: EngineEndpoint, method: str, path: str, body: bytes = b"",
                       headers: Sequence[tuple[str, str]] = (), timeout: float | None = None,
                       unary: bool = False) -> aiohttp.ClientResponse:
        """One request to a replica's own port; the caller reads and releases the response.
        ``unary``: no idle limit on the answer (``_while_alive`` watches the engine instead)."""
        if self._http is None:
            # no total deadline (answers stream for as long as they take), but a hung engine that
            # sends nothing for HIVE_ENGINE_READ_TIMEOUT_S fails the request instead of holding it
            self._read_timeout_s = get_settings().engine_read_timeout_s
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

    async def _unary_over_http(self, endpoint: EngineEndpoint, req: ForwardedRequest) -> Reply:
        async with await self._post(endpoint, req, unary=True) as resp:
            return _start_of(_checked(resp)), await resp.read()

    async def _while_alive(self, endpoint: EngineEndpoint, work: Coroutine[Any, Any, Reply]) -> Reply:
        """A non-streaming answer arrives whole when its generation ends, which may take longer than
        any idle limit: wait for it for as long as the engine's port answers a load probe every
        HIVE_ENGINE_READ_TIMEOUT_S. A probe that fails means the engine hung (``EngineHung``); an
        engine that died resets the connection, which fails ``work`` itself."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                idle_s = get_settings().engine_read_timeout_s
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
                raise EngineHung(f"the engine sent nothing for {get_settings().engine_read_timeout_s:.0f}s "
                                 "(HIVE_ENGINE_READ_TIMEOUT_S) and does not answer its load probe")
        finally:
            if not task.done():
                task.cancel()

    def replica_views(self) -> list[ReplicaView]:
        return list(self.views.values())

    def _busy(self) -> Reply | None:
        if not queue_full(self.replica_views(), self.queue_bound):
            return None
        metrics.publisher().count("hive_rejected", model=self.model_id, code="429", reason="queue_full")
        start = ResponseStart(status=429, headers=[JSON, ("retry-after", str(RETRY_AFTER_S))])
        return start, bytes(openai_error(429, f"model '{self.model_id}' is at capacity and {self.queue_bound} requests "
                                              f"are already queued; retry after {RETRY_AFTER_S}s").body)

    def _unavailable(self, last_error: Exception | None) -> Reply:
        metrics.publisher().count("hive_rejected", model=self.model_id, code="503", reason="no_replica")
        msg = f"no replica of model '{self.model_id}' could take the request"
        if last_error is not None:
            msg += f" (last error: {type(last_error).__name__})"
        return ResponseStart(status=503, headers=[JSON, ("retry-after", str(RETRY_AFTER_S))]), bytes(openai_error(503, msg).body)

    def _hung(self, e: EngineHung) -> Reply:
        metrics.publisher().count("hive_rejected", model=self.model_id, code="504", reason="engine_hung")
        return ResponseStart(status=504, headers=[JSON]), bytes(openai_error(504, f"model '{self.model_id}': {e}").body)

    def _failed(self, view: ReplicaView, e: Exception, req: ForwardedRequest) -> None:
        view.healthy = False  # until the next load poll says otherwise
        if not isinstance(e, EngineOverloaded):  # a full port is still the replica's port
            self.endpoints[view.index] = None  # a restarted replica has a new port
        log.warning("%s replica r%d failed before answering request %s: %s", self.model_id, view.index,
                    request_ids.of_headers(req.headers), e)
        metrics.publisher().count("hive_replica_failures", model=self.model_id, replica=names.replica_label(view.index))

    def _attempted(self, attempt: int) -> None:
        """Attempt ``attempt`` (0 the first) is being made; from the second on it is a retry."""
        if attempt:
            metrics.publisher().count("hive_retries", model=self.model_id)

    def _answered(self, attempt: int) -> None:
        if attempt:
            metrics.publisher().count("hive_failovers", model=self.model_id)

    async def call(self, req: ForwardedRequest, body: dict[str, Any] | None) -> Reply:
        """A non-streaming request: split over replicas when it carries many sequences, else one call.

        ``body`` is ``req.body`` as the caller already parsed it (None when it is not a JSON object).
        """
        self._touch()
        await self._any_healthy()
        # no await from the queue check to the in-flight count (in _call_one): requests that
        # arrive together must see each other
        busy = self._busy()
        if busy:
            return busy
        split = self._plan_split(req.path, body)
        if split is None:
            return await self._call_one(req)
        replies = await asyncio.gather(*(
            self._call_one(req.model_copy(update={"body": json.dumps(part.body).encode()}), prefer=part.replica)
            for part in split.parts))
        failed = next((r for r in replies if r[0].status != 200), None)
        if failed is not None:
            return failed
        merged = merge_answers(split, [json.loads(body) for _, body in replies])
        served = ",".join(names.replica_label(part.replica) for part in split.parts)
        return ResponseStart(status=200, headers=[JSON, (REPLICA_HEADER, served)]), json.dumps(merged).encode()

    def _plan_split(self, path: str, body: dict[str, Any] | None) -> Split | None:
        if body is None or path not in SPLITTABLE or len(self.views) < 2:
            return None
        return plan_split(path, body, self.replica_views())

    def _attempts(self, prefer: int | None = None) -> Iterator[ReplicaView]:
        """The replicas to try in turn: the preferred one if healthy, then the best not yet tried."""
        tried: set[int] = set()
        for _ in range(MAX_ATTEMPTS):
            view = self.views.get(prefer) if prefer is not None and not tried else None
            if view is None or not view.healthy:
                view = choose_replica(self.replica_views(), exclude=tried)
            if view is None:
                return
            tried.add(view.index)
            yield view

    async def _call_one(self, req: ForwardedRequest, prefer: int | None = None) -> Reply:
        """One unary call to the best replica (or the preferred one), retried elsewhere on failure."""
        last_error: Exception | None = None
        tokens = prompt_tokens_estimate(req.body)
        for attempt, view in enumerate(self._attempts(prefer)):
            self._attempted(attempt)
            view.in_flight += 1
            view.queued_tokens += tokens
            endpoint = self.endpoints.get(view.index)
            try:
                if endpoint is None:
                    start, body = await self.handles[view.index].forward_unary.remote(req)
                else:
                    start, body = await self._while_alive(endpoint, self._unary_over_http(endpoint, req))
                self._answered(attempt)
                return _served_by(start, view.index), body
            except EngineHung as e:  # it may still be generating: running it again elsewhere would run it twice
                self._failed(view, e, req)
                return self._hung(e)
            except Exception as e:
                last_error = e
                self._failed(view, e, req)
            finally:
                view.in_flight -= 1
                view.queued_tokens -= tokens
        return self._unavailable(last_error)

    async def stream(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """A streaming request: retried elsewhere only if the replica fails before its first item."""
        self._touch()
        await self._any_healthy()
        busy = self._busy()  # and no await from here to the in-flight count
        if busy:
            yield busy[0]
            yield busy[1]
            return
        last_error: Exception | None = None
        tokens = prompt_tokens_estimate(req.body)
        for attempt, view in enumerate(self._attempts()):
            self._attempted(attempt)
            view.in_flight += 1
            view.queued_tokens += tokens
            queued = tokens  # released at the first body bytes: the prompt is past prefill
            endpoint = self.endpoints.get(view.index)
            started = False
            try:
                if endpoint is None:
                    replies = _relay(self.streams[view.index].forward.remote(req))
                else:
                    replies = _reply_of(await self._post(endpoint, req))
                async with contextlib.aclosing(replies):  # a client that leaves closes the engine's stream too
                    async for item in replies:
                        if not started:
                            item, started = _served_by(item, view.index), True
                            self._answered(attempt)
                        elif queued:
                            view.queued_tokens, queued = view.queued_tokens - queued, 0
                        yield item
                return
            except Exception as e:
                if started:
                    raise
                last_error = e
                self._failed(view, e, req)
            finally:
                view.in_flight -= 1
                view.queued_tokens -= queued
        start, body = self._unavailable(last_error)
        yield start
        yield body


def _start_of(resp: aiohttp.ClientResponse) -> ResponseStart:
    return ResponseStart(status=resp.status, headers=list(resp.headers.items()))


async def _relay(items: Any) -> AsyncGenerator[Any, None]:
    async for item in items:
        yield item


async def _reply_of(resp: aiohttp.ClientResponse) -> AsyncGenerator[ResponseStart | bytes, None]:
    """An engine's HTTP reply in the shape a Serve stream has: its start, then body chunks."""
    async with resp:
        yield _start_of(_checked(resp))
        async for chunk in resp.content.iter_any():
            yield chunk


def _served_by(start: ResponseStart, index: int) -> ResponseStart:
    """Tell the client which replica answered (``x-hive-replica: r1``), for debugging and tests."""
    return start.model_copy(update={"headers": [*start.headers, (REPLICA_HEADER, names.replica_label(index))]})
