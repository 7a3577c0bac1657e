"""Packing with pending deploys: where one deploy goes, and how much it takes, when others wait.

Throughput-first sizing is right for a model alone: it takes the memory that still buys
tokens/s. When deploys are still to be planned (``pending``), the first model onto an
empty H100 would take most of it, and a later model that only an H100 holds finds no room
(``benchmarks/bench_packing.py``: qwen3-30b-a3b in catalog order). The planner then plans
the deploy *jointly* with the pending ones and keeps only the deploy's own part:

1. Fit first. Every deploy gets its smallest GPU footprint (``FLOOR_SEQS`` sequences where a
   whole eligible GPU holds that many, else one; its ``max_concurrency`` or a fixed
   ``max_num_seqs`` when given; the default demand is no bound here) by best-fit decreasing: the largest footprint first, each
   onto the eligible GPU with the least room that still holds it.
2. Then throughput. The memory left on each GPU goes, one step of sequences (about 12 %) at
   a time, to the resident whose utility gains most per byte; a local search then moves one
   deploy to another GPU, or swaps two, while that places more deploys or raises the total
   utility. Utility is the square root of the deploy's planned output tokens/s (the roofline
   of ``throughput.Throughput``): diminishing returns, so one model with a cheap KV cache does
   not take every free byte, and a big model is not starved for a small one's sake (the
   plain sum would give a 1B model 1000 sequences and leave the rest at the floor;
   proportional fairness, the sum of logs, gave everyone fewer sequences than a
   one-model-per-GPU baseline). Pooling models must fit but add nothing: they get the
   sequences that cost at most 10 % (or 512 MiB) more than one.
3. The deploy gets the GPU and the byte budget the joint plan gave it and is sized inside
   that budget (its sequences are not trimmed to the 2 % knee: the budget is what the joint
   plan gave it for). When the joint plan cannot place it on a GPU, or would leave fewer
   pending deploys a GPU than its normal plan does, the normal plan stands.

Each pending deploy is planned again when its turn comes, with the deploys still pending
after it; the last one is planned by the normal rules (unshared GPUs first), so it may not
take the room an earlier joint plan kept for it, and that room simply stays free. The
estimate counts each co-located engine at its own roofline, as if it had the GPU to
itself: right for the peak of a model that is busy while its neighbours are idle (the
many-models-few-GPUs case the hive is for), optimistic when all are busy at once. Pending
deploys with pins, more than one replica, tensor parallelism, a user placement policy or a
fixed ``gpu_memory_utilization`` are not modelled; at most ``MAX_PENDING`` are considered,
in the order given, and each local search stops after ``SEARCH_BUDGET_S`` (a plan with 32
pending over 64 GPUs takes about 1 s; 11 over 5 GPUs about 40 ms).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.memory import Frame
from hive_apps.core.planning.placement import PLACEMENT_POLICY_KEY, capacity, kind_problem, taint_problem
from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.planning.sizing import FLOOR_SEQS, Sizer
from hive_apps.core.planning.throughput import Perf, device_perf
from hive_apps.core.planning.types import DeviceCapacity, PlanningError
from hive_apps.core.spec import ModelSpec


def utility(tps: float) -> float:
    """What a deploy's planned tokens/s is worth: diminishing returns, so no one model takes a card
    whose memory buys more for the others (square root: between the plain sum and proportional fairness)."""
    return math.sqrt(tps)


MAX_PENDING = 32
MAX_ROUNDS = 50
SEARCH_BUDGET_S = 0.5  # the local search stops improving after this long
RANK_TOKENS = 2048
POOLING_GROWTH = 0.10  # a pooling model takes the sequences that cost at most 10 % (or 512 MiB) more than one
POOLING_GROWTH_BYTES = 512 * 1024**2  # a generate model in a joint plan starts from this many sequences where a GPU holds them
LADDER = tuple(sorted({max(1, round(1.125 ** k)) for k in range(0, 60)}))  # ~12 % steps up to ~1200


@dataclass
class _Item:
    key: str
    sizer: Sizer
    profile: ModelProfile
    need: int  # smallest GPU footprint at tp=1
    eligible: set[str]
    tokens: int
    fixed: int | None  # sequences fixed by a demand, an override, or a pooling model's free sequences
    counts: bool  # adds its tokens/s to the objective (generate models)
    frame: Frame = None  # type: ignore[assignment]  # set by _item
    steps: list[int] = field(default_factory=list)
    start: int = 1  # sequences it starts from (FLOOR_SEQS where a whole eligible GPU holds that many)


@dataclass
class Slot:
    device: DeviceCapacity
    budget: int  # bytes the joint plan gives the deploy on that device
    seqs: int
    placed_pending: int
    pending: int


def modellable(spec: ModelSpec) -> bool:
    tp = spec.vllm_kwargs.get("tensor_parallel_size")
    return (not spec.pins and spec.replicas == 1 and tp in (None, 1)
            and PLACEMENT_POLICY_KEY not in spec.vllm_kwargs
            and spec.vllm_kwargs.get("gpu_memory_utilization") is None)


def joint_slot(spec: ModelSpec, sizer: Sizer, pending: Sequence[tuple[ModelSpec, ModelProfile]],
               devices: list[DeviceCapacity], make_sizer: Callable[[ModelSpec, ModelProfile], Sizer], budget_is_applied: bool,
               normal_use: dict[str, int]) -> Slot | None:
    """The GPU and byte budget of ``spec`` in the joint plan with ``pending``; None: keep the normal plan.

    ``normal_use``: bytes per device the normal (throughput-first) plan of ``spec`` reserves.
    The joint plan is used only when it places more pending deploys on GPUs than remain
    placeable after the normal plan.
    """
    gpus = [dc for dc in devices if dc.device.kind is not DeviceKind.CPU]
    if not gpus or not modellable(spec):
        return None
    caps = {dc.device.id: capacity(dc, budget_is_applied=budget_is_applied) for dc in gpus}
    by_id = {dc.device.id: dc for dc in gpus}
    items: list[_Item] = []
    me = _item(spec.model_id, spec, sizer.profile, sizer, gpus, caps)
    if me is None:
        return None
    items.append(me)
    for p_spec, p_profile in list(pending)[:MAX_PENDING]:
        if not modellable(p_spec) or p_spec.model_id == spec.model_id:
            continue
        try:
            p_sizer = make_sizer(p_spec, p_profile)
        except PlanningError:
            continue  # its own deploy will say what is wrong
        item = _item(p_spec.model_id, p_spec, p_profile, p_sizer, gpus, caps)
        if item is not None:
            items.append(item)
    if len(items) == 1:
        return None
    after = {d: c - normal_use.get(d, 0) for d, c in caps.items()}
    kept = _Solver(items[1:], by_id, after).solve()
    kept_placed = sum(1 for d in kept.values() if d is not None)
    solver = _Solver(items, by_id, caps)
    where = solver.solve()
    if where.get(me.key) is None or sum(1 for k, d in where.items() if d and k != me.key) < kept_placed:
        return None  # the joint plan cannot place this deploy on a GPU, or would place fewer pending
    dev = where[me.key]
    assert dev is not None  # placed: checked above
    alloc = solver.allocation(dev, frozenset(k for k, d in where.items() if d == dev))
    assert alloc is not None  # the solver placed it there, so the device holds it
    seqs, budget = alloc[1][me.key]
    return Slot(device=by_id[dev], budget=budget, seqs=seqs,
                placed_pending=sum(1 for k, d in where.items() if d is not None and k != me.key),
                pending=len(items) - 1)


def _item(key: str, spec: ModelSpec, profile: ModelProfile, sizer: Sizer,
          gpus: list[DeviceCapacity], caps: dict[str, int]) -> _Item | None:
    eligible = {dc.device.id for dc in gpus
                if not (kind_problem(dc, spec.engine) or taint_problem(profile, dc))}
    if not eligible:
        return None
    try:
        tokens = max(RANK_TOKENS, sizer.token_candidates(False)[0])
        frame = sizer.frame(False, 1, tokens)
        cap = sizer.seq_cap(False, tokens, ceiling=True)  # spare memory may take it past the default demand
        pooling = profile.runner == "pooling" or sizer.output_len == 0
        fixed = None
        if sizer.ov.max_num_seqs or sizer.seq_target or frame.per_seq == 0 or sizer.ov.kv_cache_memory_bytes:
            fixed = cap
        start = fixed or 1
        floor = min(FLOOR_SEQS, cap)
        if not fixed and frame.total(floor, sizer.ov.kv_cache_memory_bytes) <= max(caps[d] for d in eligible):
            start = floor
        if pooling and not fixed:  # input tokens/s do not compare with output tokens/s: cheap sequences only
            one = frame.total(1, None)
            lo, hi = 1, cap
            while lo < hi:  # the most sequences within 10 % (or 512 MiB) of one sequence's footprint
                mid = (lo + hi + 1) // 2
                if frame.total(mid, None) <= max(one * (1 + POOLING_GROWTH), one + POOLING_GROWTH_BYTES):
                    lo = mid
                else:
                    hi = mid - 1
            fixed = start = lo
        need = frame.total(start, sizer.ov.kv_cache_memory_bytes)  # as the allocation counts it
    except PlanningError:
        return None
    steps = [s for s in LADDER if start < s < cap] + [cap]
    return _Item(key=key, sizer=sizer, profile=profile, need=need, eligible=eligible, tokens=tokens, fixed=fixed,
                 counts=not pooling, frame=frame, steps=[start] + [s for s in steps if s != start], start=start)


_Move = tuple[str, str | None, str]  # one deploy from a device (None: unplaced) to another


class _Solver:
    def __init__(self, items: list[_Item], devices: dict[str, DeviceCapacity], caps: dict[str, int]):
        self.items = {it.key: it for it in items}
        self.devices = devices
        self.caps = caps
        self._alloc: dict[tuple[str, frozenset[str]], tuple[float, dict[str, tuple[int, int]]] | None] = {}
        self._perf: dict[tuple[str, str], Perf] = {}

    # ---- one device ---------------------------------------------------------------------------

    def _score(self, it: _Item, dev: str, seqs: int) -> float:
        key = (it.key, dev)
        perf = self._perf.get(key)
        if perf is None:
            perf = self._perf[key] = device_perf([self.devices[dev]], False, 1, it.sizer.eager(False), it.profile)
        return it.sizer.score(perf, 1, it.tokens, seqs)

    def _bytes(self, it: _Item, seqs: int) -> int:
        return it.frame.total(seqs, it.sizer.ov.kv_cache_memory_bytes)

    def allocation(self, dev: str, residents: frozenset[str]) -> tuple[float, dict[str, tuple[int, int]]] | None:
        """(tokens/s of the residents, {key: (seqs, bytes)}) filling ``dev``; None: they do not fit."""
        key = (dev, residents)
        if key in self._alloc:
            return self._alloc[key]
        its = [self.items[k] for k in residents]
        step = {it.key: (len(it.steps) - 1 if it.fixed else 0) for it in its}
        seqs = {it.key: (it.fixed or it.start) for it in its}
        used = {it.key: self._bytes(it, seqs[it.key]) for it in its}
        room = self.caps[dev] - sum(used.values())
        if room < 0:
            self._alloc[key] = None
            return None
        score = {it.key: self._score(it, dev, seqs[it.key]) for it in its}
        while True:  # greedy: the next step of sequences with the most tokens/s per byte
            best = None
            for it in its:
                i = step[it.key]
                if it.fixed or i + 1 >= len(it.steps):
                    continue
                nxt = it.steps[i + 1]
                extra = self._bytes(it, nxt) - used[it.key]
                if extra > room:
                    continue
                gain = utility(self._score(it, dev, nxt)) - utility(score[it.key])
                if gain <= 0:
                    continue
                ratio = gain / max(1, extra)
                if best is None or ratio > best[0]:
                    best = (ratio, it, nxt, extra)
            if best is None:
                break
            _, it, nxt, extra = best
            step[it.key] += 1
            seqs[it.key] = nxt
            used[it.key] += extra
            score[it.key] = self._score(it, dev, nxt)
            room -= extra
        total = sum(utility(score[it.key]) for it in its if it.counts)
        out = (total, {k: (seqs[k], used[k]) for k in seqs})
        self._alloc[key] = out
        return out

    # ---- the assignment ---------------------------------------------------------------------------

    def solve(self) -> dict[str, str | None]:
        """Best-fit decreasing, then first-improving moves and swaps (changed devices re-evaluated only)."""
        where: dict[str, str | None] = {}
        room = dict(self.caps)
        for it in sorted(self.items.values(), key=lambda it: -it.need):  # best-fit decreasing
            fits = [d for d in it.eligible if room[d] >= it.need]
            if not fits:
                where[it.key] = None
                continue
            d = min(fits, key=lambda d: (room[d], -self._score(it, d, 1), d))
            where[it.key] = d
            room[d] -= it.need
        residents: dict[str, frozenset[str]] = {d: frozenset(k for k, w in where.items() if w == d) for d in self.caps}
        value = {d: (self.allocation(d, r) or (0.0,))[0] for d, r in residents.items()}
        deadline = time.perf_counter() + SEARCH_BUDGET_S
        for _ in range(MAX_ROUNDS):
            improved = False
            for changes in self._neighbours(where):
                gain = self._gain(changes, where, residents, value)
                if gain is None:
                    continue
                for k, _, to in changes:
                    where[k] = to
                for d, (res, val) in gain.items():
                    residents[d], value[d] = res, val
                improved = True
                if time.perf_counter() > deadline:
                    return where
            if not improved:
                break
        return where

    def _gain(self, changes: tuple[_Move, ...], where: dict[str, str | None], residents: dict[str, frozenset[str]],
              value: dict[str, float]) -> dict[str, tuple[frozenset[str], float]] | None:
        """The new state of the changed devices when ``changes`` improve (more placed, or more utility)."""
        res = {}
        placed = 0
        for k, frm, to in changes:
            if frm is None:
                placed += 1
            for d in (frm, to):
                if d is not None and d not in res:
                    res[d] = set(residents[d])
            if frm is not None:
                res[frm].discard(k)
            res[to].add(k)
        out = {}
        delta = 0.0
        for d, held in res.items():
            keys = frozenset(held)
            if sum(self.items[k].need for k in keys) > self.caps[d]:
                return None
            alloc = self.allocation(d, keys)
            if alloc is None:
                return None
            out[d] = (keys, alloc[0])
            delta += alloc[0] - value[d]
        if placed > 0 or delta > 1e-9 * (1 + abs(sum(value.values()))):
            return out
        return None

    def _neighbours(self, where: dict[str, str | None]) -> Iterator[tuple[_Move, ...]]:
        """Changes as (key, from, to) tuples: one deploy moved, or two swapped."""
        keys = sorted(where)
        for k in keys:
            for d in sorted(self.items[k].eligible):
                if d != where[k]:
                    yield ((k, where[k], d),)
        for a in range(len(keys)):
            for b in range(a + 1, len(keys)):
                ka, kb = keys[a], keys[b]
                da, db = where[ka], where[kb]
                if da is None or db is None or da == db:
                    continue
                if db in self.items[ka].eligible and da in self.items[kb].eligible:
                    yield ((ka, da, db), (kb, db, da))
