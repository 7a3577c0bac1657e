"""Built-in catalog of GPU models: the figures NVML does not give, and the simulated devices.

A real GPU is identified by its NVML name (``identify``); its memory always comes from NVML,
its speed figures from here. Figures are public spec-sheet values, dense (no 2:4 sparsity):

* memory bandwidth in GB/s, SM count, board TDP in W, compute capability: NVIDIA product
  datasheets (H200, H100, A100, L40S, L40, L4, A10, A30, T4, V100, RTX A6000, RTX 6000 Ada,
  GH200) and architecture whitepapers (Volta GV100, Ampere GA100/GA102, Ada AD102, Hopper
  GH100) for SM counts;
* ``fp16_tflops``: dense FP16/BF16 tensor TFLOPS *with FP32 accumulate* (what vLLM's GEMMs
  use); datasheets print the sparse figure, here halved. GeForce cards run FP32-accumulate
  tensor math at half the FP16-accumulate rate (Ampere GA102 and Ada whitepapers), which is
  why the RTX 3090/4090 rows are below their marketing figure;
* ``fp8_tflops``: dense FP8 tensor TFLOPS, None where the card has no FP8 tensor cores
  (compute capability below 8.9);
* A10G (AWS): no NVIDIA datasheet; bandwidth, SMs and TDP as AWS and ``nvidia-smi`` report
  them, TFLOPS derived from the A10's per-SM rate (GA102 data-center part) at the A10G's
  boost clock.

``memory_bytes`` is the marketed size in GiB (what simulated devices get); a real device's
total is NVML's.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

GIB = 1024**3


class GpuModel(BaseModel):
    key: str
    name: str  # the NVML name of the card
    memory_bytes: int
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bandwidth_gbps: float
    tdp_w: int
    fp16_tflops: float  # dense FP16/BF16 tensor, FP32 accumulate
    fp8_tflops: float | None = None  # dense FP8 tensor; None: no FP8 tensor cores
    nvml_pattern: str  # regex over the normalised NVML name (see ``normalise``)

    def speed_fields(self) -> dict[str, Any]:
        """The Device fields this entry fills (memory excluded: a real device's comes from NVML)."""
        return {"compute_capability": self.compute_capability, "sm_count": self.sm_count,
                "memory_bandwidth_gbps": self.memory_bandwidth_gbps, "tdp_w": self.tdp_w,
                "fp16_tflops": self.fp16_tflops, "fp8_tflops": self.fp8_tflops}


def _gpu(key: str, name: str, mem_gib: float, cc: tuple[int, int], sms: int, bw: float, tdp: int,
         tflops: float, fp8: float | None, pattern: str) -> GpuModel:
    return GpuModel(
        key=key, name=name, memory_bytes=int(mem_gib * GIB), compute_capability=cc, sm_count=sms,
        memory_bandwidth_gbps=bw, tdp_w=tdp, fp16_tflops=tflops, fp8_tflops=fp8, nvml_pattern=pattern,
    )


# Several entries may match one name (A100 40 GB and 80 GB SXM4 share "a100 sxm4" on some
# drivers); ``identify`` then takes the one whose memory is closest to NVML's total.
GPU_CATALOG: dict[str, GpuModel] = {
    g.key: g
    for g in [
        # key, NVML name, GiB, cc, SMs, GB/s, TDP W, FP16/BF16 dense, FP8 dense, pattern
        _gpu("H200", "NVIDIA H200", 141, (9, 0), 132, 4800, 700, 989.4, 1978.9, r"^h200\b(?!.*\bnvl\b)"),
        _gpu("H200-NVL", "NVIDIA H200 NVL", 141, (9, 0), 132, 4800, 600, 835.5, 1671.0, r"^h200 nvl\b"),
        _gpu("GH200-96GB", "NVIDIA GH200 480GB", 96, (9, 0), 132, 4000, 1000, 989.4, 1978.9, r"^gh200\b"),
        _gpu("GH200-144GB", "NVIDIA GH200 144G HBM3e", 144, (9, 0), 132, 4900, 1000, 989.4, 1978.9, r"^gh200\b"),
        _gpu("H100-80GB", "NVIDIA H100 80GB HBM3", 80, (9, 0), 132, 3350, 700, 989.4, 1978.9,
             r"^h100\b(?!.*\b(pcie|nvl)\b)"),
        _gpu("H100-PCIe", "NVIDIA H100 PCIe", 80, (9, 0), 114, 2000, 350, 756.5, 1513.0, r"^h100\b.*\bpcie\b"),
        _gpu("H100-NVL", "NVIDIA H100 NVL", 94, (9, 0), 132, 3900, 400, 835.5, 1671.0, r"^h100 nvl\b"),
        _gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", 80, (8, 0), 108, 2039, 400, 312, None, r"^a100\b(?!.*\bpcie\b)"),
        _gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", 40, (8, 0), 108, 1555, 400, 312, None, r"^a100\b(?!.*\bpcie\b)"),
        _gpu("A100-80GB-PCIe", "NVIDIA A100 80GB PCIe", 80, (8, 0), 108, 1935, 300, 312, None, r"^a100\b.*\bpcie\b"),
        _gpu("A100-40GB-PCIe", "NVIDIA A100-PCIE-40GB", 40, (8, 0), 108, 1555, 250, 312, None, r"^a100\b.*\bpcie\b"),
        _gpu("L40S", "NVIDIA L40S", 48, (8, 9), 142, 864, 350, 362.1, 733.0, r"^l40s\b"),
        _gpu("L40", "NVIDIA L40", 48, (8, 9), 142, 864, 300, 181.0, 362.0, r"^l40\b"),
        _gpu("L4", "NVIDIA L4", 24, (8, 9), 58, 300, 72, 121.0, 242.5, r"^l4\b"),
        _gpu("A10", "NVIDIA A10", 24, (8, 6), 72, 600, 150, 125.0, None, r"^a10\b"),
        _gpu("A10G", "NVIDIA A10G", 24, (8, 6), 80, 600, 300, 140.0, None, r"^a10g\b"),
        _gpu("A30", "NVIDIA A30", 24, (8, 0), 56, 933, 165, 165.0, None, r"^a30\b"),
        _gpu("RTX-4090", "NVIDIA GeForce RTX 4090", 24, (8, 9), 128, 1008, 450, 165.2, 330.3, r"^rtx 4090$"),
        _gpu("RTX-3090", "NVIDIA GeForce RTX 3090", 24, (8, 6), 82, 936, 350, 71.0, None, r"^rtx 3090$"),
        _gpu("RTX-A6000", "NVIDIA RTX A6000", 48, (8, 6), 84, 768, 300, 154.8, None, r"^rtx a6000$"),
        _gpu("RTX-6000-Ada", "NVIDIA RTX 6000 Ada Generation", 48, (8, 9), 142, 960, 300, 364.2, 728.5,
             r"^rtx 6000 ada\b"),
        _gpu("T4", "Tesla T4", 16, (7, 5), 40, 320, 70, 65.0, None, r"^t4\b"),
        _gpu("V100-32GB", "Tesla V100-SXM2-32GB", 32, (7, 0), 80, 900, 300, 125.0, None, r"^v100 sxm"),
        _gpu("V100-16GB", "Tesla V100-SXM2-16GB", 16, (7, 0), 80, 900, 300, 125.0, None, r"^v100 sxm"),
        _gpu("V100-PCIe-32GB", "Tesla V100-PCIE-32GB", 32, (7, 0), 80, 900, 250, 112.0, None, r"^v100 pcie"),
        _gpu("V100-PCIe-16GB", "Tesla V100-PCIE-16GB", 16, (7, 0), 80, 900, 250, 112.0, None, r"^v100 pcie"),
        _gpu("V100S", "Tesla V100S-PCIE-32GB", 32, (7, 0), 80, 1134, 250, 130.0, None, r"^v100s\b"),
    ]
}

_PREFIXES = ("nvidia ", "tesla ", "geforce ", "quadro ")


def normalise(nvml_name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'a100 sxm4 80gb'; vendor and product-line words dropped."""
    s = re.sub(r"[-_/]+", " ", nvml_name.lower()).strip()
    s = re.sub(r"\s+", " ", s)
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if s.startswith(p):
                s, changed = s[len(p):], True
    return s


def identify(nvml_name: str, total_bytes: int | None = None) -> GpuModel | None:
    """The catalog entry of a card NVML names so; among variants, the closest memory size wins."""
    s = normalise(nvml_name)
    hits = [g for g in GPU_CATALOG.values() if re.search(g.nvml_pattern, s)]
    if not hits:
        return None
    if total_bytes is None or len(hits) == 1:
        return hits[0]
    return min(hits, key=lambda g: abs(g.memory_bytes - total_bytes))


def lookup(key: str) -> GpuModel:
    """Find a catalog entry by key, case-insensitively; the error lists the known keys."""
    for k, g in GPU_CATALOG.items():
        if k.lower() == key.lower():
            return g
    raise KeyError(f"unknown simulated GPU {key!r}; known: {', '.join(GPU_CATALOG)}")
