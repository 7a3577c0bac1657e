"""LoRA adapters inside one engine replica: loaded on demand, kept in an LRU, never exposed to clients.

The gateway and the routers mark a request for an adapter with ``ADAPTER_HEADER`` (its ``AdapterRef``:
name, pinned files, revision). Before the request reaches vLLM's app, ``with_adapters`` makes sure the
adapter is loaded here: its files in this node's weight cache (a folder source is read in place; a Hub
or S3 one is fetched by the node's fetcher), then the engine's own loader (vLLM: its OpenAI layer's
``load_lora_adapter``, in-process; the sim: a simulated load). Never more than ``capacity`` adapters
(``max_cpu_loras``, vLLM's own CPU LRU) are loaded: before a load, the least recently used one that no
request is using is unloaded to make room (``hive_adapter_evictions``); when every loaded adapter has a
request in flight, the request waits until one has none (``hive_adapter_slot_waits``), at most
``LOAD_TIMEOUT_S``, and past that gets a 504 that is not recorded against the adapter (a later request
tries again). Holding more would make vLLM's LRU evict and reload adapters inside scheduler steps,
stalling the batch (``benchmarks/bench_lora.py``). A load is bounded (``LOAD_TIMEOUT_S``); one that
fails answers an OpenAI-shaped error, and this replica answers the same error for that adapter, without
trying again, until the adapter changes (a new deploy: another ``revision_key``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import ValidationError

from hive_apps.core.openai_errors import error_body
from hive_apps.core.weights.types import Manifest
from hive_apps.ops.metrics import Publisher, event
from hive_apps.serving.engine.protocol import ADAPTER_HEADER, AdapterRef

log = logging.getLogger("ray.serve")

LOAD_TIMEOUT_S = 300.0  # fetch onto the node and load, at most
UNLOAD_WAIT_S = 30.0  # an adapter being deleted waits this long for its requests in flight

LoadFn = Callable[[str, str], Awaitable[None]]  # (adapter name, local folder): load it into the engine
UnloadFn = Callable[[str], Awaitable[None]]
FolderFn = Callable[[Manifest], Awaitable[str]]  # the adapter's folder on this node (fetched if need be)


class AdapterLoadError(Exception):
    """An adapter this replica cannot load: the HTTP status and message its requests are answered with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class _Failure:
    revision_key: str
    error: AdapterLoadError


class AdapterCache:
    """The adapters one engine replica holds, by name, least recently used first."""

    def __init__(self, capacity: int, load: LoadFn, unload: UnloadFn, folder: FolderFn, *,
                 model_id: str, replica: int, publisher: Publisher, timeout_s: float = LOAD_TIMEOUT_S):
        self.capacity = max(1, capacity)
        self._load, self._unload, self._folder = load, unload, folder
        self.timeout_s = timeout_s
        self.loaded: OrderedDict[str, str] = OrderedDict()  # name -> revision_key, LRU first
        self.busy: Counter[str] = Counter()  # requests in flight per adapter
        self.failed: dict[str, _Failure] = {}
        self.loads = self.evictions = self.slot_waits = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._loading = 0  # slots taken by loads under way (loaded + loading <= capacity)
        self._waiting = 0  # requests waiting for a slot now
        self._freed = asyncio.Event()  # set (then replaced) when a slot may have become free
        self.publisher = publisher
        self.tags = {"model": model_id, "replica": f"r{replica}"}

    def view(self) -> dict[str, object]:
        """What ``info()`` shows: loaded (LRU first), in use, failed, the counts, and the requests waiting for a slot."""
        return {"loaded": list(self.loaded), "capacity": self.capacity, "in_use": {k: v for k, v in self.busy.items() if v},
                "failed": {k: f.error.message for k, f in self.failed.items()},
                "loads": self.loads, "evictions": self.evictions, "slot_waits": self.slot_waits,
                "waiting_for_slot": self._waiting}

    async def acquire(self, ref: AdapterRef) -> float:
        """Have ``ref`` loaded and count a request on it (``release`` when the request ends): seconds it
        waited for a slot and a load (0 when it was loaded). ``AdapterLoadError`` when it cannot be loaded,
        or when no slot became free within ``timeout_s`` (a 504 that is not recorded in ``failed``)."""
        name = ref.model_id
        failure = self.failed.get(name)
        if failure is not None and failure.revision_key == ref.revision_key:
            raise failure.error
        deadline = asyncio.get_running_loop().time() + self.timeout_s  # for a slot (the load has its own bound)
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:  # concurrent requests for one adapter: one waits for the slot and loads, the others hit
            failure = self.failed.get(name)  # or get the error of the load they waited on
            if failure is not None and failure.revision_key == ref.revision_key:
                raise failure.error
            if self.loaded.get(name) == ref.revision_key:
                self.loaded.move_to_end(name)
                self.busy[name] += 1
                return 0.0
            t0 = time.perf_counter()
            stale = name in self.loaded  # deployed again under the same name: the old weights go, their slot is its
            if stale:
                del self.loaded[name]
                self._loading += 1
            else:
                await self._slot(name, deadline)
            t1 = time.perf_counter()
            try:
                if stale:
                    await self._unload_quietly(name)
                await asyncio.wait_for(self._fetch_and_load(ref), self.timeout_s)
            except Exception as e:
                error = e if isinstance(e, AdapterLoadError) else AdapterLoadError(
                    504 if isinstance(e, TimeoutError) else 500,
                    f"loading LoRA adapter {name!r} took longer than {self.timeout_s:.0f}s" if isinstance(e, TimeoutError)
                    else f"loading LoRA adapter {name!r} failed: {type(e).__name__}: {e}")
                self.failed[name] = _Failure(ref.revision_key, error)
                self._count("hive_adapter_loads", adapter=name, outcome="failed")
                log.warning("%s/%s: adapter %s did not load: %s", self.tags["model"], self.tags["replica"], name,
                            error.message)
                raise error from None
            else:
                self.failed.pop(name, None)
                self.loaded[name] = ref.revision_key
                self.busy[name] += 1
                self.loads += 1
            finally:  # loaded, or the slot goes back (a failure, a cancelled request)
                self._loading -= 1
                if name not in self.loaded:
                    self._signal()
            t2 = time.perf_counter()
            self._count("hive_adapter_loads", adapter=name, outcome="ok")
            self.publisher.events([event("hive_adapter_load_seconds", t2 - t1, **self.tags)])
            log.info("%s/%s: loaded adapter %s in %.2fs (%.2fs waiting for a slot)", self.tags["model"],
                     self.tags["replica"], name, t2 - t1, t1 - t0)
            return t2 - t0

    def release(self, name: str) -> None:
        self.busy[name] -= 1
        if self.busy[name] <= 0:
            del self.busy[name]
            self._signal()  # it may be evicted now for a request waiting for a slot

    def dropped_by_engine(self) -> None:
        """vLLM removed every adapter itself: ``reload_weights`` (a level-2 wake) resets its LoRA state
        in both model runners (``LoRAModelRunnerMixin.reset_lora_state``). Forget them without
        unloading, so the next request loads its adapter into a free slot instead of vLLM reloading
        it inside a scheduler step. Only while the engine is drained (a wake), so nothing is busy."""
        self.loaded.clear()
        self._signal()

    async def forget(self, name: str) -> bool:
        """Unload ``name`` (deleted): after its requests in flight end, at most UNLOAD_WAIT_S. Whether it was loaded."""
        self.failed.pop(name, None)
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name not in self.loaded:
                return False
            deadline = time.monotonic() + UNLOAD_WAIT_S
            while self.busy.get(name) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            del self.loaded[name]
            self._signal()
            await self._unload_quietly(name)
            return True

    async def _slot(self, name: str, deadline: float) -> None:
        """Take a slot for ``name``'s load: a free one, else the least recently used idle adapter's (unloaded),
        else wait for a request to end (``release``), until ``deadline``. Called holding ``name``'s lock
        only: another name's lock is taken only when free, to unload that adapter."""
        loop, waited = asyncio.get_running_loop(), False
        try:
            while True:
                if len(self.loaded) + self._loading < self.capacity:
                    self._loading += 1
                    return
                idle = next((n for n in self.loaded if not self.busy.get(n) and not self._locks[n].locked()), None)
                if idle is not None:
                    async with self._locks[idle]:  # no load of the same name interleaves with its unload
                        if idle in self.loaded and not self.busy.get(idle):
                            del self.loaded[idle]
                            self._loading += 1
                            self.evictions += 1
                            self._count("hive_adapter_evictions")
                            try:
                                await self._unload_quietly(idle)
                            except BaseException:  # the request was cancelled: the slot goes back
                                self._loading -= 1
                                self._signal()
                                raise
                            return
                    continue
                if not waited:
                    waited = True
                    self._waiting += 1
                    self.slot_waits += 1
                    self._count("hive_adapter_slot_waits")
                    log.info("%s/%s: adapter %s waits for a slot: all %d loaded adapters are in use",
                             self.tags["model"], self.tags["replica"], name, self.capacity)
                freed = self._freed
                try:
                    await asyncio.wait_for(freed.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise AdapterLoadError(
                        504, f"LoRA adapter {name!r}: all {self.capacity} adapters loaded on this replica "
                             f"(max_cpu_loras) were in use for {self.timeout_s:.0f}s; try again") from None
        finally:
            if waited:
                self._waiting -= 1

    def _signal(self) -> None:
        """Wake the requests waiting for a slot (each looks again)."""
        if self._waiting:
            self._freed.set()
            self._freed = asyncio.Event()

    async def _fetch_and_load(self, ref: AdapterRef) -> None:
        folder = await self._folder(ref.weights)
        await self._load(ref.model_id, folder)

    async def _unload_quietly(self, name: str) -> None:
        try:
            await self._unload(name)
        except Exception as e:  # the engine's own LRU lets it go in the end
            log.warning("%s/%s: unloading adapter %s failed: %s", self.tags["model"], self.tags["replica"], name, e)

    def _count(self, metric: str, **tags: str) -> None:
        self.publisher.events([event(metric, 1.0, **self.tags, **tags)])


async def _answer(send: Callable, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message, "model")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def adapter_ref(scope: dict) -> AdapterRef | str | None:
    """The adapter a request needs (None: the base), or why its header does not parse."""
    raw = next((v for k, v in scope.get("headers", ()) if k == ADAPTER_HEADER.encode()), None)
    if raw is None:
        return None
    try:
        return AdapterRef.model_validate_json(raw)
    except ValidationError as e:
        return f"the {ADAPTER_HEADER} header does not parse: {e.errors()[0]['msg']}"


def with_adapters(app: Callable, cache: Callable[[], AdapterCache | None]) -> Callable:
    """``app`` behind the adapter loader: a request marked with an adapter waits for it to be loaded
    (or gets its load error as an OpenAI error) and counts on it until the answer ends. ``cache``: the
    replica's (None: this base serves no adapters, and a marked request is a 400)."""

    async def asgi(scope: dict, receive: Callable, send: Callable) -> None:
        ref = adapter_ref(scope) if scope["type"] == "http" else None
        if ref is None:
            await app(scope, receive, send)
            return
        if isinstance(ref, str):
            await _answer(send, 400, ref)
            return
        adapters = cache()
        if adapters is None:
            await _answer(send, 400, f"LoRA adapter {ref.model_id!r}: this model was deployed without lora")
            return
        try:
            await adapters.acquire(ref)
        except AdapterLoadError as e:
            await _answer(send, e.status, e.message)
            return
        try:
            await app(scope, receive, send)
        finally:
            adapters.release(ref.model_id)

    return asgi
