"""The hive's plan for Qwen3-0.6B-FP8 (1024 in / 2048 out) on an L4, an A10 and an H100, beside vLLM's defaults.

Run:  python benchmarks/plan_report.py

Pure Python, no Ray, no vLLM engine. Each card is planned alone, empty, with the registry's
usual budget (0.90 of its memory). "vLLM defaults" is what ``vllm serve`` would do on the
same card with only ``--max-model-len 3072``: OPENAI_API_SERVER batch defaults
(EngineArgs.get_batch_defaults: >= 70 GiB and not an A100 -> 8192 batched tokens / 1024
sequences, other GPUs -> 2048 / 256) and ``gpu_memory_utilization=0.92``
(CacheConfig default in 0.32), so KV = 0.92 x total - (weights + activation peak + runtime
buffers + CUDA graphs), the non-KV terms taken from the same memory model the planner uses
(vLLM measures them while it starts). KV tokens = (blocks - 1) x 16, the null block held back;
max concurrency = blocks / cdiv(3072, 16), as vLLM logs it. Without ``--max-model-len`` vLLM
would use the model's 40960 positions, and concurrency at that length is shown too.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hive_apps.core.catalog import GIB, GPU_CATALOG  # noqa: E402
from hive_apps.core.devices import Device, DeviceKind  # noqa: E402
from hive_apps.core.planning import memory as mem  # noqa: E402
from hive_apps.core.planning.memory import human_bytes  # noqa: E402
from hive_apps.core.planning.planner import plan_deployment  # noqa: E402
from hive_apps.core.planning.profile import load_profile  # noqa: E402
from hive_apps.core.planning.report import render_plan_table  # noqa: E402
from hive_apps.core.planning.throughput import Throughput, device_perf  # noqa: E402
from hive_apps.core.planning.types import DeviceCapacity  # noqa: E402
from hive_apps.core.spec import ModelSpec  # noqa: E402

MODEL = os.path.join(ROOT, "tests", "fixtures", "model_configs", "Qwen__Qwen3-0.6B-FP8")
CARDS = ["L4", "A10", "H100-80GB"]
INPUT, OUTPUT = 1024, 2048
BUDGET = 0.90  # what the registry lets the hive fill
VLLM_UTIL = 0.92  # vllm/config/cache.py CacheConfig.gpu_memory_utilization default
BLOCK = 16


def card(key: str, index: int) -> DeviceCapacity:
    g = GPU_CATALOG[key]
    device = Device(id=f"{key.lower()}:gpu0", node_id=f"id-{key}", node_name=key.lower(), kind=DeviceKind.GPU,
                    index=0, name=g.name, total_bytes=g.memory_bytes, used_bytes=0,
                    compute_capability=g.compute_capability, sm_count=g.sm_count,
                    memory_bandwidth_gbps=g.memory_bandwidth_gbps, tdp_w=g.tdp_w, fp16_tflops=g.fp16_tflops)
    return DeviceCapacity(device=device, available_bytes=int(BUDGET * g.memory_bytes), free_bytes=g.memory_bytes)


def vllm_batch_defaults(dc: DeviceCapacity) -> tuple[int, int]:
    """OPENAI_API_SERVER defaults of EngineArgs.get_batch_defaults (research note §A3)."""
    d = dc.device
    if d.total_bytes >= 160 * GIB:
        return 16384, 1024
    if d.total_bytes >= 70 * GIB and "A100" not in d.name:
        return 8192, 1024
    return 2048, 256


def vllm_defaults(profile, dc: DeviceCapacity, max_model_len: int) -> dict:
    tokens, seqs = vllm_batch_defaults(dc)
    frame = mem.Frame(profile, tp=1, on_cpu=False, max_model_len=max_model_len, max_num_batched_tokens=tokens,
                      enforce_eager=False, block_size=BLOCK)
    non_kv = frame.total(seqs, kv_bytes=0) - frame.context  # in-budget terms without the KV cache
    kv = int(VLLM_UTIL * dc.device.total_bytes) - non_kv
    page = BLOCK * profile.kv_bytes_per_token(1)
    blocks = max(0, kv // page)

    def concurrency(length: int) -> float:
        return blocks / -(-length // BLOCK)

    fits = blocks - 1 >= -(-max_model_len // BLOCK)
    running = min(seqs, int(concurrency(max_model_len)))
    perf = device_perf([dc], False, 1, False, profile)
    tps = Throughput(profile, perf, 1, INPUT, OUTPUT).tokens_per_s(tokens, max(1, running)) if fits else 0.0
    return dict(tokens=tokens, seqs=seqs, util=VLLM_UTIL, kv=kv, kv_tokens=max(0, blocks - 1) * BLOCK,
                conc=concurrency(max_model_len), conc_native=concurrency(profile.max_position_embeddings or 0),
                running=running, tps=tps, start_free=VLLM_UTIL * dc.device.total_bytes + frame.context)


def main() -> None:
    profile = load_profile(MODEL, {})
    q = profile.quant
    print(f"model: Qwen3-0.6B-FP8 (fixture {os.path.relpath(MODEL, ROOT)}): {profile.architecture}, "
          f"{profile.num_params / 1e9:.3f}B params, {q.weight_format if q else 'bf16'} weights "
          f"{human_bytes(profile.weight_bytes)}, KV {profile.kv_bytes_per_token(1)} B/token (bf16 KV cache)")
    print(f"request: max_input_prompt_length={INPUT}, max_output_prompt_length={OUTPUT} -> max_model_len "
          f"{INPUT + OUTPUT}; each card empty, hive budget {BUDGET:.2f} x memory\n")

    rows = []
    for i, key in enumerate(CARDS):
        dc = card(key, i)
        spec = ModelSpec(model_id="qwen3-0-6b-fp8", model=MODEL, max_input_prompt_length=INPUT,
                         max_output_prompt_length=OUTPUT)
        plan = plan_deployment(spec, [dc], profile)
        print(f"=== {dc.device.name} ({key}, compute capability "
              f"{dc.device.compute_capability[0]}.{dc.device.compute_capability[1]}) ===")
        print(render_plan_table(plan))
        print()
        r = plan.replicas[0]
        s = r.settings
        page = BLOCK * profile.kv_bytes_per_token(1)
        hive_blocks = s.kv_cache_memory_bytes // page
        v = vllm_defaults(profile, dc, s.max_model_len)
        rows.append((key, "hive plan", str(s.max_num_seqs), str(s.max_num_batched_tokens), str(s.max_model_len),
                     f"{s.gpu_memory_utilization:.3f}", human_bytes(s.kv_cache_memory_bytes),
                     str((hive_blocks - 1) * BLOCK), f"{hive_blocks / -(-s.max_model_len // BLOCK):.1f}",
                     human_bytes(r.memory.total), f"{r.expected_tokens_per_s:.0f}",
                     "; ".join(n.split(": ", 1)[-1][:60] + "..." for n in r.notes) or "-"))
        rows.append((key, "vLLM defaults", str(v["seqs"]), str(v["tokens"]), str(s.max_model_len),
                     f"{v['util']:.3f}", human_bytes(v["kv"]), str(v["kv_tokens"]), f"{v['conc']:.1f}",
                     human_bytes(v["start_free"]) + " free needed", f"{v['tps']:.0f}",
                     f"{v['conc_native']:.1f}x at 40960 without --max-model-len; runs min(seqs, conc)="
                     f"{v['running']}"))

    header = ("card", "settings", "max_num_seqs", "max_batched_tokens", "max_model_len", "gpu_mem_util",
              "KV cache", "KV tokens", "max conc. @len", "footprint", "tok/s (est.)", "remarks")
    width = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print("=== side by side ===")
    print("  ".join(h.ljust(w) for h, w in zip(header, width)))
    print("  ".join("-" * w for w in width))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    print("\nA10 (compute capability 8.6): fp8 weights need >= 8.9 for fp8 tensor cores. vLLM 0.32 does not refuse "
          "the checkpoint: Fp8Config's minimum capability is 7.5 and below 8.9 the linear layers use the FP8 Marlin "
          "weight-only kernel (W8A16), so the weights keep their 1-byte size and matmuls run in bf16. The planner "
          "therefore plans the A10 like any card (same memory) and notes the fallback; only cards below 7.5 "
          "(V100) are rejected with an arch taint. An fp8 *KV cache* would still be tainted below 8.9.")
    print("command: python benchmarks/plan_report.py")


if __name__ == "__main__":
    main()
