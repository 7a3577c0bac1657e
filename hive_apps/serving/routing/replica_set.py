"""The routing state of one model, shared by its router and by the gateway.

Sends each request to the live replica most likely to hold its prompt's prefix while that one has
planned room (``serving/routing/prefix.py``; ``routing: least_loaded`` in the spec turns that off), else
to the lowest load relative to its planned capacity (``serving/routing/policy.py``); a replica that fails before answering is retried on another; when
every replica is full and the model's queue bound is reached the answer is a 429. A request
that carries many sequences (a list of prompts, n > 1) is split over replicas by free
capacity (``serving/routing/split.py``). Which replicas are live, and their load, come from the load
poll (``serving/routing/liveness.py``); the calls go over ``serving/routing/transport.py``.

The gateway keeps one ``ReplicaSet`` per ready model and calls the engines itself, so a
request through ``/v1`` crosses one hop (gateway -> engine), like one through
``/<model_id>/v1`` (router -> engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from hive_apps.control.cluster import Cluster, get_cluster
from hive_apps.core import names
from hive_apps.core.openai_errors import openai_error
from hive_apps.core.planning.types import Plan, ReplicaPlan
from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import Routing
from hive_apps.ops import metrics
from hive_apps.serving import request_ids
from hive_apps.serving.engine.http_server import EngineEndpoint
from hive_apps.serving.engine.protocol import ADAPTER_HEADER, AdapterRef, EngineLoad, ForwardedRequest, ResponseStart
from hive_apps.serving.routing.liveness import LoadPoll, is_live, mark_failed
from hive_apps.serving.routing.policy import EDGE_PICK_TTL_S, ReplicaView, prompt_tokens_estimate, queue_full
from hive_apps.serving.routing.prefix import PrefixIndex, cache_blocks, request_keys
from hive_apps.serving.routing.split import CHAT, COMPLETIONS, Split, merge_answers, plan_split
from hive_apps.serving.routing.transport import EngineHung, HttpTransport, Reply, make_transport

log = logging.getLogger("ray.serve")

MAX_ATTEMPTS = 2
RETRY_AFTER_S = 1
JSON = ("content-type", "application/json")
REPLICA_HEADER = "x-hive-replica"
ROUTE_HEADER = "x-hive-route"  # why that replica: prefix | least-loaded | split | retry
SPLIT, RETRY = "split", "retry"
SPLITTABLE = (COMPLETIONS, CHAT)
PARSE_ON_LOOP_BYTES = 2**20


def default_queue_bound(plan: Plan, max_queued_requests: int | None) -> int:
    """The model's queue bound: as asked, else one more full batch of its largest replica."""
    if max_queued_requests is not None:
        return max_queued_requests
    return max((rp.settings.max_num_seqs for rp in plan.replicas), default=0)


class ReplicaSet(LoadPoll):
    def __init__(self, model_id: str, handles: dict[int, DeploymentHandle], replicas: list[ReplicaPlan], queue_bound: int,
                 routing: Routing = Routing.PREFIX, kv_bytes_per_token: int | None = None, *,
                 settings: HiveSettings, publisher: metrics.Publisher):
        """``settings``: how the engines are reached (HIVE_ENGINE_HTTP, HIVE_ENGINE_READ_TIMEOUT_S);
        ``publisher``: where its rejections, retries and failovers are counted."""
        super().__init__({rp.index: ReplicaView.of_plan(rp) for rp in replicas})
        self.publisher = publisher
        self.model_id = model_id
        self.routing = routing  # the model's record may change it (follow.py ModelReplicas.of)
        self.prefixes = PrefixIndex({rp.index: cache_blocks(rp, kv_bytes_per_token) for rp in replicas})
        self.queue_bound = queue_bound
        self.handles = handles
        self.devices = {rp.index: list(rp.devices) for rp in replicas}
        self.transport = make_transport(handles, settings)
        self._learnt: set[int] = set()  # replicas whose engines told this set what they were sent
        self._learning: set[int] = set()

    @classmethod
    def of_app(cls, model_id: str, plan: Plan, queue_bound: int, cluster: Cluster | None = None, *,
               settings: HiveSettings, publisher: metrics.Publisher) -> ReplicaSet:
        """Handles to the engines of a running model app, found by name."""
        cluster = cluster or get_cluster()
        handles = {rp.index: cluster.engine_handle(model_id, rp.index) for rp in plan.replicas}
        return cls(model_id, handles, plan.replicas, queue_bound, kv_bytes_per_token=plan.profile.kv_bytes_per_token,
                   settings=settings, publisher=publisher)

    @property
    def endpoints(self) -> dict[int, EngineEndpoint | None]:
        """The ports the HTTP transport learnt (None: not yet; empty with HIVE_ENGINE_HTTP=0), for tests and debugging."""
        return self.transport.endpoints if isinstance(self.transport, HttpTransport) else {}

    @endpoints.setter
    def endpoints(self, known: dict[int, EngineEndpoint | None]) -> None:
        if isinstance(self.transport, HttpTransport):
            self.transport.endpoints = known

    def close(self) -> None:
        """Stop polling; the connections close once the requests still on them are answered
        (a set is replaced when the model's replicas change, with requests in flight)."""
        self.stop()
        self.transport.close()

    async def _poll_one(self, i: int) -> EngineLoad:
        load = await self.transport.load(i)
        if i not in self._learnt and i not in self._learning and self.routing is Routing.PREFIX and len(self.views) > 1:
            self._learning.add(i)  # once it answers: read what its engine was sent, beside the poll
            asyncio.get_running_loop().create_task(self._learn(i))
        return load

    async def _learn(self, i: int) -> None:
        """Take in the prompt blocks replica ``i``'s engine was sent by routers before this set
        (a restart, a replica change, another gateway replica): their conversations come back to it."""
        try:
            keys = await self.transport.prefix_keys(i)
        except Exception as e:  # an engine that cannot say, or gone: this set learns from its own traffic
            log.info("%s replica r%d: what its engine was sent is not readable (%s)", self.model_id, i, e)
        else:
            self.prefixes.learn(i, keys)
        finally:  # asked once per set and replica
            self._learnt.add(i)
            self._learning.discard(i)

    def replica_views(self) -> list[ReplicaView]:
        return list(self.views.values())

    def _busy(self) -> Reply | None:
        if not queue_full(self.replica_views(), self.queue_bound):
            return None
        self.publisher.count("hive_rejected", model=self.model_id, code="429", reason="queue_full")
        start = ResponseStart(status=429, headers=[JSON, ("retry-after", str(RETRY_AFTER_S))])
        return start, bytes(openai_error(429, f"model '{self.model_id}' is at capacity and {self.queue_bound} requests "
                                              f"are already queued; retry after {RETRY_AFTER_S}s").body)

    def _unavailable(self, last_error: Exception | None) -> Reply:
        self.publisher.count("hive_rejected", model=self.model_id, code="503", reason="no_replica")
        msg = f"no replica of model '{self.model_id}' could take the request"
        if last_error is not None:
            msg += f" (last error: {type(last_error).__name__})"
        return ResponseStart(status=503, headers=[JSON, ("retry-after", str(RETRY_AFTER_S))]), bytes(openai_error(503, msg).body)

    def _hung(self, e: EngineHung) -> Reply:
        self.publisher.count("hive_rejected", model=self.model_id, code="504", reason="engine_hung")
        return ResponseStart(status=504, headers=[JSON]), bytes(openai_error(504, f"model '{self.model_id}': {e}").body)

    def _failed(self, view: ReplicaView, e: Exception, req: ForwardedRequest) -> None:
        mark_failed(view)
        self.transport.failed(view.index, e)
        log.warning("%s replica r%d failed before answering request %s: %s", self.model_id, view.index,
                    request_ids.of_headers(req.headers), e)
        self.publisher.count("hive_replica_failures", model=self.model_id, replica=names.replica_label(view.index))

    def _attempted(self, attempt: int) -> None:
        """Attempt ``attempt`` (0 the first) is being made; from the second on it is a retry."""
        if attempt:
            self.publisher.count("hive_retries", model=self.model_id)

    def _answered(self, attempt: int) -> None:
        if attempt:
            self.publisher.count("hive_failovers", model=self.model_id)

    async def call(self, req: ForwardedRequest, body: dict[str, Any] | None) -> Reply:
        """A non-streaming request: split over replicas when it carries many sequences, else one call.

        ``body`` is ``req.body`` as the caller already parsed it (None when it is not a JSON object).
        """
        self._touch()
        await self._any_live()
        # no await from the queue check to the in-flight count (in _call_one): requests that
        # arrive together must see each other
        busy = self._busy()
        if busy:
            return busy
        split = self._plan_split(req.path, body)
        if split is None:
            return await self._call_one(req, body)
        replies = await asyncio.gather(*(
            self._call_one(req.model_copy(update={"body": json.dumps(part.body).encode()}), part.body, prefer=part.replica)
            for part in split.parts))
        failed = next((r for r in replies if r[0].status != 200), None)
        if failed is not None:
            return failed
        merged = merge_answers(split, [json.loads(body) for _, body in replies])
        served = ",".join(names.replica_label(part.replica) for part in split.parts)
        return (ResponseStart(status=200, headers=[JSON, (REPLICA_HEADER, served), (ROUTE_HEADER, SPLIT)]),
                json.dumps(merged).encode())

    def _plan_split(self, path: str, body: dict[str, Any] | None) -> Split | None:
        if body is None or path not in SPLITTABLE or len(self.views) < 2:
            return None
        return plan_split(path, body, self.replica_views())

    def _prefix_keys(self, body: dict[str, Any] | None, adapter: str | None) -> list[int]:
        if self.routing is not Routing.PREFIX or len(self.views) < 2:
            return []
        return request_keys(body, adapter)

    def _attempts(self, body: dict[str, Any] | None = None, tokens: int = 0,
                  prefer: int | None = None, adapter: str | None = None) -> Iterator[tuple[ReplicaView, str, int]]:
        """The replicas to try in turn, each with why it was chosen and the prompt tokens it is taken
        to have cached: the preferred one if live (a part of a split), then the best not yet tried.
        ``adapter``: the LoRA adapter the request needs (replicas holding it are preferred, whatever
        the model's ``routing``: a load costs more than any prefix)."""
        tried: set[int] = set()
        keys = self._prefix_keys(body, adapter)
        adapter = adapter if len(self.views) > 1 else None
        for _ in range(MAX_ATTEMPTS):
            view = self.views.get(prefer) if prefer is not None and not tried else None
            route, cached = SPLIT, 0
            if view is None or not is_live(view):
                view, route, cached = self.prefixes.choose(self.replica_views(), keys, tokens, exclude=tried,
                                                           adapter=adapter)
            if view is None:
                return
            yield view, RETRY if tried else route, cached
            tried.add(view.index)

    async def _call_one(self, req: ForwardedRequest, parsed: dict[str, Any] | None, prefer: int | None = None) -> Reply:
        """One unary call to the best replica (or the preferred one), retried elsewhere on failure."""
        last_error: Exception | None = None
        prompt = prompt_tokens_estimate(req.body)
        for attempt, (view, route, cached) in enumerate(self._attempts(parsed, prompt, prefer, adapter_of(req))):
            self._attempted(attempt)
            tokens = prompt - cached  # only the uncached part fills the prefill budget
            view.in_flight += 1
            view.queued_tokens += tokens
            try:
                start, body = await self.transport.call(view.index, req)
                self._answered(attempt)
                return _served_by(start, view.index, route), body
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

    def pick(self, path: str, raw: bytes, body: dict[str, Any] | None) -> tuple[ReplicaView, str, EngineEndpoint] | None:
        """The replica the edge sends a request to itself (``serving/edge``), why, and its port; None when
        the request is better answered here: every replica busy (a 429), none live or its port not
        known yet (a failover or a Serve call), or many sequences to split. The pick is counted on the
        replica until the engine's own counts include it (``ReplicaView.edge_sent``)."""
        self._touch()
        if queue_full(self.replica_views(), self.queue_bound) or self._plan_split(path, body) is not None:
            return None
        now = time.monotonic()
        for v in self.views.values():
            v.edge_sent = [t for t in v.edge_sent if now - t < EDGE_PICK_TTL_S]
        view, route, _ = self.prefixes.choose(self.replica_views(), self._prefix_keys(body, None),
                                              prompt_tokens_estimate(raw))
        endpoint = self.endpoints.get(view.index) if view is not None else None
        if view is None or endpoint is None:
            return None
        view.edge_sent.append(now)
        return view, route, endpoint

    async def stream(self, req: ForwardedRequest, body: dict[str, Any] | None = None) -> AsyncIterator[ResponseStart | bytes]:
        """A streaming request: retried elsewhere only if the replica fails before its first item.
        ``body``: ``req.body`` as the caller parsed it; parsed here for prefix routing when not given."""
        self._touch()
        if body is None and self.routing is Routing.PREFIX and len(self.views) > 1:
            body = _parsed(req.body)
        await self._any_live()
        busy = self._busy()  # and no await from here to the in-flight count
        if busy:
            yield busy[0]
            yield busy[1]
            return
        last_error: Exception | None = None
        prompt = prompt_tokens_estimate(req.body)
        for attempt, (view, route, cached) in enumerate(self._attempts(body, prompt, adapter=adapter_of(req))):
            self._attempted(attempt)
            tokens = prompt - cached
            view.in_flight += 1
            view.queued_tokens += tokens
            queued = tokens  # released at the first body bytes: the prompt is past prefill
            started = False
            try:
                replies = self.transport.stream(view.index, req)
                async with contextlib.aclosing(replies):  # a client that leaves closes the engine's stream too
                    async for item in replies:
                        if not started:
                            assert isinstance(item, ResponseStart)  # an engine reply starts with its headers
                            item, started = _served_by(item, view.index, route), True
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
        start, text = self._unavailable(last_error)
        yield start
        yield text


def _served_by(start: ResponseStart, index: int, route: str) -> ResponseStart:
    """Tell the client which replica answered and why (``x-hive-replica: r1``, ``x-hive-route: prefix``)."""
    return start.model_copy(update={"headers": [*start.headers, (REPLICA_HEADER, names.replica_label(index)),
                                                (ROUTE_HEADER, route)]})


def adapter_of(req: ForwardedRequest) -> str | None:
    """The LoRA adapter the gateway or router marked the request for (``follow.mark_adapter``), if any."""
    raw = next((v for k, v in req.headers if k.lower() == ADAPTER_HEADER), None)
    if raw is None:
        return None
    try:
        return AdapterRef.model_validate_json(raw).model_id
    except ValueError:  # the engine answers the malformed header itself
        return None


def _parsed(raw: bytes) -> dict[str, Any] | None:
    """A body small enough to parse on the loop (``http.py`` PARSE_OFF_LOOP_BYTES), as a JSON object."""
    if not raw or len(raw) > PARSE_ON_LOOP_BYTES:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None
