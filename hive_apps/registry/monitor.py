"""Read the devices of the node this code runs on: NVML GPUs, simulated GPUs, or the CPU.

Runs inside a small per-node Ray actor (see ``registry/deployment.py``). No Ray import
here, so it is testable and reusable by a standalone agent.

Simulated GPUs are declared by the node label ``ray-hive/sim-gpus``: catalog keys joined
by dots, e.g. ``"H100-80GB.H100-80GB"`` for two H100s (Ray label values allow letters,
digits, ``-``, ``_`` and ``.``).
"""

from __future__ import annotations

import logging
import os
import time

import psutil

from hive_apps.registry.catalog import lookup
from hive_apps.registry.devices import Device, DeviceKind, NodeSample, device_id

NODE_NAME_LABEL = "ray-hive/node"
SIM_GPUS_LABEL = "ray-hive/sim-gpus"

log = logging.getLogger(__name__)


def node_name_of(node_id: str, labels: dict[str, str]) -> str:
    return labels.get(NODE_NAME_LABEL) or node_id[:8]


def sim_gpu_keys(labels: dict[str, str]) -> list[str]:
    raw = labels.get(SIM_GPUS_LABEL, "")
    return [k for k in raw.split(".") if k] if raw else []


def read_nvml_gpus(node_id: str, node_name: str) -> list[Device]:
    """Every physical GPU NVML sees; an empty list where there is no driver."""
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    devices = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                power = pynvml.nvmlDeviceGetPowerManagementLimit(h) // 1000
            except pynvml.NVMLError:
                power = None
            try:
                sms = pynvml.nvmlDeviceGetNumGpuCores(h)  # CUDA cores; SMs are not exposed directly
            except (pynvml.NVMLError, AttributeError):
                sms = None
            devices.append(
                Device(
                    id=device_id(node_name, DeviceKind.GPU, i),
                    node_id=node_id,
                    node_name=node_name,
                    kind=DeviceKind.GPU,
                    index=i,
                    name=pynvml.nvmlDeviceGetName(h),
                    uuid=pynvml.nvmlDeviceGetUUID(h),
                    total_bytes=mem.total,
                    used_bytes=mem.used,
                    compute_capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                    sm_count=sms,
                    tdp_w=power,
                )
            )
    finally:
        pynvml.nvmlShutdown()
    return devices


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
            )
        )
    return out


def cpu_device(node_id: str, node_name: str) -> Device:
    vm = psutil.virtual_memory()
    return Device(
        id=device_id(node_name, DeviceKind.CPU, None),
        node_id=node_id,
        node_name=node_name,
        kind=DeviceKind.CPU,
        name="cpu",
        total_bytes=vm.total,
        used_bytes=vm.total - vm.available,
        cpu_count=os.cpu_count(),
    )


def sample_devices(node_id: str, name: str, sim_keys: list[str]) -> list[Device]:
    """The devices of this node: real GPUs, else simulated GPUs, else the CPU itself."""
    gpus = read_nvml_gpus(node_id, name) or simulated_gpus(node_id, name, sim_keys)
    return gpus or [cpu_device(node_id, name)]


def sample_node(node_id: str, labels: dict[str, str], source: str = "ray-monitor") -> NodeSample:
    name = node_name_of(node_id, labels)
    vm = psutil.virtual_memory()
    return NodeSample(
        node_id=node_id, node_name=name, host_total_bytes=vm.total, host_used_bytes=vm.total - vm.available,
        cpu_count=os.cpu_count() or 1, devices=sample_devices(node_id, name, sim_gpu_keys(labels)),
        sampled_at=time.time(), source=source,
    )
