"""Small builders shared by the unit tests."""

import time

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.types import EngineSettings, MemoryBreakdown, ReplicaPlan


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
