"""Small builders shared by the unit tests."""

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
