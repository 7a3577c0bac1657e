"""What an engine says it still holds once it slept in place (``EngineBase.sleep``'s ``SleepReport``):
a vLLM engine measures it with NVML, a sim engine holds vLLM's planned residual."""

from __future__ import annotations

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.memory import CUDA_CONTEXT_BYTES, GPU_RUNTIME_BYTES, MIB
from hive_apps.core.planning.types import MemoryBreakdown
from hive_apps.core.settings import HiveSettings
from hive_apps.serving.engine import base
from hive_apps.serving.engine.base import EngineBase
from tests.unit.helpers import replica_plan
from tests.unit.serving.test_sim_engine import engine

GIB = 2**30


async def test_a_sleeping_sim_engine_holds_vllms_planned_residual_on_each_device():
    e = await engine(sim_tokens_per_s=2000, sim_memory_factor=1.5)
    graphs = 300 * MIB
    e.replica.memory = MemoryBreakdown(weights=GIB, kv_cache=GIB, activations=GIB, cuda_graphs=graphs,
                                       overhead=CUDA_CONTEXT_BYTES + GPU_RUNTIME_BYTES + graphs)
    e.replica.reservation_bytes = 10 * GIB
    report = await e.sleep(2)
    # the CUDA context and the graph pool (a sim plan carries no vLLM offload option; TP 1: no NCCL),
    # times sim_memory_factor, as its start's allocation is
    assert report.residual_bytes == {"n:gpu0": int(1.5 * (CUDA_CONTEXT_BYTES + graphs))}
    assert (await e.sleep(2)).residual_bytes == report.residual_bytes  # asked again (a new admin): the same
    await e.wake_up()
    assert e.residual_bytes is None


class NvmlEngine(EngineBase):
    """An engine on two real GPUs whose sleep NVML watches (``nvml``: what each read returns)."""

    def __init__(self, footprint: int | None):
        super().__init__(HiveSettings(auth_disabled=True))
        self.model_id = "m"
        self.replica = replica_plan().model_copy(update={
            "devices": ["n:gpu0", "n:gpu1"], "device_indices": [0, 1], "device_kind": DeviceKind.GPU})
        self.use_start_lock = False
        self.footprint_bytes = footprint

    def can_sleep(self) -> bool:
        return True

    async def _sleep(self, level: int) -> None:
        pass


def nvml(monkeypatch, readings: list[list[int]]) -> None:
    def used(indices: list[int]) -> list[int]:
        assert indices == [0, 1]
        return readings.pop(0)

    monkeypatch.setattr(base, "nvml_used_bytes", used)


async def test_a_gpu_engine_measures_its_residual_as_its_footprint_less_what_the_sleep_freed(monkeypatch):
    readings = [[30 * GIB, 31 * GIB], [21 * GIB, int(22.5 * GIB)]]  # before and after: 9 and 8.5 GiB freed
    nvml(monkeypatch, readings)
    e = NvmlEngine(footprint=10 * GIB)
    report = await e.sleep(1)
    assert report.residual_bytes == {"n:gpu0": 1 * GIB, "n:gpu1": int(1.5 * GIB)} and readings == []


async def test_a_sleep_that_freed_more_than_the_footprint_holds_nothing_and_unknowns_are_left_to_the_plan(monkeypatch):
    nvml(monkeypatch, [[30 * GIB, 30 * GIB], [19 * GIB, 20 * GIB]])  # 11 and 10 GiB freed of a 10 GiB start
    assert (await NvmlEngine(footprint=10 * GIB).sleep(1)).residual_bytes == {"n:gpu0": 0, "n:gpu1": 0}
    nvml(monkeypatch, [[30 * GIB, 30 * GIB], [20 * GIB, 20 * GIB]])
    assert (await NvmlEngine(footprint=None).sleep(1)).residual_bytes is None  # its start measured nothing

    def broken(indices: list[int]) -> list[int]:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(base, "nvml_used_bytes", broken)
    assert (await NvmlEngine(footprint=10 * GIB).sleep(1)).residual_bytes is None
