"""The LoRA benchmark measures what it says: a quick run (60 s of traffic) of every strategy, checked
against the planner, against the product's own adapter cache, and against what the simulation recorded
per request (not its own summary counters)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import random
import sys

import pytest

from hive_apps.core.planning.lora import lora_memory
from hive_apps.core.spec import LoraSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_spec = importlib.util.spec_from_file_location("bench_lora", os.path.join(ROOT, "benchmarks", "bench_lora.py"))
bench = sys.modules["bench_lora"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(bench)

RATE, SEED = 10.0, 1


@pytest.fixture(scope="module")
def profile():
    return bench.load_profile(os.path.join(bench.FIXTURES, bench.BASE), {})


@pytest.fixture(scope="module")
def results(profile):
    return bench.run_all(profile, RATE, bench.QUICK_SECONDS, SEED)


def test_every_request_has_one_outcome_and_is_served_by_the_adapter_it_asked_for(results):
    for r in results:
        assert {q.outcome for q in r.requests} <= {"served", "refused", "429"}, r.name
        for q in r.served:
            assert q.end > q.arrival and q.left <= 1e-6
    hive = results[0]
    for e in hive.engines:  # nothing left inside an engine after the drain
        assert not e.running and not e.waiting and not e.loading and not e.queued and e.in_flight == 0
        assert not e.cache.queued and not e.cache.loading and len(e.cache.loaded) <= e.cache.capacity


def test_the_hive_serves_all_64_adapters_on_fewer_gpus_than_one_deployment_per_adapter(results):
    hive, static, swap = results[0], results[-2], results[-1]
    asked = {q.adapter for q in hive.requests}
    assert len(asked) > bench.ADAPTERS // 2  # the Zipf tail is there to be served
    for r in results[:-2]:
        assert {q.adapter for q in r.served} == asked and r.count("refused") == r.count("429") == 0, r.name
    served_static = {q.adapter for q in static.served}
    assert len(static.engines) < bench.ADAPTERS and static.count("refused") > 0
    assert served_static == asked & set(range(len(static.engines)))  # the most popular ones, nothing else
    per_gpu = len(static.engines) / static.gpus
    assert max(r.gpus for r in results[:-2]) < static.gpus < math.ceil(bench.ADAPTERS / per_gpu)
    assert swap.cold_starts and all(c > 20 for c in swap.cold_starts)  # the swapper pays a cold start, not a load


def test_the_hive_books_the_planners_lora_memory(profile, results):
    for (lora, gpus), r in zip(bench.HIVE_RUNS, results):
        devices = bench.cluster()
        plan = bench.plan_hive(profile, lora, gpus, devices)
        assert len(plan.replicas) == gpus == r.gpus
        assert len({d for rp in plan.replicas for d in rp.devices}) == gpus  # one replica per GPU
        assert r.reserved == sum(rp.reservation_bytes for rp in plan.replicas)
        assert r.lora_bytes == sum(rp.memory.lora for rp in plan.replicas) > 0
        for rp in plan.replicas:  # and memory.lora is lora.py's slots + punica buffers at the planned sizes
            lm = lora_memory(profile, lora, tp=1, tokens=rp.settings.max_num_batched_tokens,
                             seqs=rp.settings.max_num_seqs, on_cpu=False)
            assert rp.memory.lora == lm.on_device(1, on_cpu=False)
    assert results[1].lora_bytes > results[0].lora_bytes  # 16 slots cost more than 4
    assert results[-1].lora_bytes == 0 and results[-1].reserved > results[0].reserved


def test_max_loras_bounds_every_batch_and_binds_at_four(results):
    for (lora, _), r in zip(bench.HIVE_RUNS, results):
        assert all(e.max_mixed <= lora.max_loras for e in r.engines), r.name
    assert max(e.max_mixed for e in results[0].engines) == 4
    for (lora, _), r in zip(bench.HIVE_RUNS, results):  # never more loaded than vLLM's CPU LRU: no in-step reloads
        assert all(e.cache.max_loaded <= lora.cpu_loras and e.reloads == 0 for e in r.engines), r.name
    assert sum(e.cache.slot_waits for e in results[0].engines) > 0  # 16 of 64 adapters: requests waited for a slot
    assert bench.pct(results[0].latencies, 0.99) > bench.pct(results[1].latencies, 0.99)  # the limit costs latency


def _replica(profile, lora: LoraSpec, requests):
    """One hive replica on one H100 serving ``requests``."""
    devices = bench.cluster(1)
    plan = bench.plan_hive(profile, lora, 1, devices)
    sim = bench.HiveSim(requests, plan, devices, profile, lora)
    sim.run()
    return sim, sim.engines[0]


def test_evictions_happen_when_distinct_adapters_exceed_max_cpu_loras(profile):
    lora = LoraSpec(max_loras=2, max_cpu_loras=4)
    one_by_one = [bench.Req(i, 30.0 * i, a, 64, 64.0) for i, a in enumerate([0, 1, 2, 3, 0, 1, 2, 3])]
    _, e = _replica(profile, lora, one_by_one)  # four distinct: loaded once each, never evicted
    assert len(e.loads) == 4 and e.cache.evictions == 0 and e.reloads == 0
    cycle = [bench.Req(i, 30.0 * i, i % 6, 64, 64.0) for i in range(12)]
    _, e = _replica(profile, lora, cycle)  # six in a cycle through an LRU of four: every request loads
    assert len(e.loads) == 12 and e.cache.evictions == 8 and list(e.cache.loaded) == [2, 3, 4, 5]
    at_once = [bench.Req(i, 0.0, i, 64, 64.0) for i in range(6)]
    sim, e = _replica(profile, lora, at_once)  # six at once: two wait for a slot until a request ends (AdapterCache)
    assert e.cache.max_loaded == 4 and e.cache.slot_waits == 2 and e.cache.evictions == 2 and e.reloads == 0
    assert all(q.outcome == "served" for q in sim.requests)
    first_end = min(q.end for q in sim.requests[:4])
    assert all(q.load_wait >= first_end for q in sim.requests[4:])  # they waited for a request to end


def test_the_simulated_cache_is_the_products_adapter_cache():
    """The same trace of acquires and releases through ``AdapterCache`` and ``bench.AdapterLru``, waits for a
    slot included: after each step, the same adapters loaded in the same order, the same evictions and slot
    waits, and the same requests through (a request is released only once its acquire returned)."""
    from hive_apps.core.weights.source import parse_source
    from hive_apps.core.weights.types import Manifest
    from hive_apps.ops.metrics import Publisher
    from hive_apps.serving.engine.adapters import AdapterCache
    from hive_apps.serving.engine.protocol import AdapterRef

    class Quiet:
        def record(self, *_):
            pass

    async def nothing(*_):
        pass

    async def folder(_):
        return "/x"

    manifest = Manifest(source=parse_source("/x"), revision="local")

    async def settle():
        for _ in range(20):
            await asyncio.sleep(0)

    async def compare() -> tuple[int, int]:
        cache = AdapterCache(4, nothing, nothing, folder, model_id="m", replica=0, publisher=Publisher(Quiet()))
        sim = bench.AdapterLru(4)
        rng = random.Random(7)
        tasks: dict[int, tuple[int, asyncio.Task]] = {}  # request -> (adapter, its acquire)
        sim_through: set[int] = set()  # requests the simulation counted on their adapter
        sim_waiting: dict[int, list[int]] = {}  # adapter -> requests (queued or loading, in the simulation)
        for i in range(600):
            through = sorted(q for q, (_, t) in tasks.items() if t.done())
            if through and rng.random() < 0.45:
                q = through[rng.randrange(len(through))]
                a, t = tasks.pop(q)
                t.result()
                cache.release(f"a{a}")
                sim_through.remove(q)
                for b, _ in sim.release(a):  # a queued adapter took a slot: loaded at once here
                    sim.add(b, len(sim_waiting[b]))
                    sim_through.update(sim_waiting.pop(b))
            else:
                a = min(11, int(rng.expovariate(0.3)))
                tasks[i] = (a, asyncio.create_task(cache.acquire(AdapterRef(model_id=f"a{a}", weights=manifest,
                                                                            revision_key="k"))))
                how, _ = sim.acquire(a)
                if how == "hit":
                    sim_through.add(i)
                elif how == "load":
                    sim.add(a, 1)
                    sim_through.add(i)
                else:  # queued, or joined a queued one
                    sim_waiting.setdefault(a, []).append(i)
            await settle()
            assert [f"a{a}" for a in sim.loaded] == list(cache.loaded), i
            assert (sim.evictions, sim.slot_waits) == (cache.evictions, cache.slot_waits), i
            assert sim_through == {q for q, (_, t) in tasks.items() if t.done()}, i
            assert len(cache.loaded) <= 4
        for _, t in tasks.values():
            t.cancel()
        await settle()
        return cache.evictions, cache.slot_waits

    evictions, waits = asyncio.run(compare())
    assert evictions > 10 and waits > 10


def test_p99_includes_load_waits(profile, monkeypatch):
    requests = bench.make_requests(RATE, 20.0, SEED)
    quick = bench.run_hive(profile, requests, bench.WIDE, 1)
    monkeypatch.setattr(bench, "LOAD_FIXED_S", 20.0)
    slow = bench.run_hive(profile, requests, bench.WIDE, 1)
    waited = [q for q in slow.served if q.load_wait > 0]
    assert waited and all(q.end - q.arrival >= q.load_wait for q in waited)
    first = {}  # each adapter's first request asked for its load (one replica): it waited all of it
    for q in sorted(slow.served, key=lambda q: q.arrival):
        first.setdefault(q.adapter, q)
    assert all(q.load_wait >= 20.0 for q in first.values())
    assert min(slow.loads) >= 20.0
    assert bench.pct(slow.latencies, 0.99) >= 20.0 > bench.pct(quick.latencies, 0.99)


def test_the_same_seed_gives_the_same_table_and_another_seed_another(profile):
    a, b, c = (bench.make_requests(RATE, 20.0, s) for s in (SEED, SEED, SEED + 1))
    run = lambda reqs: bench.row(bench.run_hive(profile, reqs))  # noqa: E731
    assert run(a) == run(b) != run(c)
