"""Read the devices of the node this code runs on: NVML GPUs, simulated GPUs, or the CPU.

Runs inside a small per-node Ray actor (see ``control/registry/deployment.py``). No Ray import
here, so it is testable and reusable by a standalone agent.

Simulated GPUs are declared by the node label ``ray-hive/sim-gpus``: catalog keys joined
by dots, e.g. ``"H100-80GB.H100-80GB"`` for two H100s (Ray label values allow letters,
digits, ``-``, ``_`` and ``.``).

Real GPUs are identified by their NVML name against the built-in catalog
(``core/catalog.py``: bandwidth, TFLOPS, SMs, TDP); a card the catalog does not know
gets figures estimated from NVML, each listed in the device's ``estimates``. A node "has
GPUs" when ``/dev/nvidia<N>`` device files exist (``gpu_device_files``); if NVML cannot be
used there, the node's sample carries the ``error`` and one unreadable GPU device per file,
never a CPU device in their place.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import psutil
from pydantic import BaseModel

from hive_apps.core.catalog import identify, lookup
from hive_apps.core.devices import Device, DeviceKind, NodeSample, device_id
from hive_apps.core.drivers import nvml_cuda_version

NODE_NAME_LABEL = "ray-hive/node"
SIM_GPUS_LABEL = "ray-hive/sim-gpus"

log = logging.getLogger(__name__)


def node_name_of(node_id: str, labels: dict[str, str]) -> str:
    return labels.get(NODE_NAME_LABEL) or node_id[:8]


def sim_gpu_keys(labels: dict[str, str]) -> list[str]:
    raw = labels.get(SIM_GPUS_LABEL, "")
    return [k for k in raw.split(".") if k] if raw else []


# Tensor FLOPs per SM per clock, dense FP16 with FP32 accumulate, by compute capability
# (architecture whitepapers: Volta/Turing 8 tensor cores x 64 FMA, GA100 4 x 256, GA10x/Ada
# 4 x 128, Hopper 4 x 512; Blackwell B200 twice Hopper). Used only for cards the catalog
# does not know. GeForce parts run FP32 accumulate at half this rate.
TENSOR_FLOPS_PER_SM_CLOCK = {(7, 0): 1024, (7, 2): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 1024, (8, 7): 1024,
                             (8, 9): 1024, (9, 0): 4096, (10, 0): 8192, (12, 0): 1024}
# CUDA cores per SM, to turn nvmlDeviceGetNumGpuCores into SMs when the attributes call fails.
CORES_PER_SM = {(7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128,
                (10, 0): 128, (12, 0): 128}
FP8_FROM_CC = (8, 9)
DEV_DIR = "/dev"


def gpu_device_files(dev_dir: str | None = None) -> list[int]:
    """Indices of ``/dev/nvidia<N>``: how a node is known to have GPUs without NVML.

    The NVIDIA kernel driver creates one such file per GPU, and a container sees exactly
    the ones it was given (Kubernetes' device plugin mounts the allocated GPUs, Docker's
    ``--gpus`` likewise), so their presence is the node's GPUs whether or not NVML works.
    ``/dev/nvidiactl``, ``-uvm`` and ``-modeset`` are not GPUs.
    """
    try:
        names = os.listdir(dev_dir or DEV_DIR)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"nvidia(\d+)", n)))


def _pynvml() -> Any:
    """The NVML binding (nvidia-ml-py); tests replace ``sys.modules['pynvml']`` with a fake."""
    import pynvml

    return pynvml


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlReading(BaseModel):
    devices: list[Device] = []
    error: str | None = None  # NVML could not be used at all (the reason)


TORCH_CUDA = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def torch_cuda_runtime() -> str | None:
    """The CUDA this node's torch was built for ("13.0"), or None without torch or for a CPU build.

    Read from ``torch/version.py`` (``cuda: Optional[str] = '13.0'``), never by importing torch:
    the monitor runs every second in a small actor and in the agent, where importing torch would
    cost seconds and hundreds of MB.
    """
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    text = _read(os.path.join(folders[0], "version.py")) if folders else None
    m = TORCH_CUDA.search(text or "")
    return m.group(1) if m else None


def read_driver(nvml: Any) -> dict[str, str | None]:
    """The node's NVIDIA driver version and the CUDA version it supports, as Device fields
    (None where NVML does not answer)."""
    def call(name: str) -> Any:
        fn = getattr(nvml, name, None)  # a binding (or a test's fake) without the function
        return None if fn is None else _optional(nvml, fn)

    driver = call("nvmlSystemGetDriverVersion")
    cuda = call("nvmlSystemGetCudaDriverVersion_v2")  # nvidia-ml-py >= 12.535 (pyproject) has it
    return {"driver_version": None if driver is None else _text(driver),
            "cuda_driver_version": None if cuda is None else nvml_cuda_version(int(cuda))}


def read_nvml_gpus(node_id: str, node_name: str) -> NvmlReading:
    """Every physical GPU NVML sees, identified against the catalog; ``error`` where NVML fails.

    A device whose own queries fail is reported with its ``error`` set (and no memory), so
    the registry shows it and the planner never places on it. Each readable GPU carries the
    node's driver and CUDA versions (``read_driver``, ``torch_cuda_runtime``).
    """
    try:
        nvml = _pynvml()
    except ImportError as exc:
        return NvmlReading(error=f"the NVML binding (nvidia-ml-py) cannot be imported: {exc}")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return NvmlReading(error=f"nvmlInit failed: {exc}")
    devices = []
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            return NvmlReading(error=f"nvmlDeviceGetCount failed: {exc}")
        versions = {**read_driver(nvml), "cuda_runtime": torch_cuda_runtime()}
        for i in range(count):
            try:
                devices.append(_read_device(nvml, node_id, node_name, i).model_copy(update=versions))
            except nvml.NVMLError as exc:
                devices.append(unreadable_gpu(node_id, node_name, i, f"NVML could not read GPU {i}: {exc}"))
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return NvmlReading(devices=devices)


def _optional(nvml: Any, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except (nvml.NVMLError, AttributeError, NotImplementedError):
        return None


def _read_device(nvml: Any, node_id: str, node_name: str, i: int) -> Device:
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    name = _text(nvml.nvmlDeviceGetName(h))
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    cc = tuple(nvml.nvmlDeviceGetCudaComputeCapability(h))
    known = identify(name, mem.total)
    if known is not None:
        fields, estimates = known.speed_fields(), []  # type: dict[str, Any], list[str]
        fields["compute_capability"] = cc  # NVML's word on the card in hand
        key = known.key
    else:
        fields, estimates = estimate_figures(nvml, h, name, cc)
        key = None
    return Device(
        id=device_id(node_name, DeviceKind.GPU, i), node_id=node_id, node_name=node_name, kind=DeviceKind.GPU,
        index=i, name=name, uuid=_text(nvml.nvmlDeviceGetUUID(h)), total_bytes=mem.total, used_bytes=mem.used,
        catalog_key=key, estimates=estimates, **fields,
    )


def estimate_figures(nvml: Any, h: Any, name: str, cc: tuple[int, int]) -> tuple[dict[str, Any], list[str]]:
    """Figures of a card the catalog does not know, from what NVML reports, each with a warning."""
    notes = [f"{name!r} is not in the GPU catalog (hive_apps/core/catalog.py); the figures below are "
             "estimated from NVML, add the card to the catalog for datasheet figures"]
    fields: dict[str, Any] = {"compute_capability": cc}
    mem_mhz = _optional(nvml, nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_MEM)
    bus = _optional(nvml, nvml.nvmlDeviceGetMemoryBusWidth, h)
    if mem_mhz and bus:
        bw = mem_mhz * 1e6 * 2 * bus / 8 / 1e9  # double data rate: NVML's memory clock is half the data rate
        fields["memory_bandwidth_gbps"] = round(bw, 1)
        notes.append(f"memory_bandwidth_gbps={bw:.0f}: NVML max memory clock {mem_mhz} MHz x 2 (double data "
                     f"rate) x {bus}-bit bus / 8")
    else:
        notes.append("memory_bandwidth_gbps unknown: NVML gave no memory clock or bus width; the planner "
                     "assumes its fallback bandwidth")
    attrs = _optional(nvml, nvml.nvmlDeviceGetAttributes, h)
    sms = getattr(attrs, "multiprocessorCount", None) or None
    if sms is None:
        cores = _optional(nvml, nvml.nvmlDeviceGetNumGpuCores, h)
        per_sm = CORES_PER_SM.get(cc)
        if cores and per_sm:
            sms = cores // per_sm
            notes.append(f"sm_count={sms}: {cores} CUDA cores / {per_sm} per SM (compute capability "
                         f"{cc[0]}.{cc[1]})")
    fields["sm_count"] = sms
    sm_mhz = _optional(nvml, nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM)
    rate = TENSOR_FLOPS_PER_SM_CLOCK.get(cc) or TENSOR_FLOPS_PER_SM_CLOCK.get((cc[0], 0))
    if sms and sm_mhz and rate:
        tf = sms * sm_mhz * 1e6 * rate / 1e12
        fields["fp16_tflops"] = round(tf, 1)
        notes.append(f"fp16_tflops={tf:.0f}: {sms} SMs x {sm_mhz} MHz x {rate} tensor FLOPs per SM per clock "
                     f"(compute capability {cc[0]}.{cc[1]}); a GeForce card reaches half of this with FP32 "
                     "accumulate")
        if cc >= FP8_FROM_CC:
            fields["fp8_tflops"] = round(2 * tf, 1)
            notes.append(f"fp8_tflops={2 * tf:.0f}: twice fp16_tflops (FP8 tensor cores from compute "
                         "capability 8.9)")
    else:
        notes.append("fp16_tflops unknown: no SM count, SM clock or known per-SM rate for compute capability "
                     f"{cc[0]}.{cc[1]}; the planner assumes its fallback compute")
    limit = _optional(nvml, nvml.nvmlDeviceGetPowerManagementDefaultLimit, h) or \
        _optional(nvml, nvml.nvmlDeviceGetPowerManagementLimit, h)
    if limit:
        fields["tdp_w"] = int(limit) // 1000
        notes.append(f"tdp_w={int(limit) // 1000}: NVML's default power limit")
    return fields, notes


def unreadable_gpu(node_id: str, node_name: str, index: int, error: str) -> Device:
    """A GPU the node has but NVML cannot read: listed with its reason, never planned on."""
    return Device(id=device_id(node_name, DeviceKind.GPU, index), node_id=node_id, node_name=node_name,
                  kind=DeviceKind.GPU, index=index, name="unreadable GPU", total_bytes=0, error=error)


def nvml_used_bytes(indices: list[int]) -> list[int]:
    """Used memory of the given physical GPUs right now (NVML ignores CUDA_VISIBLE_DEVICES)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used for i in indices]
    finally:
        pynvml.nvmlShutdown()


def simulated_gpus(node_id: str, node_name: str, keys: list[str]) -> list[Device]:
    out = []
    for i, key in enumerate(keys):
        g = lookup(key)
        out.append(
            Device(
                id=device_id(node_name, DeviceKind.SIM_GPU, i),
                node_id=node_id,
                node_name=node_name,
                kind=DeviceKind.SIM_GPU,
                index=i,
                name=g.key,
                total_bytes=g.memory_bytes,
                used_bytes=0,
                compute_capability=g.compute_capability,
                sm_count=g.sm_count,
                memory_bandwidth_gbps=g.memory_bandwidth_gbps,
                tdp_w=g.tdp_w,
                fp16_tflops=g.fp16_tflops,
                fp8_tflops=g.fp8_tflops,
                catalog_key=g.key,
            )
        )
    return out


CGROUP_ROOT = "/sys/fs/cgroup"
# (limit, usage, stat, its inactive-file key): cgroup v2, then v1
CGROUP_MEMORY_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                       ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                        "total_inactive_file"))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_memory(root: str = CGROUP_ROOT) -> tuple[int, int] | None:
    """(limit, working set) bytes of this process's memory cgroup, or None without a limit. The
    working set is usage minus inactive file cache, as the kubelet counts it for evictions."""
    for limit_file, usage_file, stat_file, inactive_key in CGROUP_MEMORY_FILES:
        limit, usage = _read(os.path.join(root, limit_file)), _read(os.path.join(root, usage_file))
        if limit is None or usage is None:
            continue
        if not limit.isdigit() or not usage.isdigit():
            return None  # "max": no limit
        inactive = 0
        for line in (_read(os.path.join(root, stat_file)) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key and value.strip().isdigit():
                inactive = int(value)
        return int(limit), max(0, int(usage) - inactive)
    return None


def host_memory(root: str = CGROUP_ROOT) -> tuple[int, int]:
    """(total, used) bytes of the RAM this node's engines may use: the machine's, or its container's
    where a memory limit caps it lower (a KubeRay pod: CPU engines and level-1 sleepers' weights
    live under that limit, and passing it is an OOM kill, not swap)."""
    vm = psutil.virtual_memory()
    capped = cgroup_memory(root)
    if capped is not None and capped[0] < vm.total:
        return capped[0], min(capped[0], capped[1])
    return vm.total, vm.total - vm.available


def cpu_device(node_id: str, node_name: str) -> Device:
    total, used = host_memory()
    return Device(
        id=device_id(node_name, DeviceKind.CPU, None),
        node_id=node_id,
        node_name=node_name,
        kind=DeviceKind.CPU,
        name="cpu",
        total_bytes=total,
        used_bytes=used,
        cpu_count=os.cpu_count(),
    )


def sample_devices(node_id: str, name: str, sim_keys: list[str]) -> tuple[list[Device], str | None]:
    """The devices of this node, and an error where its GPUs cannot be read.

    Real GPUs (NVML) win; a node NVML cannot read but that has GPUs (``gpu_device_files``)
    gets one unreadable device per GPU and the error, never a CPU device in their place.
    Without GPUs: the simulated GPUs of its label, else the CPU itself.
    """
    reading = read_nvml_gpus(node_id, name)
    if reading.devices:
        return reading.devices, None
    present = gpu_device_files()
    if reading.error and present:
        error = (f"{reading.error}; this node has {len(present)} GPU(s) (/dev/nvidia{present[0]}"
                 f"{'..' + str(present[-1]) if len(present) > 1 else ''}) that the hive cannot read: check the "
                 "NVIDIA driver (nvidia-smi) and that libnvidia-ml.so.1 is visible to the monitor's process")
        log.error("node %s: %s", name, error)
        return [unreadable_gpu(node_id, name, i, error) for i in present], error
    gpus = simulated_gpus(node_id, name, sim_keys)
    return (gpus or [cpu_device(node_id, name)]), None


def sample_node(node_id: str, labels: dict[str, str], source: str = "ray-monitor") -> NodeSample:
    name = node_name_of(node_id, labels)
    total, used = host_memory()
    devices, error = sample_devices(node_id, name, sim_gpu_keys(labels))
    return NodeSample(
        node_id=node_id, node_name=name, host_total_bytes=total, host_used_bytes=used,
        cpu_count=os.cpu_count() or 1, devices=devices, sampled_at=time.time(), source=source, error=error,
        cuda_runtime=torch_cuda_runtime(),
    )
