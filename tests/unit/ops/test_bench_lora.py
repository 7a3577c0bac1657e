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
        assert not e.running and not e.waiting and not e.loading and e.in_flight == 0


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
    _, e = _replica(profile, lora, at_once)  # six busy at once: over capacity until they end (AdapterCache)
    assert e.cache.max_loaded == 6 and e.cache.evictions == 0


def test_the_simulated_cache_is_the_products_adapter_cache():
    """The same trace of acquires and releases through ``AdapterCache`` and ``bench.AdapterLru``."""
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

    rng = random.Random(7)
    trace, busy = [], []
    for _ in range(400):
        if busy and rng.random() < 0.45:
            trace.append(("release", busy.pop(rng.randrange(len(busy)))))
        else:
            a = min(11, int(rng.expovariate(0.3)))
            trace.append(("acquire", a))
            busy.append(a)

    async def product() -> tuple[list[str], int]:
        cache = AdapterCache(4, nothing, nothing, folder, model_id="m", replica=0, publisher=Publisher(Quiet()))
        manifest = Manifest(source=parse_source("/x"), revision="local")
        for op, a in trace:
            if op == "acquire":
                await cache.acquire(AdapterRef(model_id=f"a{a}", weights=manifest, revision_key="k"))
            else:
                cache.release(f"a{a}")
        return list(cache.loaded), cache.evictions

    sim = bench.AdapterLru(4)
    for op, a in trace:
        if op == "release":
            sim.release(a)
        elif not sim.hit(a):
            sim.add(a, 1)
    loaded, evictions = asyncio.run(product())
    assert evictions > 10
    assert ([f"a{a}" for a in sim.loaded], sim.evictions) == (loaded, evictions)


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
