"""The hive's own short history: one-minute points of each model's load and each device's memory,
and each model's last wakes, so "was it busy an hour ago?" needs no Prometheus. Pure: no Ray.

Rates come from the engines' own cumulative counters (``EngineLoad``), read per replica every few
seconds: what a counter took between two reads of the same replica is added to the minute's point
(requests, prompt and generated tokens, and the time-to-first-token histogram's buckets), so the
point's rate is that sum over the seconds the reads covered, and its p50 TTFT is the median of the
minute's first tokens, interpolated inside the bucket it falls in (``bucket_quantile``, as
Prometheus's ``histogram_quantile``). A counter that went back is a replica whose engine restarted:
only its new count is taken. A replica not read for over two minutes starts again from its next read.

Bounded by construction: at most ``KEEP_S`` of points per series, ``MAX_SERIES`` series of each kind
and ``MAX_WAKES`` wakes per model, so it fits in one KV value (the admin stores it there each
minute and reads it back on start; ``since`` and ``restarts`` say what a gap means).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from hive_apps.core.buckets import TTFT_BOUNDS_S

MINUTE_S = 60.0
KEEP_S = 90 * MINUTE_S  # an hour and a half of points
MAX_SERIES = 128  # models, and devices, kept; the least recently seen go first
MAX_WAKES = 20  # per model
MAX_RESTARTS = 20
MAX_GAP_S = 2 * MINUTE_S  # two reads of a replica further apart than this: the gap is not counted as traffic


class Totals(BaseModel):
    """One replica's cumulative counters as its engine reported them (``EngineLoad``)."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_buckets: list[int] = Field(default_factory=list)  # cumulative, one per TTFT_BOUNDS_S (empty: none sent)
    ttft_count: int = 0
    ttft_sum_s: float = 0.0


class Reading(Totals):
    at: float  # when it was read


def delta(prev: Totals, cur: Totals) -> Totals:
    """What the counters took between two reads of one replica. A counter that went back is an engine
    that restarted in between: the whole new count is taken then. The histogram's part is empty when
    either read has no buckets (or not as many: different bounds), so it is never added wrongly."""
    if (cur.requests < prev.requests or cur.prompt_tokens < prev.prompt_tokens
            or cur.generation_tokens < prev.generation_tokens or cur.ttft_count < prev.ttft_count
            or any(c < b for c, b in zip(cur.ttft_buckets, prev.ttft_buckets))):
        prev = Totals()  # restarted: from zero
    # buckets from before (none at all when the engine had counted nothing: restarted, or new)
    before = prev.ttft_buckets or ([0] * len(cur.ttft_buckets) if prev.ttft_count == 0 else [])
    if cur.ttft_buckets and len(before) == len(cur.ttft_buckets):
        buckets = [max(0, c - b) for c, b in zip(cur.ttft_buckets, before)]
        count, sum_s = cur.ttft_count - prev.ttft_count, max(0.0, cur.ttft_sum_s - prev.ttft_sum_s)
    else:
        buckets, count, sum_s = [], 0, 0.0
    return Totals(requests=cur.requests - prev.requests, prompt_tokens=cur.prompt_tokens - prev.prompt_tokens,
                  generation_tokens=cur.generation_tokens - prev.generation_tokens,
                  ttft_buckets=buckets, ttft_count=count, ttft_sum_s=sum_s)


def bucket_quantile(q: float, bounds: Sequence[float], buckets: Sequence[int], count: int) -> float | None:
    """The ``q`` quantile (0..1) of ``count`` observations from cumulative bucket counts
    (``buckets[i]``: how many were at most ``bounds[i]``), as Prometheus's ``histogram_quantile``: linear
    inside the bucket the rank falls in, the first bucket from 0; a rank past the last bound answers
    the last bound. None without observations or with buckets that do not match the bounds."""
    if count <= 0 or not bounds or len(buckets) != len(bounds):
        return None
    rank = max(0.0, min(1.0, q)) * count
    lower, below = 0.0, 0
    for bound, upto in zip(bounds, buckets):
        if upto >= rank and upto > below:
            return lower + (bound - lower) * (rank - below) / (upto - below)
        lower, below = bound, upto
    return float(bounds[-1])


class ModelPoint(BaseModel):
    """One minute of one model: requests and tokens counted from the engines' own counters, peaks of the rest."""

    t: float  # the minute's start, epoch seconds
    requests: int = 0
    seconds: float = 0.0  # how much of the minute the counters covered (requests_per_s = requests / seconds)
    running: int = 0  # most seen in the minute, summed over replicas
    waiting: int = 0
    capacity: int = 0  # planned max_num_seqs of the replicas that answered
    resident: bool = True  # False: asleep (nothing running, nothing held)
    prompt_tokens: int = 0  # taken in the minute, summed over replicas
    generation_tokens: int = 0
    ttft_count: int = 0  # first tokens in the minute
    ttft_sum_s: float = 0.0
    ttft_p50_s: float | None = None  # their median (None: no first token in the minute)
    ttft_buckets: list[int] = Field(default_factory=list)  # the open minute's only (its p50 is kept once it closed)

    @property
    def requests_per_s(self) -> float:
        return self._rate(self.requests)

    def _rate(self, n: int) -> float:
        return round(n / self.seconds, 3) if self.seconds > 0 else 0.0

    def add(self, d: Totals) -> None:
        self.requests += d.requests
        self.prompt_tokens += d.prompt_tokens
        self.generation_tokens += d.generation_tokens
        if d.ttft_count > 0 and d.ttft_buckets and len(d.ttft_buckets) == len(TTFT_BOUNDS_S):
            if len(self.ttft_buckets) != len(d.ttft_buckets):  # the minute's first delta (or other bounds before)
                self.ttft_buckets, self.ttft_count, self.ttft_sum_s = [0] * len(d.ttft_buckets), 0, 0.0
            self.ttft_buckets = [a + b for a, b in zip(self.ttft_buckets, d.ttft_buckets)]
            self.ttft_count += d.ttft_count
            self.ttft_sum_s += d.ttft_sum_s
            p50 = bucket_quantile(0.5, TTFT_BOUNDS_S, self.ttft_buckets, self.ttft_count)
            self.ttft_p50_s = None if p50 is None else round(p50, 4)

    def view(self) -> dict[str, Any]:
        return {**self.model_dump(exclude={"seconds", "ttft_buckets", "ttft_sum_s"}),
                "requests_per_s": self.requests_per_s,
                "prompt_tokens_per_s": self._rate(self.prompt_tokens),
                "generation_tokens_per_s": self._rate(self.generation_tokens),
                "ttft_mean_s": round(self.ttft_sum_s / self.ttft_count, 4) if self.ttft_count else None}


class DevicePoint(BaseModel):
    """One minute of one device's memory: the most seen of each in the minute."""

    t: float
    total_bytes: int = 0
    reserved_bytes: int = 0
    used_bytes: int = 0
    dormant_bytes: int = 0


class WakePoint(BaseModel):
    at: float  # when it served again, epoch seconds
    how: str  # level1, level2 or parked
    total_s: float
    placement_s: float = 0.0
    engine_start_s: float | None = None
    warm_up_s: float | None = None


class History(BaseModel):
    since: float  # when this history began; older than the admin when it was read back from the KV
    restarts: list[float] = Field(default_factory=list)  # when an admin took it over (points may be missing before)
    models: dict[str, list[ModelPoint]] = Field(default_factory=dict)
    devices: dict[str, list[DevicePoint]] = Field(default_factory=dict)
    wakes: dict[str, list[WakePoint]] = Field(default_factory=dict)
    # model -> replica -> its last read counters (a history stored before them has none: a KV value's
    # unknown keys are ignored, so an older admin's value is still read back)
    reads: dict[str, dict[str, Reading]] = Field(default_factory=dict)

    # --- feeding ----------------------------------------------------------------------
    def model(self, model_id: str, now: float, totals: Mapping[str, Totals] | None = None, running: int = 0,
              waiting: int = 0, capacity: int = 0, resident: bool = True) -> None:
        """One reading of a model. ``totals``: each replica's counters as its engine reports them (None:
        asleep or unread). What each replica's counters took since its last read goes to the minute."""
        points = self.models.setdefault(model_id, [])
        p = _point(points, now, ModelPoint)
        for older in points[:-1][-1:]:
            older.ttft_buckets = []  # a closed minute keeps its p50, not its buckets (the KV value stays small)
        if totals is not None:
            reads = self.reads.setdefault(model_id, {})
            covered = 0.0
            for replica, cur in totals.items():
                prev = reads.get(replica)
                if prev is not None and 0 < now - prev.at <= MAX_GAP_S:
                    p.add(delta(prev, cur))
                    covered = max(covered, now - prev.at)
                reads[replica] = Reading(at=now, **cur.model_dump())
            p.seconds = min(MINUTE_S, p.seconds + covered)
            for replica in [r for r, read in reads.items() if now - read.at > MAX_GAP_S]:
                del reads[replica]  # a replica gone (scaled in, moved): its next read starts afresh
        else:
            self.reads.pop(model_id, None)
        p.running, p.waiting = max(p.running, running), max(p.waiting, waiting)
        p.capacity = max(p.capacity, capacity)
        p.resident = resident  # as last read in the minute

    def device(self, device_id: str, now: float, total: int, reserved: int, used: int, dormant: int) -> None:
        p = _point(self.devices.setdefault(device_id, []), now, DevicePoint)
        p.total_bytes = max(p.total_bytes, total)
        p.reserved_bytes, p.used_bytes = max(p.reserved_bytes, reserved), max(p.used_bytes, used)
        p.dormant_bytes = max(p.dormant_bytes, dormant)

    def wake(self, model_id: str, wake: WakePoint) -> None:
        """A wake as the record reports it (the same wake read twice is kept once)."""
        kept = self.wakes.setdefault(model_id, [])
        if not any(w.at == wake.at for w in kept):
            kept.append(wake)
            del kept[:-MAX_WAKES]

    def trim(self, now: float) -> None:
        """Drop points older than ``KEEP_S``, series left empty, and the least recently seen past ``MAX_SERIES``."""
        _trim(self.models, now)
        _trim(self.devices, now)
        for model_id in list(self.wakes):
            self.wakes[model_id] = [w for w in self.wakes[model_id] if w.at > now - KEEP_S]
            if not self.wakes[model_id] or model_id not in self.models:
                del self.wakes[model_id]
        self.reads = {k: v for k, v in self.reads.items() if k in self.models}

    # --- reading and keeping ------------------------------------------------------------
    def view(self, now: float) -> dict[str, Any]:
        """``GET /admin/history``: every series oldest first, with requests/s, tokens/s (prompt and
        generated) and the p50 time to first token worked out per minute."""
        return {
            "now": now, "since": self.since, "restarts": self.restarts, "minute_s": MINUTE_S, "keep_s": KEEP_S,
            "models": {m: [p.view() for p in pts] for m, pts in sorted(self.models.items())},
            "devices": {d: [p.model_dump() for p in pts] for d, pts in sorted(self.devices.items())},
            "wakes": {m: [w.model_dump() for w in ws] for m, ws in sorted(self.wakes.items())},
        }

    def dump(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def resume(cls, raw: bytes | None, now: float) -> History:
        """The history a previous admin stored, taken over now (a restart noted); a fresh one when
        there is none or it does not parse."""
        if raw is not None:
            try:
                h = cls.model_validate_json(raw)
            except (ValidationError, ValueError):
                return cls(since=now)
            h.restarts = [*h.restarts, now][-MAX_RESTARTS:]
            h.reads = {}  # the gap is not counted as traffic
            h.trim(now)
            return h
        return cls(since=now)


P = TypeVar("P", ModelPoint, DevicePoint)


def _point(points: list[P], now: float, kind: type[P]) -> P:
    """The point of ``now``'s minute, appended when it is a new one."""
    t = math.floor(now / MINUTE_S) * MINUTE_S
    if not points or points[-1].t < t:
        points.append(kind(t=t))
    return points[-1]


def _trim(series: dict[str, list[P]], now: float) -> None:
    for key in list(series):
        series[key] = [p for p in series[key] if p.t > now - KEEP_S]
        if not series[key]:
            del series[key]
    for key in sorted(series, key=lambda k: series[k][-1].t)[:-MAX_SERIES]:
        del series[key]
