"""Which NVIDIA driver a GPU needs for the CUDA that its node's vLLM runs on. Pure: no torch, no NVML.

A CUDA runtime refuses a driver older than itself ("CUDA driver version is insufficient for
CUDA runtime version"), and an engine meets that only at its first CUDA call, after the
weights were fetched and the replica reserved memory. The planner refuses such a GPU up
front, naming both versions (``driver_problem``).

The need is the CUDA that the node's installed torch was built for (``Device.cuda_runtime``,
read by the monitor from ``torch/version.py``); a node that did not report it is assumed to
run the torch that vLLM 0.32 brings (``VLLM_CUDA``). The hive asks for the driver NVIDIA ships
with that toolkit, not the lower floor of CUDA's minor-version compatibility (any 580 driver
for 13.x): under that, PTX built by the newer toolkit cannot be JIT-compiled, and Triton and
FlashInfer kernels are such code.
"""

from __future__ import annotations

import re

from hive_apps.core.devices import Device, DeviceKind

# vLLM 0.32.0 pins torch==2.13.0 (its METADATA's Requires-Dist); PyPI's torch 2.13.0 wheels are
# built for CUDA 13.0 (their torch/version.py: cuda = '13.0').
VLLM_CUDA = (13, 0)

# The Linux driver each CUDA toolkit release shipped with: NVIDIA's CUDA Toolkit Release Notes,
# Table 3 "CUDA Toolkit and Corresponding Driver Versions" (GA releases; 13.0 GA: 580.65.06).
TOOLKIT_DRIVERS: dict[tuple[int, int], str] = {
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26",
    (12, 9): "575.51.03", (13, 0): "580.65.06",
}

# What a reported version may look like ("580.65.06", "13.0"): digits and dots, bounded, as
# pushed samples are checked (control/registry/samples.py).
VERSION = re.compile(r"\d{1,5}(\.\d{1,5}){0,3}")


def numbers(version: str | None) -> tuple[int, ...] | None:
    """"580.65.06" -> (580, 65, 6); None where absent or not a version."""
    if version is None or not VERSION.fullmatch(version):
        return None
    return tuple(int(p) for p in version.split("."))


def cuda_version(version: str | None) -> tuple[int, int] | None:
    """A CUDA version's (major, minor): "13.0" -> (13, 0), "12.8.1" -> (12, 8)."""
    parts = numbers(version)
    if parts is None:
        return None
    return parts[0], (parts[1] if len(parts) > 1 else 0)


def nvml_cuda_version(value: int) -> str:
    """NVML's CUDA driver version as text: 13000 -> "13.0", 12040 -> "12.4" (major x 1000 + minor x 10)."""
    return f"{value // 1000}.{value % 1000 // 10}"


def required_cuda(device: Device) -> tuple[int, int]:
    """The CUDA the engines on this device run: the node's torch build, else vLLM 0.32's."""
    return cuda_version(device.cuda_runtime) or VLLM_CUDA


def driver_problem(device: Device) -> str | None:
    """Why this GPU's driver cannot run the node's vLLM, or None (also when NVML did not say:
    no evidence is no refusal). Simulated GPUs and CPUs have no driver."""
    if device.kind is not DeviceKind.GPU:
        return None
    need = required_cuda(device)
    floor = TOOLKIT_DRIVERS.get(need)
    have_cuda = cuda_version(device.cuda_driver_version)
    have_driver = numbers(device.driver_version)
    if have_cuda is not None:
        ok = have_cuda >= need  # NVML's word on what the driver supports
    elif have_driver is not None and floor is not None:
        ok = have_driver >= numbers(floor)  # type: ignore[operator]  # a table entry always parses
    else:
        return None
    if ok:
        return None
    has = f"NVIDIA driver {device.driver_version or 'of unknown version'}"
    if device.cuda_driver_version:
        has += f" (CUDA {device.cuda_driver_version})"
    wants = f"driver {floor} or newer" if floor else f"a driver for CUDA {need[0]}.{need[1]} or newer"
    return (f"node {device.node_name} gpu{device.index} has {has}; this vLLM's torch needs CUDA "
            f"{need[0]}.{need[1]}, {wants}: upgrade the node's NVIDIA driver (nvidia-smi shows it)")
