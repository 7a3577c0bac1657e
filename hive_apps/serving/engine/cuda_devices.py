"""Are the GPUs an engine replica opened the ones its plan booked?

The plan names NVML indices, which count GPUs in PCI bus order; the replica's environment pins
them with ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (control/admin/model_app.py).
Where CUDA still counts otherwise (the order variable lost, a container runtime that remaps
devices), the engine would load onto a card the registry booked for something else. So before
vLLM starts, the replica compares the UUID of each CUDA device it sees with NVML's UUID of the
planned index at the same position (CUDA device i is tensor-parallel rank i's GPU) and refuses
to start on any difference, naming the planned card and the one it got.

``device_mismatch`` is the pure comparison (a device table in, no torch); ``opened_gpus`` takes
the table vLLM's workers report (``worker_extension.hive_opened_device``: they hold a CUDA context
already, where asking torch in the replica's own process could create one) and NVML's side.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel


class PlannedGpu(BaseModel):
    """A GPU the plan pinned, as NVML names it."""

    index: int  # NVML index on the node: what CUDA_VISIBLE_DEVICES names
    uuid: str  # "GPU-..."
    name: str


class CudaDevice(Protocol):
    """What torch.cuda.get_device_properties(i) gives: ``uuid`` prints without NVML's "GPU-"."""

    @property
    def uuid(self) -> Any: ...

    @property
    def name(self) -> str: ...


class WrongDevices(RuntimeError):
    """The replica sees other GPUs than its plan pinned: it must not start."""


def nvml_uuid(uuid: Any) -> str:
    """A device UUID as NVML writes it ("GPU-6d2f..."): torch prints the same bytes without the prefix."""
    text = str(uuid).strip().lower()
    return "GPU-" + (text[4:] if text.startswith("gpu-") else text)


def device_mismatch(planned: Sequence[PlannedGpu], opened: Sequence[CudaDevice]) -> str | None:
    """Why the CUDA devices, in order, are not the planned GPUs, or None when they are."""
    by_uuid = {nvml_uuid(p.uuid): p for p in planned}
    problems = []
    for i, want in enumerate(planned):
        if i >= len(opened):
            problems.append(f"planned GPU {want.index} ({want.name}, {want.uuid}) is missing: CUDA sees only "
                            f"{len(opened)} device(s)")
            continue
        got = nvml_uuid(opened[i].uuid)
        if got == nvml_uuid(want.uuid):
            continue
        other = by_uuid.get(got)
        what = f"planned GPU {other.index}, out of order" if other is not None else "a GPU the plan did not pin"
        problems.append(f"CUDA device {i} should be planned GPU {want.index} ({want.name}, {want.uuid}) but is "
                        f"{opened[i].name} {got} ({what})")
    if len(opened) > len(planned):
        extra = ", ".join(f"{d.name} {nvml_uuid(d.uuid)}" for d in opened[len(planned):])
        problems.append(f"CUDA sees {len(opened)} devices where the plan pins {len(planned)}: also {extra}")
    return "; ".join(problems) or None


def planned_gpus(indices: Sequence[int]) -> list[PlannedGpu]:
    """NVML's UUID and name of each planned index (NVML ignores CUDA_VISIBLE_DEVICES)."""
    import pynvml

    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    pynvml.nvmlInit()
    try:
        out = []
        for i in indices:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(PlannedGpu(index=i, uuid=text(pynvml.nvmlDeviceGetUUID(h)), name=text(pynvml.nvmlDeviceGetName(h))))
        return out
    finally:
        pynvml.nvmlShutdown()


def opened_gpus(indices: Sequence[int], opened: Sequence[CudaDevice]) -> list[str]:
    """The UUIDs of the GPUs the engine's ranks opened (``opened``, rank order), once they are the
    planned ``indices`` in order; ``WrongDevices`` otherwise."""
    planned = planned_gpus(indices)
    problem = device_mismatch(planned, opened)
    if problem:
        env = ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"))
        raise WrongDevices(f"this replica opened other GPUs than planned: {problem} (its environment: {env}); "
                           "something on the node overrides the pin: the engine does not start on a card the "
                           "registry booked for something else")
    return [nvml_uuid(d.uuid) for d in opened]
