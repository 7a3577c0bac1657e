"""Planning test helpers: DeviceCapacity from the GPU catalog, fixture profiles, a KV hook (no Ray)."""

from __future__ import annotations

from hive_apps.core.catalog import GIB, lookup
from hive_apps.core.devices import Device, DeviceKind
from hive_apps.core.planning.types import DeviceCapacity

BUDGET = 0.90  # what a registry typically lets the hive fill


def gpu(key: str, node: str = "n1", index: int = 0, *, kind: DeviceKind = DeviceKind.GPU,
        used_gib: float = 0.0, available: int | None = None, free: int | None = None,
        hive_replicas: list[str] | None = None) -> DeviceCapacity:
    g = lookup(key)
    used = int(used_gib * GIB)
    device = Device(
        id=f"{node}:gpu{index}", node_id=f"id-{node}", node_name=node, kind=kind, index=index,
        name=g.name, total_bytes=g.memory_bytes, used_bytes=used,
        compute_capability=g.compute_capability, sm_count=g.sm_count,
        memory_bandwidth_gbps=g.memory_bandwidth_gbps, tdp_w=g.tdp_w, fp16_tflops=g.fp16_tflops,
    )
    if free is None:
        free = g.memory_bytes - used
    if available is None:
        available = max(0, int(BUDGET * g.memory_bytes) - used)
    return DeviceCapacity(device=device, available_bytes=available, free_bytes=free,
                          hive_replicas=list(hive_replicas or []))


def cpu(node: str = "c1", total_gib: float = 64, cores: int = 16, *, used_gib: float = 0.0,
        hive_replicas: list[str] | None = None) -> DeviceCapacity:
    total = int(total_gib * GIB)
    used = int(used_gib * GIB)
    device = Device(id=f"{node}:cpu", node_id=f"id-{node}", node_name=node, kind=DeviceKind.CPU,
                    name="CPU", total_bytes=total, used_bytes=used, cpu_count=cores)
    return DeviceCapacity(device=device, available_bytes=max(0, int(BUDGET * total) - used),
                          free_bytes=total - used, hive_replicas=list(hive_replicas or []))


# ---- model profiles from the fixture configs ---------------------------------------------

import functools  # noqa: E402
import os  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "model_configs")


def fixture_path(name: str) -> str:
    return os.path.abspath(os.path.join(FIXTURES, name))


@functools.cache
def _cached_profile(name: str, frozen_kwargs: tuple):
    from hive_apps.core.planning.profile import load_profile

    return load_profile(fixture_path(name), dict(frozen_kwargs))


class _Frozen(dict):
    """A dict value of vllm_kwargs made hashable for the profile cache (still a dict to the planner)."""

    def __hash__(self):
        return hash(repr(sorted(self.items(), key=repr)))


def profile(name: str, **vllm_kwargs):
    """The profile of a fixture model (cached: transformers is slow only the first time)."""
    frozen = {k: _Frozen(v) if isinstance(v, dict) else v for k, v in vllm_kwargs.items()}
    return _cached_profile(name, tuple(sorted(frozen.items())))


class DoubleKV:
    """A ``hive_attention_cls`` for the tests: twice the family's KV per token (mixed in front of it)."""

    def kv_bytes_per_token(self, tensor_parallel_size: int) -> int:
        return 2 * super().kv_bytes_per_token(tensor_parallel_size)


class FixedImageTokens:
    """A ``hive_attention_cls`` that only overrides the multimodal math: 1000 tokens per image."""

    def mm_max_tokens_per_item(self, mm_processor_kwargs: dict) -> dict:
        return {"image": int(mm_processor_kwargs.get("tokens_per_image", 1000))}


class KvAndImageHook(DoubleKV, FixedImageTokens):
    """Both overrides: twice the KV per token and 1000 (or mm_processor_kwargs.tokens_per_image) per image."""


# ---- user placement policies (vllm_kwargs["hive_placement_policy"]) -----------------------


class MostFreeMemory:
    """Prefer the device with the most room left (available bytes), whatever its speed."""

    def rank(self, candidates, profile):
        return sorted(candidates, key=lambda dc: -dc.available_bytes)


class PreferNodeB:
    """Devices on node "b" first, then the rest in the order given."""

    def rank(self, candidates, profile):
        return sorted(candidates, key=lambda dc: dc.device.node_name != "b")


class OnlyNodeA:
    """Leaves out every device not on node "a"."""

    def rank(self, candidates, profile):
        return [dc for dc in candidates if dc.device.node_name == "a"]


class NoRank:
    """A class without rank(): refused."""


class NeedsArgs:
    def __init__(self, weight):
        self.weight = weight

    def rank(self, candidates, profile):
        return candidates


class ReturnsStrangers:
    """rank() returns a device that is not a candidate: refused."""

    def rank(self, candidates, profile):
        return [gpu("T4", "zz", 9)]


class OldStyleKvHook:
    """The hook form before families: built as Class(profile). Refused with a message saying what changed."""

    def __init__(self, profile):
        self.base = profile.kv_bytes_per_token(1)

    def kv_bytes_per_token(self, tensor_parallel_size: int) -> int:
        return 2 * self.base
