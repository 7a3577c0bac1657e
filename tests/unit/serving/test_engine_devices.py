"""An engine replica starts only on the GPUs its plan pinned (serving/engine/cuda_devices.py): the UUIDs
CUDA gives it, against NVML's for the planned indices. The CUDA side is a fake torch device table
(objects with ``.uuid`` printing as torch's does, without "GPU-", and ``.name``); NVML is the fake
``pynvml`` of tests/unit/fake_nvml.py."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from hive_apps.core.devices import DeviceKind
from hive_apps.serving.engine import cuda_devices
from hive_apps.serving.engine.cuda_devices import PlannedGpu, WrongDevices, device_mismatch, opened_gpus
from tests.unit.fake_nvml import FakeNvml, h100_sxm, l4
from tests.unit.helpers import replica_plan

UUIDS = ["GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-1b1b1b1b-1111-1111-1111-111111111111",
         "GPU-2c2c2c2c-2222-2222-2222-222222222222"]


@dataclass
class TorchDevice:
    """What torch.cuda.get_device_properties(i) gives: its uuid prints without NVML's "GPU-"."""

    uuid: str
    name: str


def torch_device(i: int, name: str) -> TorchDevice:
    return TorchDevice(uuid=UUIDS[i].removeprefix("GPU-"), name=name)


@pytest.fixture
def node(monkeypatch) -> FakeNvml:
    """A mixed node as NVML (PCI bus order) sees it: gpu0 an L4, gpu1 and gpu2 H100s."""
    cards = [l4(), h100_sxm(), h100_sxm()]
    for card, uuid in zip(cards, UUIDS):
        card.uuid = uuid
    fake = FakeNvml(cards)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


H100, L4 = "NVIDIA H100 80GB HBM3", "NVIDIA L4"


def test_the_planned_gpus_in_order_give_their_uuids(node):
    assert opened_gpus([1, 2], [torch_device(1, H100), torch_device(2, H100)]) == UUIDS[1:]
    assert opened_gpus([0], [torch_device(0, L4)]) == UUIDS[:1]
    assert node.initialised == 0  # NVML shut down again


def test_another_card_fails_the_start_naming_the_planned_and_the_opened_one(node, monkeypatch):
    """CUDA counting fastest first put the H100 first: CUDA_VISIBLE_DEVICES=0 opened it, not the L4."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    with pytest.raises(WrongDevices) as err:
        opened_gpus([0], [torch_device(1, H100)])
    msg = str(err.value)
    assert f"CUDA device 0 should be planned GPU 0 ({L4}, {UUIDS[0]}) but is {H100} {UUIDS[1]}" in msg
    assert "a GPU the plan did not pin" in msg
    assert "CUDA_VISIBLE_DEVICES=0, CUDA_DEVICE_ORDER=(unset)" in msg


def test_swapped_order_fails_the_start(node):
    with pytest.raises(WrongDevices) as err:
        opened_gpus([1, 2], [torch_device(2, H100), torch_device(1, H100)])
    msg = str(err.value)
    assert f"CUDA device 0 should be planned GPU 1 ({H100}, {UUIDS[1]}) but is {H100} {UUIDS[2]} (planned GPU 2, out of order)" in msg
    assert f"CUDA device 1 should be planned GPU 2 ({H100}, {UUIDS[2]}) but is {H100} {UUIDS[1]} (planned GPU 1, out of order)" in msg


def test_a_missing_device_fails_the_start(node):
    with pytest.raises(WrongDevices) as err:
        opened_gpus([1, 2], [torch_device(1, H100)])
    assert f"planned GPU 2 ({H100}, {UUIDS[2]}) is missing: CUDA sees only 1 device(s)" in str(err.value)
    with pytest.raises(WrongDevices, match="planned GPU 0 .* is missing: CUDA sees only 0 device"):
        opened_gpus([0], [])  # e.g. a CPU build of torch on a GPU node


def test_more_devices_than_planned_fail_the_start(node):
    with pytest.raises(WrongDevices, match=f"CUDA sees 2 devices where the plan pins 1: also {H100} {UUIDS[2]}"):
        opened_gpus([1], [torch_device(1, H100), torch_device(2, H100)])


def test_the_comparison_is_pure_and_ignores_case_and_the_prefix():
    planned = [PlannedGpu(index=3, uuid=UUIDS[0], name=L4)]
    assert device_mismatch(planned, [TorchDevice(uuid=UUIDS[0].upper(), name=L4)]) is None
    assert device_mismatch(planned, [TorchDevice(uuid=UUIDS[0].removeprefix("GPU-"), name=L4)]) is None
    assert "missing" in device_mismatch(planned, [])
    assert "torch" not in vars(cuda_devices)  # torch is imported only where the table is read


# ---- the vLLM engine's start: the check runs on CUDA only, on what the workers opened ---------------

class Workers:
    """vLLM's engine as check_devices uses it: collective_rpc by method name, one answer per rank."""

    def __init__(self, opened: list[dict]):
        self.opened, self.asked = opened, []

    async def collective_rpc(self, method: str):
        self.asked.append(method)
        return self.opened


def vllm_replica(kind: DeviceKind, indices: list[int], opened: list[dict]):
    from hive_apps.serving.engine import vllm_engine

    engine = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)
    engine.model_id, engine.device_uuids, engine.engine = "m", None, Workers(opened)
    engine.replica = replica_plan().model_copy(update={"device_kind": kind, "device_indices": indices})
    return engine


async def test_a_gpu_replica_checks_the_devices_its_workers_opened(monkeypatch):
    from hive_apps.serving.engine import vllm_engine

    monkeypatch.setattr(cuda_devices, "planned_gpus", lambda idx: [PlannedGpu(index=i, uuid=UUIDS[i], name=H100) for i in idx])
    ranks = [{"uuid": UUIDS[1].removeprefix("GPU-"), "name": H100}, {"uuid": UUIDS[2].removeprefix("GPU-"), "name": H100}]
    engine = vllm_replica(DeviceKind.GPU, [1, 2], ranks)
    await vllm_engine.VLLMEngine.check_devices(engine, ours=True)
    assert engine.engine.asked == ["hive_opened_device"] and engine.device_uuids == UUIDS[1:]

    swapped = vllm_replica(DeviceKind.GPU, [1, 2], ranks[::-1])
    with pytest.raises(WrongDevices, match="out of order"):
        await vllm_engine.VLLMEngine.check_devices(swapped, ours=True)


async def test_a_cpu_replica_or_an_operators_extension_skips_the_check():
    from hive_apps.serving.engine import vllm_engine

    for kind, ours in ((DeviceKind.CPU, True), (DeviceKind.GPU, False)):
        engine = vllm_replica(kind, [], [])
        await vllm_engine.VLLMEngine.check_devices(engine, ours=ours)
        assert engine.engine.asked == [] and engine.device_uuids is None
