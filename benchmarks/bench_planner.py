"""How long planning takes: one model over 1000 simulated GPUs, and 100 models over a small cluster.

Run:  python benchmarks/bench_planner.py

Pure Python, no Ray, no vLLM engine. Profiles are loaded once (reported separately: the
first one pays for importing transformers); the timed part is ``plan_deployment``.
Target: under 50 ms for one model over 1000 GPUs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hive_apps.core.catalog import GIB, GPU_CATALOG  # noqa: E402
from hive_apps.core.devices import Device, DeviceKind  # noqa: E402
from hive_apps.core.planning.planner import plan_deployment  # noqa: E402
from hive_apps.core.planning.profile import load_profile  # noqa: E402
from hive_apps.core.planning.types import DeviceCapacity, PlanningError  # noqa: E402
from hive_apps.core.spec import ModelSpec  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "model_configs")
BUDGET = 0.90


def sim_gpu(key: str, node: str, index: int, used_gib: float = 0.0, replicas: int = 0) -> DeviceCapacity:
    g = GPU_CATALOG[key]
    used = int(used_gib * GIB)
    device = Device(id=f"{node}:gpu{index}", node_id=f"id-{node}", node_name=node, kind=DeviceKind.SIM_GPU,
                    index=index, name=g.name, total_bytes=g.memory_bytes, used_bytes=used,
                    compute_capability=g.compute_capability, sm_count=g.sm_count,
                    memory_bandwidth_gbps=g.memory_bandwidth_gbps, tdp_w=g.tdp_w, fp16_tflops=g.fp16_tflops)
    return DeviceCapacity(device=device, available_bytes=max(0, int(BUDGET * g.memory_bytes) - used),
                          free_bytes=g.memory_bytes - used, hive_replicas=[f"other/r{k}" for k in range(replicas)])


def big_cluster(nodes: int = 125, per_node: int = 8) -> list[DeviceCapacity]:
    """1000 GPUs: node n holds 8 cards of catalog type n mod 12, some of them partly used."""
    keys = list(GPU_CATALOG)
    devices = []
    for n in range(nodes):
        key = keys[n % len(keys)]
        for i in range(per_node):
            busy = (n * per_node + i) % 5 == 0  # every fifth card already hosts something
            devices.append(sim_gpu(key, f"node{n:03d}", i, used_gib=6.0 if busy else 0.0, replicas=int(busy)))
    return devices


def small_cluster() -> list[DeviceCapacity]:
    layout = [("H100-80GB", 4), ("A100-80GB", 2), ("L40S", 2), ("L4", 4)]
    return [sim_gpu(key, f"small{n}", i) for n, (key, count) in enumerate(layout) for i in range(count)]


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    t0 = time.perf_counter()
    names = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
    profiles = {}
    for name in names:
        try:
            profiles[name] = load_profile(os.path.join(FIXTURES, name), {})
        except PlanningError as exc:
            print(f"skip {name}: {exc.message}")
    load_s = time.perf_counter() - t0

    rows = []
    cluster = big_cluster()
    for label, name, fields in [
        ("Qwen3-8B, replicas=1", "Qwen__Qwen3-8B", {}),
        ("Qwen3-8B, replicas=8", "Qwen__Qwen3-8B", {"replicas": 8}),
        ("Qwen3-8B, replicas=-1 (every GPU)", "Qwen__Qwen3-8B", {"replicas": -1}),
        ("Llama-3.1-70B, TP escalation", "meta-llama__Llama-3.1-70B", {}),
    ]:
        spec = ModelSpec(model_id="bench", model=os.path.join(FIXTURES, name), engine="sim", **fields)
        seconds, plan = timed(lambda spec=spec, name=name: plan_deployment(spec, cluster, profiles[name]), repeat=7)
        tp = plan.replicas[0].settings.tensor_parallel_size
        rows.append((f"{label} over {len(cluster)} GPUs", f"{seconds * 1000:.1f} ms",
                     f"{len(plan.replicas)} replicas (tp={tp}), {len(plan.rejected)} rejected"))

    small = small_cluster()
    cycled = [names[i % len(names)] for i in range(100)]

    def plan_100() -> int:
        ok = 0
        for i, name in enumerate(cycled):
            if name not in profiles:
                continue
            spec = ModelSpec(model_id=f"m{i}", model=os.path.join(FIXTURES, name), engine="sim")
            try:
                plan_deployment(spec, small, profiles[name])
                ok += 1
            except PlanningError:
                pass  # e.g. a 671B model on a 12-GPU cluster
        return ok

    seconds, ok = timed(plan_100, repeat=3)
    rows.append((f"100 models ({len(names)} fixtures cycled) over {len(small)} GPUs", f"{seconds * 1000:.1f} ms",
                 f"{ok} planned, {100 - ok} do not fit ({seconds * 10:.2f} ms per model)"))

    header = ("case", "plan time (median)", "result")
    width = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    print(f"profiles: {len(profiles)} fixture configs loaded in {load_s:.2f} s (transformers import included)\n")
    print("  ".join(h.ljust(w) for h, w in zip(header, width)))
    print("  ".join("-" * w for w in width))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    target = float(rows[0][1].split()[0])
    print(f"\ntarget: one model over 1000 GPUs < 50 ms -> {'OK' if target < 50 else 'MISSED'} ({target:.1f} ms)")
    print("command: python benchmarks/bench_planner.py")


if __name__ == "__main__":
    main()
