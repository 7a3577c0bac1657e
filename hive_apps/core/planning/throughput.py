"""The roofline estimate of one replica's tokens/s (the formulas are in ``planner.py``'s docstring).

Kept apart from the sizer so that packing and the benchmarks rank settings the same way without
reaching into the planner.
"""

from __future__ import annotations

from pydantic import BaseModel

from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.planning.types import DeviceCapacity

GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_COMPUTE_EFFICIENCY = 0.5
GPU_STEP_S = 1.5e-3
GPU_EAGER_STEP_S = 4e-3
TP_ALLREDUCE_S = 10e-6  # per all-reduce; two per layer per step
CPU_BANDWIDTH_PER_CORE = 10e9
CPU_FLOPS_PER_CORE = 50e9
CPU_EFFICIENCY = 0.5
CPU_STEP_S = 10e-3
FALLBACK_BANDWIDTH_GBPS = 900.0
FALLBACK_TFLOPS = 100.0


class Perf(BaseModel):
    """What one rank of a device does per second, and what one engine step costs."""

    bandwidth: float  # bytes/s one rank reads
    flops: float  # flop/s one rank computes
    step_s: float  # fixed cost of one engine step


def device_perf(devs: list[DeviceCapacity], on_cpu: bool, tp: int, eager: bool, profile: ModelProfile) -> Perf:
    """The datasheet figures of the slowest device of a TP group, at the efficiencies above."""
    if on_cpu:
        cores = max(1, min(dc.device.cpu_count or 4 for dc in devs))
        cores_per_rank = max(1, cores // tp)
        return Perf(bandwidth=min(CPU_BANDWIDTH_PER_CORE * cores_per_rank, 100e9) * CPU_EFFICIENCY,
                    flops=CPU_FLOPS_PER_CORE * cores_per_rank * CPU_EFFICIENCY, step_s=CPU_STEP_S)
    bw = min(dc.device.memory_bandwidth_gbps or FALLBACK_BANDWIDTH_GBPS for dc in devs)
    fp8 = bool(profile.quant and profile.quant.fp8_weights)  # W8A8 on cards with FP8 tensor cores
    tf = min((dc.device.fp8_tflops if fp8 and dc.device.fp8_tflops else dc.device.fp16_tflops) or FALLBACK_TFLOPS
             for dc in devs)
    step = (GPU_EAGER_STEP_S if eager else GPU_STEP_S) + (2 * profile.num_layers * TP_ALLREDUCE_S if tp > 1 else 0)
    return Perf(bandwidth=bw * 1e9 * GPU_BANDWIDTH_EFFICIENCY, flops=tf * 1e12 * GPU_COMPUTE_EFFICIENCY, step_s=step)


class Throughput:
    """The roofline estimate (``planner.py``'s docstring), with the model's figures bound once per TP size."""

    __slots__ = ("perf", "pooling", "weights", "experts", "num_experts", "top_k", "active", "attn",
                 "kv_per_token", "state", "input_len", "output_len")

    def __init__(self, profile: ModelProfile, perf: Perf, tp: int, input_len: int, output_len: int) -> None:
        self.perf = perf
        self.pooling = profile.runner == "pooling" or output_len == 0
        self.weights = profile.weight_bytes_per_rank(tp)
        self.experts = profile.role_bytes("experts") / tp if profile.num_experts else 0.0
        self.num_experts = profile.num_experts
        self.top_k = max(1, profile.experts_per_token)
        self.active = profile.active_params / tp
        attn_layers = sum(g.num_layers for g in profile.attention_groups)
        self.attn = attn_layers * profile.num_attention_heads * profile.head_dim / tp  # flops/token/context token /4
        self.kv_per_token = profile.kv_bytes_per_token(tp)
        self.state = profile.state_bytes_per_sequence(tp)
        self.input_len = input_len
        self.output_len = output_len

    def tokens_per_s(self, tokens: int, seqs: int) -> float:
        """Output tokens/s of one replica (pooling: input tokens/s)."""
        perf, p_len, g_len = self.perf, self.input_len, self.output_len
        prefill_flops = tokens * (2 * self.active + 4 * (p_len / 2) * self.attn)
        prefill_s = perf.step_s + max(self.weights / perf.bandwidth, prefill_flops / perf.flops)
        prefill_steps = -(-seqs * p_len // tokens)
        if self.pooling:
            return seqs * p_len / (prefill_steps * prefill_s)
        ctx = p_len + g_len / 2
        read: float = self.weights
        if self.num_experts:  # experts no token of the batch routes to are not read
            touched = min(1.0, seqs * self.top_k / self.num_experts)
            read -= self.experts * (1 - touched)
        read += seqs * (ctx * self.kv_per_token + self.state)
        flops = seqs * (2 * self.active + 4 * ctx * self.attn)
        decode_s = perf.step_s + max(read / perf.bandwidth, flops / perf.flops)
        return seqs * g_len / (g_len * decode_s + prefill_steps * prefill_s)
