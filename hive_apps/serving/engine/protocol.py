"""What travels between the router and an engine replica over a Serve handle.

A request is forwarded as plain HTTP pieces and answered as a stream: one
``ResponseStart`` and then body chunks. Streaming and non-streaming replies take the same
path, so the router never needs to understand the OpenAI body to pass it on.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, Field

from hive_apps.core.buckets import TTFT_BOUNDS_S
from hive_apps.core.weights.types import Manifest

ADAPTER_HEADER = "x-hive-adapter"
"""Set by the gateway and routers on a request whose ``model`` is a LoRA adapter: the ``AdapterRef`` the
engine loads before it serves it. Clients cannot set it: only PASSED_HEADERS (``routing/http.py``) of a
client's request reach an engine."""


class AdapterRef(BaseModel):
    """Which adapter a request needs, and where its files are: what an engine loads on demand."""

    model_id: str  # the adapter's name (the request's ``model``)
    weights: Manifest  # its pinned files: the engine's node cache holds them (or its fetcher gets them)
    revision_key: str  # changes when the adapter is deployed again: the engine then loads it anew


class ForwardedRequest(BaseModel):
    method: str = "POST"
    path: str  # e.g. "/v1/chat/completions" (already without any /<model_id> prefix)
    query: str = ""
    headers: list[tuple[str, str]] = Field(default_factory=list)
    body: bytes = b""


class ResponseStart(BaseModel):
    status: int
    headers: list[tuple[str, str]] = Field(default_factory=list)

    @property
    def content_type(self) -> str:
        for k, v in self.headers:
            if k.lower() == "content-type":
                return v
        return "application/json"


class TTFTHistogram(BaseModel):
    """Time to first token of every request since the engine started, as a Prometheus histogram:
    ``buckets[i]`` requests had their first token within ``TTFT_BOUNDS_S[i]`` seconds (vLLM's own
    bounds, ``core/buckets.py``; cumulative, so the last is at most ``count``: the rest were slower
    than the last bound). Empty: an engine from before the histogram."""

    buckets: list[int] = Field(default_factory=list)
    count: int = 0
    sum_s: float = 0.0


class EngineLoad(BaseModel):
    """Live load of one replica, from the engine's own scheduler stats."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    in_flight: int = 0  # requests inside this replica's forward() right now
    max_num_seqs: int = 1
    updated_at: float = 0.0
    requests_total: int = 0  # requests taken since the engine started (warm-up, health and load polls not counted)
    last_request_at: float | None = None  # wall time a request last came or finished (the lifecycle's idle clock)
    # cumulative since the engine started (warm-up included, as vLLM's own counters): the admin's history
    # turns the change between two reads into tokens/s and the p50 time to first token (core/history.py)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    ttft: TTFTHistogram = Field(default_factory=TTFTHistogram)
    # prompt tokens the engine looked up in its prefix cache and found there (vLLM's prefix_cache_stats)
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    adapters: list[str] = Field(default_factory=list)  # LoRA adapters loaded in the engine now (routing prefers them)


class SleepReport(BaseModel):
    """An engine's answer to ``sleep(level)``, which the admin records with ``dozed``."""

    sleep_s: float
    # what it still holds on each of its devices (device id -> bytes): its start's footprint less what the
    # sleep freed there (NVML, read under the devices' lock); None: nothing measured (the registry books the plan's)
    residual_bytes: dict[str, int] | None = None


class EngineCounters:
    """What an engine counts for its load report: prompt and generated tokens, and each request's
    time to first token (filled by the sim engine and by vLLM's stat-logger hook)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._ttft = [0] * len(TTFT_BOUNDS_S)  # per bucket, not cumulative (one slot per bound)
        self._ttft_count = 0
        self._ttft_sum_s = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache, and found there."""
        self.prefix_queries += max(0, int(queries))
        self.prefix_hits += max(0, int(hits))

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens += max(0, int(prompt))
        self.generation_tokens += max(0, int(generated))

    def first_token(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        i = bisect.bisect_left(TTFT_BOUNDS_S, seconds)  # the first bound >= seconds (le, as Prometheus)
        if i < len(TTFT_BOUNDS_S):
            self._ttft[i] += 1
        self._ttft_count += 1
        self._ttft_sum_s += seconds

    def fields(self) -> dict[str, Any]:
        """The ``EngineLoad`` fields, cumulative."""
        return {"prompt_tokens_total": self.prompt_tokens, "generation_tokens_total": self.generation_tokens,
                "ttft": TTFTHistogram(buckets=list(itertools.accumulate(self._ttft)), count=self._ttft_count,
                                      sum_s=round(self._ttft_sum_s, 6)),
                "prefix_cache_queries_total": self.prefix_queries, "prefix_cache_hits_total": self.prefix_hits}


async def call_asgi(app: Any, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run one request through an ASGI app in-process and yield its reply as it is produced."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects from in-process calls
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await queue.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "root_path": "",
        "query_string": req.query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in req.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
    done: dict[str, Any] = {"type": "hive.done"}  # the end marker, matched by identity

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await queue.put(done)

    task = asyncio.create_task(run())
    try:
        while True:
            msg = await queue.get()
            if msg is done:
                break
            if msg["type"] == "http.response.start":
                headers = [(k.decode(), v.decode()) for k, v in msg.get("headers", [])]
                yield ResponseStart(status=msg["status"], headers=headers)
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    break
        await task
    finally:
        if not task.done():
            task.cancel()
