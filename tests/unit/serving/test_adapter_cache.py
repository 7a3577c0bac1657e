"""``AdapterCache`` (serving/engine/adapters.py) on its own: never more than ``capacity`` adapters loaded in
the engine (vLLM's max_cpu_loras), so a request for another adapter while every loaded one has a request in
flight waits for one to become idle; the wait is bounded and its timeout is not the adapter's failure."""

from __future__ import annotations

import asyncio
import random

import pytest

from hive_apps.core.weights.source import parse_source
from hive_apps.core.weights.types import Manifest
from hive_apps.serving.engine.adapters import AdapterCache, AdapterLoadError
from hive_apps.serving.engine.protocol import AdapterRef
from tests.unit.helpers import Recorder, recorded_publisher

MANIFEST = Manifest(source=parse_source("/x"), revision="local")


class Engine:
    """The engine's side: what is loaded in it, never more than ``capacity`` (asserted at each load)."""

    def __init__(self, capacity: int, delay: float = 0.0, rng: random.Random | None = None, fail: str = ""):
        self.capacity, self.delay, self.rng, self.fail = capacity, delay, rng, fail
        self.held: set[str] = set()
        self.most = 0
        self.loads: list[str] = []  # loaded
        self.tries = 0
        self.unloads: list[str] = []

    async def pause(self) -> None:
        await asyncio.sleep(self.delay * (self.rng.random() if self.rng else 1.0))

    async def load(self, name: str, _folder: str) -> None:
        self.tries += 1
        await self.pause()
        if name == self.fail:
            raise RuntimeError("bad adapter")
        self.held.add(name)
        self.loads.append(name)
        self.most = max(self.most, len(self.held))
        assert len(self.held) <= self.capacity, sorted(self.held)

    async def unload(self, name: str) -> None:
        await self.pause()
        self.held.discard(name)
        self.unloads.append(name)


async def folder(_manifest) -> str:
    return "/x"


def make(capacity: int, engine: Engine | None = None, recorder: Recorder | None = None, timeout_s: float = 5.0):
    engine = engine or Engine(capacity)
    cache = AdapterCache(capacity, engine.load, engine.unload, folder, model_id="m", replica=0,
                         publisher=recorded_publisher(recorder), timeout_s=timeout_s)
    return cache, engine


def ref(name: str, key: str = "k") -> AdapterRef:
    return AdapterRef(model_id=name, weights=MANIFEST, revision_key=key)


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_a_request_waits_for_a_slot_and_proceeds_when_a_loaded_adapter_is_released():
    recorder = Recorder()
    cache, engine = make(2, recorder=recorder)
    await cache.acquire(ref("a"))
    await cache.acquire(ref("b"))
    c = asyncio.create_task(cache.acquire(ref("c")))
    await settle()
    assert not c.done() and list(cache.loaded) == ["a", "b"] and engine.held == {"a", "b"}
    assert cache.slot_waits == 1 and recorder.total("hive_adapter_slot_waits", model="m", replica="r0") == 1
    assert cache.view()["waiting_for_slot"] == 1 and not cache.busy["c"]  # a waiter counts on nothing
    cache.release("a")  # idle now: c evicts it and loads
    await asyncio.wait_for(c, 1)
    assert list(cache.loaded) == ["b", "c"] and engine.held == {"b", "c"} and engine.unloads == ["a"]
    assert cache.evictions == 1 and cache.busy == {"b": 1, "c": 1} and cache.view()["waiting_for_slot"] == 0
    assert engine.most == 2


async def test_a_slot_wait_past_the_timeout_is_a_504_not_recorded_and_a_later_request_loads():
    cache, engine = make(1, timeout_s=0.05)
    await cache.acquire(ref("a"))
    with pytest.raises(AdapterLoadError) as e:
        await cache.acquire(ref("b"))
    assert e.value.status == 504 and "were in use" in e.value.message
    assert "b" not in cache.failed and cache.view()["failed"] == {}  # not the adapter's fault
    assert list(cache.loaded) == ["a"] and engine.loads == ["a"]
    cache.release("a")
    await cache.acquire(ref("b"))  # tried again, and loaded
    assert list(cache.loaded) == ["b"] and engine.held == {"b"}


async def test_waiters_for_one_adapter_share_one_load_and_hold_no_other_adapters_lock():
    cache, engine = make(1)
    await cache.acquire(ref("a"))
    waiters = [asyncio.create_task(cache.acquire(ref("b"))) for _ in range(3)]
    await settle()
    assert not any(w.done() for w in waiters) and cache.slot_waits == 1  # one waits for the slot, two for its lock
    assert await asyncio.wait_for(cache.acquire(ref("a")), 1) == 0.0  # a's lock is free: a hit goes through
    cache.release("a")
    await settle()
    assert not any(w.done() for w in waiters)  # a still has a request in flight
    cache.release("a")
    await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert engine.loads == ["a", "b"] and cache.busy == {"b": 3} and list(cache.loaded) == ["b"]


async def test_a_failed_or_cancelled_load_gives_its_slot_back():
    cache, engine = make(1, Engine(1, fail="bad"))
    with pytest.raises(AdapterLoadError) as e:
        await cache.acquire(ref("bad"))
    assert e.value.status == 500 and "bad" in cache.failed  # a real failure is recorded
    await asyncio.wait_for(cache.acquire(ref("good")), 1)  # the slot is free: no wait
    assert cache.slot_waits == 0 and list(cache.loaded) == ["good"]
    waiting = asyncio.create_task(cache.acquire(ref("other")))
    await settle()
    waiting.cancel()  # the client went away while it waited
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cache.view()["waiting_for_slot"] == 0 and cache._loading == 0
    cache.release("good")
    await asyncio.wait_for(cache.acquire(ref("other")), 1)
    assert list(cache.loaded) == ["other"] and engine.held == {"other"}


async def test_a_new_revision_reuses_its_slot_and_a_deleted_adapter_frees_one():
    cache, engine = make(2)
    await cache.acquire(ref("a"))
    await cache.acquire(ref("b"))
    cache.release("a")
    await cache.acquire(ref("a", key="k2"))  # deployed again: unloaded, loaded again, nothing evicted
    assert engine.loads == ["a", "b", "a"] and engine.unloads == ["a"] and cache.evictions == 0
    c = asyncio.create_task(cache.acquire(ref("c")))
    await settle()
    assert not c.done()  # a and b in use
    cache.release("a")
    assert await cache.forget("a")  # deleted: its slot goes to c
    await asyncio.wait_for(c, 1)
    assert sorted(cache.loaded) == ["b", "c"] and engine.held == {"b", "c"} and cache.evictions == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_never_more_than_capacity_loaded_under_a_random_trace_and_every_request_gets_through(seed):
    rng = random.Random(seed)
    capacity = 3
    engine = Engine(capacity, delay=0.002, rng=rng)
    cache, _ = make(capacity, engine)
    acquired: list[str] = []
    pending: list[tuple[str, asyncio.Task]] = []
    waited = False
    for _ in range(300):
        done = [(n, t) for n, t in pending if t.done()]
        for n, t in done:
            t.result()
            acquired.append(n)
            pending.remove((n, t))
        if acquired and rng.random() < 0.45:
            cache.release(acquired.pop(rng.randrange(len(acquired))))
        else:
            name = f"a{min(9, int(rng.expovariate(0.35)))}"
            pending.append((name, asyncio.create_task(cache.acquire(ref(name)))))
        await asyncio.sleep(rng.random() * 0.003)
        assert len(cache.loaded) + cache._loading <= capacity and len(engine.held) <= capacity
        waited = waited or cache.view()["waiting_for_slot"] > 0
    while pending or acquired:  # drain: every waiter gets its adapter once requests end
        for n, t in [(n, t) for n, t in pending if t.done()]:
            t.result()
            acquired.append(n)
            pending.remove((n, t))
        while acquired:
            cache.release(acquired.pop())
        await asyncio.sleep(0.005)
    assert waited and cache.slot_waits > 0 and cache.evictions > 0
    assert engine.most == capacity and not cache.busy and cache._loading == 0
    assert set(cache.loaded) == engine.held


async def test_requests_that_waited_on_a_failed_load_get_its_error_without_loading_again():
    engine = Engine(2, delay=0.01, fail="bad")
    cache, _ = make(2, engine)
    tries = [asyncio.create_task(cache.acquire(ref("bad"))) for _ in range(3)]
    out = await asyncio.gather(*tries, return_exceptions=True)
    assert all(isinstance(e, AdapterLoadError) and e.status == 500 for e in out)
    assert engine.tries == 1 and cache.view()["loads"] == 0 and "bad" in cache.failed and cache._loading == 0


async def test_adapters_vllm_dropped_on_a_level_2_wake_are_loaded_again_by_the_next_request():
    """reload_weights resets vLLM's LoRA state: the cache forgets what it held, without unloading, and
    the next request for an adapter loads it explicitly (not inside a scheduler step)."""
    cache, engine = make(2)
    await cache.acquire(ref("a"))
    cache.release("a")
    engine.held.clear()  # what vLLM's reset_lora_state does to the engine
    cache.dropped_by_engine()
    assert cache.view()["loaded"] == [] and engine.unloads == []
    assert await cache.acquire(ref("a")) >= 0
    assert engine.loads == ["a", "a"] and engine.held == {"a"} and list(cache.loaded) == ["a"]
