"""What a node sample must be before the registry believes it. Pure: no Ray.

A monitor agent's sample decides how much memory the planner may hand out, so a forged or
broken one could make the hive reserve a terabyte on an 80 GB card. Samples are checked for
bounds, for naming only the node that sends them, and for no device listed twice; a pushed
sample also against what the node's own Ray monitor reports (``node_problems``).
"""

from __future__ import annotations

import math
import re

from hive_apps.control.registry.monitor import SIM_GPUS_LABEL
from hive_apps.core.devices import Device, DeviceKind, NodeSample, device_id
from hive_apps.core.drivers import VERSION

MAX_DEVICE_BYTES = 2**40  # 1 TiB: no accelerator today comes near it
MAX_HOST_BYTES = 64 * 2**40
MAX_DEVICES = 256
# printable ASCII, at most 64: a device's name is a metric label (``hive_gpu_memory_bytes{gpu=...}``)
DEVICE_NAME = re.compile(r"[ -~]{1,64}")
BYTES_TOLERANCE = 0.01  # what a pushed reading may differ from the Ray monitor's in total bytes


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
    if sample.cuda_runtime is not None and not VERSION.fullmatch(sample.cuda_runtime):
        problems.append("cuda_runtime must be a version such as 13.0")
    seen_ids, seen_indices, seen_uuids = set(), set(), set()  # type: set[object], set[object], set[object]
    for d in sample.devices:
        where = f"device {d.id!r}"
        if d.node_name != sample.node_name:
            problems.append(f"{where} names node {d.node_name!r}, but the sample is from {sample.node_name!r}")
        if d.id != device_id(sample.node_name, d.kind, d.index):
            problems.append(f"{where} should be {device_id(sample.node_name, d.kind, d.index)!r} "
                            f"for a {d.kind.value} with index {d.index} on {sample.node_name!r}")
        if not DEVICE_NAME.fullmatch(d.name):
            problems.append(f"{where}: the name must be 1 to 64 printable ASCII characters")
        if d.kind.is_gpu and not (d.index is not None and 0 <= d.index < MAX_DEVICES):
            problems.append(f"{where}: a GPU's index must be 0 to {MAX_DEVICES - 1}, got {d.index}")
        if not 0 <= d.used_bytes <= d.total_bytes <= (MAX_HOST_BYTES if d.kind.value == "cpu" else MAX_DEVICE_BYTES):
            problems.append(f"{where}: need 0 <= used ({d.used_bytes}) <= total ({d.total_bytes}) <= 1 TiB")
        for name in ("memory_bandwidth_gbps", "fp16_tflops", "fp8_tflops"):
            value = getattr(d, name, None)
            if value is not None and (not math.isfinite(value) or value < 0):
                problems.append(f"{where}: {name} must be a finite, non-negative number")
        for name in ("driver_version", "cuda_driver_version", "cuda_runtime"):  # the planner compares them
            text = getattr(d, name)
            if text is not None and not VERSION.fullmatch(text):
                problems.append(f"{where}: {name} must be a version such as 580.65.06 or 13.0")
        for seen, key, label in ((seen_ids, d.id, "id"), (seen_indices, (d.kind, d.index), "index"),
                                 (seen_uuids, d.uuid, "uuid")):
            if key is None:
                continue
            if key in seen:
                problems.append(f"{where}: {label} appears twice")
            seen.add(key)
    return problems


def _key(d: Device) -> str:
    return d.kind.value if d.index is None else f"{d.kind.value}{d.index}"


def _near(value: int, reference: int) -> bool:
    return abs(value - reference) <= BYTES_TOLERANCE * reference


def node_problems(pushed: NodeSample, own: NodeSample, labels: dict[str, str]) -> list[str]:
    """Every way a pushed sample disagrees with what the node's own Ray monitor reports (``own``,
    read by an actor on that node, and the node's Ray labels). A monitor token speaks for one node;
    these bounds keep it from lying about that node too.

    - The same devices: exactly the kinds and indices the Ray monitor reports, so an agent adds no
      GPU, hides none (an empty list included), and cannot relabel a real GPU ``sim-gpu`` (whose
      memory use the ledger takes from reservations, hiding foreign use). The hive places engines
      only on GPUs its Ray pod holds, and the manifests give that pod every GPU of its node, so the
      pod's indices are the host's; an agent that sees more GPUs than the pod is a setup the hive
      could not place on anyway.
    - ``sim-gpu`` only on a node labelled ``ray-hive/sim-gpus``.
    - Each device the Ray monitor could read: total bytes within 1 %, the same name (a bounded set
      of metric series), the same UUID and the same driver versions (the planner refuses a GPU by
      them). One it could not read is bounded by ``sample_problems``.
    - Host RAM (and a CPU device) not above the Ray monitor's by more than 1 %: an agent's own
      container may be capped lower, so less is fine; the registry keeps the Ray monitor's host
      figures either way.
    """
    problems = []
    node = pushed.node_name
    theirs, ours = {_key(d): d for d in pushed.devices}, {_key(d): d for d in own.devices}
    if theirs.keys() != ours.keys():
        said = ", ".join(sorted(theirs)) or "no devices"
        problems.append(f"devices: the sample lists {said}, but the Ray monitor on {node!r} reports "
                        f"{', '.join(sorted(ours)) or 'none'}; a pushed sample must list the same devices")
    if SIM_GPUS_LABEL not in labels and any(d.kind is DeviceKind.SIM_GPU for d in pushed.devices):
        problems.append(f"devices: sim-gpu on {node!r}, which has no {SIM_GPUS_LABEL} label")
    for key, d in theirs.items():
        mine = ours.get(key)
        if mine is None or mine.error is not None or mine.total_bytes <= 0:
            continue
        if d.kind is DeviceKind.CPU:
            if d.total_bytes > mine.total_bytes * (1 + BYTES_TOLERANCE):
                problems.append(f"{key}: total_bytes {d.total_bytes} is above the Ray monitor's {mine.total_bytes}")
            continue
        if not _near(d.total_bytes, mine.total_bytes):
            problems.append(f"{key}: total_bytes {d.total_bytes} differs from the Ray monitor's {mine.total_bytes} "
                            f"by more than {BYTES_TOLERANCE:.0%}")
        if d.name != mine.name:
            problems.append(f"{key}: named {d.name!r}, but the Ray monitor reads {mine.name!r}")
        if mine.uuid is not None and d.uuid != mine.uuid:
            problems.append(f"{key}: uuid {d.uuid!r} is not the Ray monitor's {mine.uuid!r}")
        for name in ("driver_version", "cuda_driver_version"):  # one driver per host: the planner trusts it
            if getattr(mine, name) is not None and getattr(d, name) != getattr(mine, name):
                problems.append(f"{key}: {name} {getattr(d, name)!r} is not the Ray monitor's {getattr(mine, name)!r}")
    if own.host_total_bytes > 0 and pushed.host_total_bytes > own.host_total_bytes * (1 + BYTES_TOLERANCE):
        problems.append(f"host memory: host_total_bytes {pushed.host_total_bytes} is above the Ray monitor's "
                        f"{own.host_total_bytes} on {node!r}")
    return problems
