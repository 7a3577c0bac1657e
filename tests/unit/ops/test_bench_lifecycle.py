"""The lifecycle benchmark's simulation keeps its books: a short run on a small, crowded cluster.

Five real fixture models on one H100 and one L4 (their footprints from the planner) under
enough traffic to force swaps; the invariants are checked against what the simulation
recorded (the reservation ledger, every request's outcome, the evictions and the served
spans), not against its own counters.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter, defaultdict

import pytest

from hive_apps.core.catalog import GIB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_spec = importlib.util.spec_from_file_location("bench_lifecycle", os.path.join(ROOT, "benchmarks", "bench_lifecycle.py"))
bench = sys.modules["bench_lifecycle"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(bench)

CLUSTER = [("H100-80GB", "a", 0), ("L4", "b", 0)]
CATALOG = [
    ("qwen3-30b-a3b", "Qwen__Qwen3-30B-A3B", 2048, 512),  # H100 only, takes most of it
    ("qwen3-8b", "Qwen__Qwen3-8B", 2048, 512),
    ("gemma-2-9b", "google__gemma-2-9b", 2048, 512),
    ("qwen3-0-6b", "Qwen__Qwen3-0.6B", 2048, 512),
    ("llama-3-2-1b", "meta-llama__Llama-3.2-1B-Instruct", 2048, 512),
]
SECONDS = 1800.0


@pytest.fixture(scope="module")
def deploys():
    return bench.build_deploys(CATALOG, ["H100-80GB", "L4"])


@pytest.fixture(scope="module")
def runs(deploys):
    requests, _ = bench.make_requests(deploys, 0.1, SECONDS, seed=3)
    return requests, {s: bench.simulate(deploys, CLUSTER, s, requests, SECONDS) for s in bench.STRATEGIES}


def test_the_run_is_crowded_enough_to_mean_something(runs):
    requests, results = runs
    assert results["static"].count("refused") > 0  # not everything fits at once
    for name in ("hive", "hive-sleep", "swapper"):
        r = results[name]
        assert r.swaps > 0 and max(r.added) > 0, f"{name}: no swap, the invariants below would be vacuous"


@pytest.mark.parametrize("strategy", list(bench.STRATEGIES))
def test_no_gpu_ever_holds_more_than_its_budget(runs, strategy):
    r = runs[1][strategy]
    used: dict[str, int] = defaultdict(int)
    for t, gpu, delta in r.ledger:  # in the order the simulation made them
        used[gpu] += delta
        assert 0 <= used[gpu] <= r.budgets[gpu], f"{gpu} at t={t:.1f}: {used[gpu] / GIB:.1f} GiB reserved"


@pytest.mark.parametrize("strategy", list(bench.STRATEGIES))
def test_every_request_is_accounted_for_exactly_once(runs, strategy):
    requests, results = runs
    r = results[strategy]
    seen = Counter(i for i, _ in r.outcomes)
    assert set(seen) == set(range(len(requests)))
    assert max(seen.values()) == 1
    served = {i for i, o in r.outcomes if o == "served"}
    assert served == {i for i, *_ in r.spans}
    for i, model, start, _ in r.spans:  # served by the model asked for, never before it arrived
        assert requests[i][1] == model and start >= requests[i][0]


@pytest.mark.parametrize("strategy", ["hive", "swapper"])
def test_no_model_is_evicted_with_requests_in_flight(runs, strategy):
    r = runs[1][strategy]
    spans = defaultdict(list)
    for _, model, start, end in r.spans:
        spans[model].append((start, end))
    assert r.evictions
    for t, model, in_flight, *_ in r.evictions:
        assert in_flight == 0
        busy = [(s, e) for s, e in spans[model] if s <= t < e]
        assert not busy, f"{model} parked at t={t:.1f} while serving {busy}"


@pytest.mark.parametrize("strategy", bench.HIVES)
def test_the_hive_keeps_a_model_that_just_woke_for_the_minimum_residency(runs, strategy):
    """...its own wake cost, at most MIN_RESIDENCY_S, unless the model that needs the room has itself
    waited its own wake cost (at most MIN_RESIDENCY_S)."""
    r = runs[1][strategy]
    room = [(t, model, ready, waited, kept, patience)
            for t, model, _, why, ready, waited, kept, patience in r.evictions if why == "room"]
    assert room
    for t, model, ready, waited, kept, patience in room:
        assert 0 < kept <= bench.MIN_RESIDENCY_S and 0 < patience <= bench.MIN_RESIDENCY_S
        assert t - ready >= kept - 1e-9 or waited >= patience - 1e-9, \
            f"{model} evicted {t - ready:.1f} s after it woke (kept {kept:.1f} s), for a model that waited " \
            f"{waited:.1f} s (patience {patience:.1f} s)"


def test_no_protection_holds_a_waiter_past_its_own_wake(runs):
    """The part of a wait spent behind another model's residency is at most one wake: whenever a
    protection kept a waiter from its room, it had waited less than its own wake (capped)."""
    held = [(name, *b) for name in bench.HIVES for b in runs[1][name].behind]
    assert held, "no waiter was ever held by a protection: the bound would be vacuous"
    for name, model, waited, patience in held:
        assert waited < patience <= bench.MIN_RESIDENCY_S, \
            f"{name}: {model} held {waited:.1f} s (patience {patience:.1f} s)"


def test_a_full_hold_queue_answers_429_and_loses_nothing(deploys, monkeypatch):
    monkeypatch.setattr(bench, "HOLD_BOUND", 1)
    requests, _ = bench.make_requests(deploys, 0.5, 600.0, seed=5)
    r = bench.simulate(deploys, CLUSTER, "hive", requests, 600.0)
    assert r.count("429") > 0
    assert r.count("served") + r.count("429") == len(requests)


def test_cold_start_model_reproduces_the_published_figure():
    """vLLM's figure (issue 9): Qwen3-235B-FP8 on 4 x A100 starts cold in 97-98 s."""
    assert 97 <= bench.gpu_cold_start_s("A100-80GB", 220 * GIB, tp=4) <= 98
    assert bench.gpu_cold_start_s("H100-80GB", 15 * GIB) < bench.gpu_cold_start_s("L4", 15 * GIB)  # faster host link
    assert bench.gpu_cold_start_s("L4", 1 * GIB) < bench.gpu_cold_start_s("L4", 15 * GIB)


def test_sleeping_in_place_wakes_without_cold_starts_and_keeps_host_ram_within_its_budget(deploys, runs):
    requests, results = runs
    sim = bench.Sim(deploys, CLUSTER, "hive-sleep", requests, SECONDS)
    r = sim.run()
    assert r.wakes > 0 and r.cold < r.wakes  # most wakes were in place
    assert all(free >= 0 for free in sim.host_free.values())
    budget = {n: int((bench.BUDGET * ram - bench.SYSTEM_RAM_GIB) * GIB) for n, ram in bench.NODE_RAM_GIB.items()}
    asleep = [s for s in sim.states.values() if s.home is not None]
    for node in budget:  # what is booked now is exactly the level-1 sleepers' weights on that node
        held = sum(s.d.weight_bytes for s in asleep if s.level == 1 and s.home.id.startswith(node + ":"))
        assert budget[node] - sim.host_free[node] == held
    assert bench.pct(r.added, 0.5) <= bench.pct(results["hive"].added, 0.5)
