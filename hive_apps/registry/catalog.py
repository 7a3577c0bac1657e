"""Built-in catalog of GPU models for simulated devices and what-if planning.

Figures are the vendors' datasheet values: memory in GiB as NVML reports the card's
total (rounded to the marketed size), FP16/BF16 dense tensor TFLOPS, memory bandwidth in
GB/s, board TDP in watts. SM counts are from NVIDIA's architecture whitepapers.
"""

from __future__ import annotations

from pydantic import BaseModel

GIB = 1024**3


class GpuModel(BaseModel):
    key: str
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bandwidth_gbps: float
    tdp_w: int
    fp16_tflops: float


def _gpu(key: str, name: str, mem_gib: float, cc: tuple[int, int], sms: int, bw: float, tdp: int, tflops: float) -> GpuModel:
    return GpuModel(
        key=key, name=name, memory_bytes=int(mem_gib * GIB), compute_capability=cc,
        sm_count=sms, memory_bandwidth_gbps=bw, tdp_w=tdp, fp16_tflops=tflops,
    )


GPU_CATALOG: dict[str, GpuModel] = {
    g.key: g
    for g in [
        _gpu("H200", "NVIDIA H200", 141, (9, 0), 132, 4800, 700, 989),
        _gpu("H100-80GB", "NVIDIA H100 80GB HBM3", 80, (9, 0), 132, 3350, 700, 989),
        _gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", 80, (8, 0), 108, 2039, 400, 312),
        _gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", 40, (8, 0), 108, 1555, 400, 312),
        _gpu("L40S", "NVIDIA L40S", 48, (8, 9), 142, 864, 350, 362),
        _gpu("L4", "NVIDIA L4", 24, (8, 9), 58, 300, 72, 121),
        _gpu("A10", "NVIDIA A10", 24, (8, 6), 72, 600, 150, 125),
        _gpu("RTX-4090", "NVIDIA GeForce RTX 4090", 24, (8, 9), 128, 1008, 450, 165),
        _gpu("RTX-3090", "NVIDIA GeForce RTX 3090", 24, (8, 6), 82, 936, 350, 71),
        _gpu("T4", "Tesla T4", 16, (7, 5), 40, 320, 70, 65),
        _gpu("V100-32GB", "Tesla V100-SXM2-32GB", 32, (7, 0), 80, 900, 300, 125),
        _gpu("V100-16GB", "Tesla V100-SXM2-16GB", 16, (7, 0), 80, 900, 300, 125),
    ]
}


def lookup(key: str) -> GpuModel:
    """Find a catalog entry by key, case-insensitively; the error lists the known keys."""
    for k, g in GPU_CATALOG.items():
        if k.lower() == key.lower():
            return g
    raise KeyError(f"unknown simulated GPU {key!r}; known: {', '.join(GPU_CATALOG)}")
