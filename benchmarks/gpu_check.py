"""One-command device check on any CUDA machine with PyTorch: no vLLM, no Ray, a few minutes.

    python benchmarks/gpu_check.py              # every GPU's identity, then GPU 0 measured
    python benchmarks/gpu_check.py --device 1 --models Qwen__Qwen3-0.6B

It runs the hive's own code where a node runs it, and prints each figure beside the planner's:

1. Identity: the monitor's NVML reading (``read_nvml_gpus``): name, catalog entry, memory, compute
   capability, SMs, the driver and the CUDA it supports, the CUDA this torch was built for, and
   whether the planner would refuse the driver (``core/drivers.py``).
2. Device order: with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (what every engine runs with), torch's
   device i must be NVML's GPU i (``cuda_devices.device_mismatch``), as each engine checks at start.
3. The monitor against torch: what ``nvml_used_bytes`` reads before and after a 2 GiB tensor.
4. gpu_calibrate's rows: the CUDA context and cuBLAS workspace, NVML against torch's reserved
   bytes, and each fixture model's weights and activation peak against the plan.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # before torch: what model_app.py gives every engine
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_calibrate as cal  # noqa: E402

from hive_apps.control.registry.monitor import nvml_used_bytes, read_nvml_gpus  # noqa: E402
from hive_apps.core.devices import Device  # noqa: E402
from hive_apps.core.drivers import driver_problem  # noqa: E402
from hive_apps.serving.engine.cuda_devices import device_mismatch, planned_gpus  # noqa: E402

GIB = 1024**3


def identity_lines(devices: list[Device]) -> list[str]:
    """One line per GPU as the registry will show it, and the planner's word on its driver."""
    out = []
    for d in devices:
        if d.error:
            out.append(f"  gpu{d.index}: unreadable: {d.error}")
            continue
        cc = ".".join(map(str, d.compute_capability)) if d.compute_capability else "?"
        out.append(f"  gpu{d.index}: {d.name} -> catalog {d.catalog_key or '(none: estimated)'}, "
                   f"{d.total_bytes / GIB:.2f} GiB, cc {cc}, {d.sm_count} SMs, driver {d.driver_version} "
                   f"(CUDA {d.cuda_driver_version}), torch built for CUDA {d.cuda_runtime}")
        out.append(f"        planner: {driver_problem(d) or 'driver accepted'}")
        out += [f"        estimated: {e}" for e in d.estimates]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0, help="the GPU measured in 3 and 4 (NVML's numbering)")
    ap.add_argument("--models", nargs="*", default=[m for m, _, _ in cal.MODELS], help="fixture folders")
    args = ap.parse_args()

    reading = read_nvml_gpus("check", "check")
    print("1. identity (the monitor's NVML reading)")
    if reading.error:
        sys.exit(f"  NVML: {reading.error}")
    print("\n".join(identity_lines(reading.devices)))

    import pynvml as nvml
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")
    print(f"\ntorch {torch.__version__}, CUDA {torch.version.cuda}")
    print("\n2. device order (CUDA_DEVICE_ORDER=PCI_BUS_ID)")
    table = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    problem = device_mismatch(planned_gpus(range(len(reading.devices))), table)
    print(f"  {problem or f'torch device i is NVML GPU i for all {len(table)} GPU(s)'}")

    print(f"\n3. the monitor against a torch allocation on GPU {args.device}")
    torch.cuda.set_device(args.device)
    before = nvml_used_bytes([args.device])[0]
    block = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    delta = nvml_used_bytes([args.device])[0] - before
    print(f"  2.00 GiB tensor: the monitor reads +{delta / GIB:.2f} GiB (the context, if this was the first "
          "CUDA call, is in it)")
    del block
    torch.cuda.empty_cache()

    print("\n4. gpu_calibrate")
    lengths = {m: (i, o) for m, i, o in cal.MODELS}
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(args.device)
        dc = cal.nvml_device(nvml, args.device)
        cal.measure_context(torch, nvml, handle, args.device)
        cal.measure_tracking(torch, nvml, handle)
        for m in args.models:
            profile, s, frame = cal.planned(m, *lengths.get(m, (1024, 256)), dc)
            cal.measure_model(torch, m, profile, s, frame, nvml.nvmlDeviceGetMemoryInfo(handle).free)
    finally:
        nvml.nvmlShutdown()


if __name__ == "__main__":
    main()
