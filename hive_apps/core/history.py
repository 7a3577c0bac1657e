"""The hive's own short history: one-minute points of each model's load and each device's memory,
and each model's last wakes, so "was it busy an hour ago?" needs no Prometheus. Pure: no Ray.

Bounded by construction: at most ``KEEP_S`` of points per series, ``MAX_SERIES`` series of each kind
and ``MAX_WAKES`` wakes per model, so it fits in one KV value (the admin stores it there each
minute and reads it back on start; ``since`` and ``restarts`` say what a gap means).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

MINUTE_S = 60.0
KEEP_S = 90 * MINUTE_S  # an hour and a half of points
MAX_SERIES = 128  # models, and devices, kept; the least recently seen go first
MAX_WAKES = 20  # per model
MAX_RESTARTS = 20


class ModelPoint(BaseModel):
    """One minute of one model: requests counted from the engines' own counters, peaks of the rest."""

    t: float  # the minute's start, epoch seconds
    requests: int = 0
    seconds: float = 0.0  # how much of the minute the counters covered (requests_per_s = requests / seconds)
    running: int = 0  # most seen in the minute, summed over replicas
    waiting: int = 0
    capacity: int = 0  # planned max_num_seqs of the replicas that answered
    resident: bool = True  # False: asleep (nothing running, nothing held)

    @property
    def requests_per_s(self) -> float:
        return round(self.requests / self.seconds, 3) if self.seconds > 0 else 0.0


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
    counters: dict[str, tuple[float, int]] = Field(default_factory=dict)  # model -> (read at, requests_total)

    # --- feeding ----------------------------------------------------------------------
    def model(self, model_id: str, now: float, requests_total: int | None = None, running: int = 0,
              waiting: int = 0, capacity: int = 0, resident: bool = True) -> None:
        """One reading of a model. ``requests_total``: the engines' counters summed (None: asleep or
        unread); a counter that went backwards is an engine that restarted, so only its new count is taken."""
        p = _point(self.models.setdefault(model_id, []), now, ModelPoint)
        if requests_total is not None:
            prev = self.counters.get(model_id)
            if prev is not None and 0 < now - prev[0] <= 2 * MINUTE_S:
                p.requests += requests_total - prev[1] if requests_total >= prev[1] else requests_total
                p.seconds = min(MINUTE_S, p.seconds + now - prev[0])
            self.counters[model_id] = (now, requests_total)
        else:
            self.counters.pop(model_id, None)
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
        self.counters = {k: v for k, v in self.counters.items() if k in self.models}

    # --- reading and keeping ------------------------------------------------------------
    def view(self, now: float) -> dict[str, Any]:
        """``GET /admin/history``: every series oldest first, with requests/s worked out."""
        return {
            "now": now, "since": self.since, "restarts": self.restarts, "minute_s": MINUTE_S, "keep_s": KEEP_S,
            "models": {m: [{**p.model_dump(exclude={"seconds"}), "requests_per_s": p.requests_per_s} for p in pts]
                       for m, pts in sorted(self.models.items())},
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
            h.counters = {}  # the gap is not counted as traffic
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
