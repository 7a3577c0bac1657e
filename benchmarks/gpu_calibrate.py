"""Calibrate the planner's GPU memory constants on one real CUDA GPU, with PyTorch only.

Run on a machine with one CUDA GPU, PyTorch built for CUDA, nvidia-ml-py and transformers
(the project's own dependencies; no vLLM, no Ray):

    python benchmarks/gpu_calibrate.py                       # GPU 0, three fixture models
    python benchmarks/gpu_calibrate.py --models Qwen__Qwen3-0.6B --device 1
    python benchmarks/gpu_calibrate.py --plan-only --card H100-80GB   # no GPU: the planner's side only

It measures, and prints beside the planner's figures (``hive_apps/core/planning/memory.py``):

1. CUDA context: this process's NVML memory after ``torch.cuda.init()`` and a 1-element
   tensor, minus what torch reserved (planner: ``CUDA_CONTEXT_BYTES``); and after the first
   bf16 matmul, which creates the cuBLAS handle and workspace (the planner's
   ``CUBLAS_WORKSPACE_BYTES``, one part of ``GPU_RUNTIME_BYTES``).
2. NVML against torch: tensors of 256 MiB, 1 GiB and 4 GiB; NVML's used memory against
   ``torch.cuda.memory_reserved()`` and ``memory_allocated()`` after each (the registry reads
   NVML, vLLM's budget counts torch): slope and offset of the fit.
3. Activation peak: each fixture model built from its ``config.json`` with random bf16
   weights (transformers ``from_config``, SDPA attention), then one forward of the planned
   ``max_num_batched_tokens`` (T) tokens as vLLM's profile run does it: one flat batch, the
   final norm's output for ``min(max_num_seqs, T)`` positions through the LM head in fp32,
   softmax over it (the sampler's temporaries). Peak = ``max_memory_allocated`` minus
   what the weights hold. Planner: ``Frame.activations`` at the planned settings. Also the
   weights: measured against ``weights_bytes``.

T and S are what the planner plans for this GPU (identified by its NVML name against the
catalog) at each model's lengths below. Not measured here: CUDA graphs and the KV cache
(vLLM's own; the engine tier's drift check covers the total). transformers' forward is not
vLLM's (vLLM fuses QKV and gate/up projections and uses paged attention), so a measured
peak well *below* the estimate is expected; one above it is a planner bug to report.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # torch's index = NVML's index
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hive_apps.core.catalog import GPU_CATALOG, identify, lookup  # noqa: E402
from hive_apps.core.devices import Device, DeviceKind  # noqa: E402
from hive_apps.core.planning import memory as mem  # noqa: E402
from hive_apps.core.planning.planner import plan_deployment  # noqa: E402
from hive_apps.core.planning.profile import load_profile  # noqa: E402
from hive_apps.core.planning.types import DeviceCapacity  # noqa: E402
from hive_apps.core.spec import ModelSpec  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "model_configs")
MIB = 1024**2
GIB = 1024**3
# (fixture, input tokens, output tokens)
MODELS = [("Qwen__Qwen3-0.6B", 1024, 512), ("meta-llama__Llama-3.2-1B-Instruct", 2048, 512),
          ("Qwen__Qwen3-8B", 4096, 1024)]


def mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def row(what: str, measured: str, planner: str, note: str = "") -> None:
    print(f"  {what:<44} {measured:>14}   planner {planner:>14}   {note}")


# ---- the device as the planner sees it ------------------------------------------------------


def catalog_device(key: str) -> DeviceCapacity:
    g = lookup(key)
    d = Device(id="calib:gpu0", node_id="calib", node_name="calib", kind=DeviceKind.GPU, index=0, name=g.name,
               total_bytes=g.memory_bytes, catalog_key=g.key, **g.speed_fields())
    return DeviceCapacity(device=d, available_bytes=int(0.9 * g.memory_bytes), free_bytes=g.memory_bytes)


def nvml_device(nvml, index: int) -> DeviceCapacity:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(h)
    name = name.decode() if isinstance(name, bytes) else name
    info = nvml.nvmlDeviceGetMemoryInfo(h)
    g = identify(name, info.total)
    fields = g.speed_fields() if g else {"compute_capability": tuple(nvml.nvmlDeviceGetCudaComputeCapability(h))}
    d = Device(id="calib:gpu0", node_id="calib", node_name="calib", kind=DeviceKind.GPU, index=0, name=name,
               total_bytes=info.total, used_bytes=info.used, catalog_key=g.key if g else None, **fields)
    print(f"GPU {index}: {name} ({info.total / GIB:.1f} GiB, catalog entry {g.key if g else 'none: estimates'})")
    return DeviceCapacity(device=d, available_bytes=int(0.9 * info.total) - info.used,
                          free_bytes=info.total - info.used)


def planned(fixture: str, inp: int, out: int, dc: DeviceCapacity):
    path = os.path.join(FIXTURES, fixture)
    profile = load_profile(path, {})
    spec = ModelSpec(model_id="calib", model=path, max_input_prompt_length=inp, max_output_prompt_length=out,
                     engine="sim")
    r = plan_deployment(spec, [dc], profile).replicas[0]
    s = r.settings
    frame = mem.Frame(profile, tp=1, on_cpu=False, max_model_len=s.max_model_len,
                      max_num_batched_tokens=s.max_num_batched_tokens, enforce_eager=False,
                      block_size=profile.block_size(False))
    return profile, s, frame


# ---- measurements ---------------------------------------------------------------------------


def process_used(nvml, handle) -> int:
    """This process's memory on the device as NVML counts it (0 before it has a context)."""
    pid = os.getpid()
    for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == pid and p.usedGpuMemory is not None:
            return int(p.usedGpuMemory)
    return 0


def measure_context(torch, nvml, handle, index: int) -> None:
    print("\n1. CUDA context")
    before = nvml.nvmlDeviceGetMemoryInfo(handle).used
    torch.cuda.set_device(index)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    ctx = process_used(nvml, handle) or (nvml.nvmlDeviceGetMemoryInfo(handle).used - before)
    ctx -= torch.cuda.memory_reserved()
    row("context (process NVML - torch reserved)", mib(ctx), mib(mem.CUDA_CONTEXT_BYTES), "CUDA_CONTEXT_BYTES")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.cuda.synchronize()
    after = (process_used(nvml, handle) or (nvml.nvmlDeviceGetMemoryInfo(handle).used - before))
    extra = after - torch.cuda.memory_reserved() - ctx
    row("+ cuBLAS handle and workspace (first matmul)", mib(extra), mib(mem.CUBLAS_WORKSPACE_BYTES),
        "CUBLAS_WORKSPACE_BYTES (one part of GPU_RUNTIME_BYTES)")
    del a


def measure_tracking(torch, nvml, handle) -> None:
    print("\n2. NVML used vs torch (the registry reads NVML; vLLM's budget counts torch)")
    base_nvml = nvml.nvmlDeviceGetMemoryInfo(handle).used
    base_res = torch.cuda.memory_reserved()
    points = []
    held = []
    for size in (256 * MIB, 1 * GIB, 4 * GIB):
        held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        d_nvml = nvml.nvmlDeviceGetMemoryInfo(handle).used - base_nvml
        d_res = torch.cuda.memory_reserved() - base_res
        alloc = torch.cuda.memory_allocated()
        points.append((d_res, d_nvml))
        print(f"  +{mib(size):>10} tensor: NVML +{mib(d_nvml):>10}, torch reserved +{mib(d_res):>10}, "
              f"allocated {mib(alloc):>10}")
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / max(1, sum((x - mx) ** 2 for x, _ in points))
    print(f"  fit: NVML delta = {slope:.4f} x reserved delta + {mib(my - slope * mx)}  "
          "(the planner and the ledger assume 1.0 and 0: drift is counted against NVML)")
    del held
    torch.cuda.empty_cache()


def measure_model(torch, fixture: str, profile, settings, frame, free_bytes: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    t, s = settings.max_num_batched_tokens, settings.max_num_seqs
    print(f"\n3. {fixture}: planned max_num_batched_tokens={t}, max_num_seqs={s}")
    if frame.weights * 1.2 + frame.activations(s) > free_bytes:
        print(f"  skipped: weights {mib(frame.weights)} and activations do not fit {mib(free_bytes)} free")
        return
    cfg = AutoConfig.from_pretrained(os.path.join(FIXTURES, fixture))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    weights = torch.cuda.memory_allocated() - start
    row("weights (random, bf16)", mib(weights), mib(frame.weights), "weights_bytes")
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    ids = torch.randint(0, cfg.vocab_size, (1, t), device="cuda")
    reqs = min(s, t)
    last = torch.linspace(t - 1, 0, reqs, device="cuda").long().flip(0)  # one position per request
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        hidden = base(input_ids=ids, use_cache=False).last_hidden_state[0, last]
        logits = model.lm_head(hidden).float()
        probs = torch.softmax(logits, dim=-1)
        torch.topk(probs, k=min(50, probs.shape[-1]), dim=-1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    planned_act = frame.activations(s)
    row(f"activation peak, {t} tokens, {reqs} requests", mib(peak), mib(planned_act),
        "Frame.activations" + ("  <-- ABOVE the estimate" if peak > planned_act else ""))
    del model, base, ids, hidden, logits, probs
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0, help="CUDA index (NVML's numbering)")
    ap.add_argument("--models", nargs="*", default=[m for m, _, _ in MODELS], help="fixture folders")
    ap.add_argument("--plan-only", action="store_true", help="no GPU: print the planner's side for --card")
    ap.add_argument("--card", default="H100-80GB", help=f"with --plan-only: one of {', '.join(GPU_CATALOG)}")
    args = ap.parse_args()
    lengths = {m: (i, o) for m, i, o in MODELS}

    if args.plan_only:
        dc = catalog_device(args.card)
        print(f"planner figures on {dc.device.name} (catalog {args.card}), no GPU used")
        print(f"  CUDA_CONTEXT_BYTES {mib(mem.CUDA_CONTEXT_BYTES)}, GPU_RUNTIME_BYTES {mib(mem.GPU_RUNTIME_BYTES)}, "
              f"ACTIVATION_SAFETY {mem.ACTIVATION_SAFETY}, SAMPLER_BYTES_PER_SEQ_VOCAB "
              f"{mem.SAMPLER_BYTES_PER_SEQ_VOCAB}")
        for m in args.models:
            _, s, frame = planned(m, *lengths.get(m, (1024, 256)), dc)
            print(f"  {m}: T={s.max_num_batched_tokens} S={s.max_num_seqs} weights {mib(frame.weights)} "
                  f"activations {mib(frame.activations(s.max_num_seqs))}")
        return

    import pynvml as nvml
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch; use --plan-only on a machine without a GPU")
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(args.device)
        dc = nvml_device(nvml, args.device)
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
        measure_context(torch, nvml, handle, args.device)
        measure_tracking(torch, nvml, handle)
        for m in args.models:
            profile, s, frame = planned(m, *lengths.get(m, (1024, 256)), dc)
            free = nvml.nvmlDeviceGetMemoryInfo(handle).free
            measure_model(torch, m, profile, s, frame, free)
    finally:
        nvml.nvmlShutdown()


if __name__ == "__main__":
    main()
