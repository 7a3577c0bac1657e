"""Hold the registry's start lock of a replica's devices while its engine starts, sleeps or wakes.

On a real GPU the lock is kept until NVML shows the new engine's memory, so the next
engine's device-wide profile sees a settled device (``core/state/locks.py`` says why). A sleep or
wake in place frees or takes back gigabytes on the same devices, so it takes the lock too: a
starting neighbour's NVML delta (its measured footprint, its profile) never absorbs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from hive_apps.control.cluster import get_cluster
from hive_apps.control.registry.monitor import nvml_used_bytes
from hive_apps.core import names
from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.types import ReplicaPlan

log = logging.getLogger("ray.serve")

POLL_S = 0.5
VISIBLE_SHARE = 0.5  # the engine's NVML usage must reach half its planned footprint
VISIBLE_TIMEOUT_S = 30.0


class StartReport:
    """Filled in while the lock is held: what the new engine really allocated per device."""

    measured_bytes: int | None = None


async def _acquire(registry, devices: list[str], holder: str, hold_s: float) -> None:
    """``hold_s``: the longest the registry keeps the lock for this holder (HIVE_DEPLOY_TIMEOUT_S)."""
    waited = time.monotonic()
    while not await registry.acquire_start_lock.remote(devices, holder, hold_s):
        await asyncio.sleep(POLL_S)
    waited = time.monotonic() - waited
    if waited > POLL_S:
        log.info("%s waited %.1fs for the start lock of %s", holder, waited, devices)


@asynccontextmanager
async def device_lock(model_id: str, replica: ReplicaPlan, what: str, hold_s: float):
    """The start lock for an in-place ``what`` (sleep, wake) of a running replica: no NVML wait,
    vLLM's sleep and wake return once the memory is freed or taken. Its own holder name, so its
    release never frees a start's lock. ``hold_s``: HIVE_DEPLOY_TIMEOUT_S."""
    registry = get_cluster().app_handle(names.REGISTRY_APP)
    holder = f"{names.replica_key(model_id, replica.index)}/{what}"
    await _acquire(registry, replica.devices, holder, hold_s)
    try:
        yield
    finally:
        await registry.release_start_lock.remote(holder)


@asynccontextmanager
async def start_lock(model_id: str, replica: ReplicaPlan, hold_s: float):
    """The start lock of the replica's devices while its engine starts. ``hold_s``: HIVE_DEPLOY_TIMEOUT_S,
    after which the registry frees a lock whose holder never released it."""
    registry = get_cluster().app_handle(names.REGISTRY_APP)
    holder = names.replica_key(model_id, replica.index)
    await _acquire(registry, replica.devices, holder, hold_s)
    gpu = replica.device_kind is DeviceKind.GPU
    before = nvml_used_bytes(replica.device_indices) if gpu else []
    report = StartReport()
    try:
        yield report
        if gpu:
            report.measured_bytes = await _wait_until_visible(replica, before)
        if report.measured_bytes is not None:
            await registry.report_usage.remote(holder, report.measured_bytes)
    finally:
        await registry.release_start_lock.remote(holder)


async def _wait_until_visible(replica: ReplicaPlan, before: list[int]) -> int:
    """Wait until NVML shows the engine's memory; return what it added on its busiest device."""
    expected = VISIBLE_SHARE * replica.reservation_bytes
    deadline = time.monotonic() + VISIBLE_TIMEOUT_S
    while True:
        added = [n - b for n, b in zip(nvml_used_bytes(replica.device_indices), before)]
        if all(a >= expected for a in added) or time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL_S)
    if not all(a >= expected for a in added):
        log.warning("memory of %s not visible in NVML after %.0fs; releasing the start lock anyway",
                    replica.devices, VISIBLE_TIMEOUT_S)
    return max(added)
