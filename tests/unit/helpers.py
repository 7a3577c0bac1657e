"""Small builders shared by the unit tests."""

import time
from typing import Any

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.types import EngineSettings, MemoryBreakdown, ReplicaPlan
from hive_apps.core.settings import HiveSettings
from hive_apps.ops import metrics


def replica_plan(max_num_seqs: int = 4, max_model_len: int = 512, **engine_kwargs) -> ReplicaPlan:
    return ReplicaPlan(
        index=0, node_id="n", node_name="n", devices=["n:gpu0"], device_kind=DeviceKind.SIM_GPU, device_indices=[0],
        settings=EngineSettings(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                gpu_memory_utilization=0.5, kv_cache_memory_bytes=2**30),
        memory=MemoryBreakdown(weights=1, kv_cache=1, activations=1, overhead=1),
        reservation_bytes=4, engine_kwargs=engine_kwargs,
    )


class ManualClock:
    """Wall time that moves only when a test says so: pass it as the registry's, the reconciler's
    and the lifecycle's ``clock``, then ``advance`` past a deadline instead of editing records."""

    def __init__(self, now: float | None = None):
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """A metrics backend in place of Ray's metric objects: the last value of each gauge series, every event.
    Pass it as ``metrics.Publisher(backend=...)`` to what a test builds, then read what was published."""

    def __init__(self):
        self.values: dict[tuple[str, tuple], float] = {}
        self.events: list[tuple[str, dict, float]] = []

    def record(self, metric, tags, value):
        if metrics.DEFS[metric].kind == "gauge":
            self.values[(metric, tags)] = value
        else:
            self.events.append((metric, dict(tags), value))

    def gauge(self, metric, **tags) -> float | None:
        return self.values.get((metric, tuple(sorted(tags.items()))))

    def total(self, metric, **tags) -> float:
        return sum(v for m, t, v in self.events if m == metric and all(t.get(k) == w for k, w in tags.items()))


def recorded_publisher(recorder: Recorder | None = None) -> metrics.Publisher:
    """A publisher into ``recorder`` (a fresh one: for tests that do not read their metrics)."""
    return metrics.Publisher(backend=recorder if recorder is not None else Recorder())


def routing(settings: HiveSettings | None = None, publisher: metrics.Publisher | None = None) -> dict[str, Any]:
    """What a ``ReplicaSet``, ``WakeHold`` or gateway gets from its composition root: ``settings`` (else
    read from the environment now, as a test that sets ``HIVE_*`` means) and a metrics publisher."""
    return {"settings": settings if settings is not None else HiveSettings(),
            "publisher": publisher if publisher is not None else recorded_publisher()}
