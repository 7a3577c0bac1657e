"""What a node sample must be before the registry believes it. Pure: no Ray.

A monitor agent's sample decides how much memory the planner may hand out, so a forged or
broken one could make the hive reserve a terabyte on an 80 GB card. Samples are checked for
bounds, for naming only the node that sends them, and for no device listed twice.
"""

from __future__ import annotations

import math

from hive_apps.registry.devices import NodeSample, device_id

MAX_DEVICE_BYTES = 2**40  # 1 TiB: no accelerator today comes near it
MAX_HOST_BYTES = 64 * 2**40
MAX_DEVICES = 256


def sample_problems(sample: NodeSample) -> list[str]:
    """Every reason to refuse this sample (empty: it may be used)."""
    problems = []
    if not 0 <= sample.host_used_bytes <= sample.host_total_bytes <= MAX_HOST_BYTES:
        problems.append(f"host memory: need 0 <= used ({sample.host_used_bytes}) <= total "
                        f"({sample.host_total_bytes}) <= {MAX_HOST_BYTES}")
    if sample.cpu_count < 1:
        problems.append(f"cpu_count must be >= 1, got {sample.cpu_count}")
    if len(sample.devices) > MAX_DEVICES:
        problems.append(f"{len(sample.devices)} devices; at most {MAX_DEVICES} per node")
    seen_ids, seen_indices, seen_uuids = set(), set(), set()
    for d in sample.devices:
        where = f"device {d.id!r}"
        if d.node_name != sample.node_name:
            problems.append(f"{where} names node {d.node_name!r}, but the sample is from {sample.node_name!r}")
        if d.id != device_id(sample.node_name, d.kind, d.index):
            problems.append(f"{where} should be {device_id(sample.node_name, d.kind, d.index)!r} "
                            f"for a {d.kind.value} with index {d.index} on {sample.node_name!r}")
        if not 0 <= d.used_bytes <= d.total_bytes <= (MAX_HOST_BYTES if d.kind.value == "cpu" else MAX_DEVICE_BYTES):
            problems.append(f"{where}: need 0 <= used ({d.used_bytes}) <= total ({d.total_bytes}) <= 1 TiB")
        for name in ("memory_bandwidth_gbps", "fp16_tflops", "fp8_tflops"):
            value = getattr(d, name, None)
            if value is not None and (not math.isfinite(value) or value < 0):
                problems.append(f"{where}: {name} must be a finite, non-negative number")
        for seen, key, label in ((seen_ids, d.id, "id"), (seen_indices, (d.kind, d.index), "index"),
                                 (seen_uuids, d.uuid, "uuid")):
            if key is None:
                continue
            if key in seen:
                problems.append(f"{where}: {label} appears twice")
            seen.add(key)
    return problems
