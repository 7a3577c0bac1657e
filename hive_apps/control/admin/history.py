"""The admin's history loop: every ``HISTORY_TICK_S`` it reads each model's load (the engines' own
``load()``, as ``GET /admin/load`` does: running, waiting, and the cumulative counters of requests,
tokens and time to first token, per replica) and each device's memory from the registry, folds them
into ``core/history.py``'s one-minute points (requests/s, tokens/s, p50 TTFT), and stores them in
the KV once a minute, so a new admin (a restart, a redeploy) takes the last hour and a half over
instead of starting blank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hive_apps.control.admin.lifecycle import Lifecycle
from hive_apps.control.cluster import Cluster, ControlPlane
from hive_apps.core.history import MINUTE_S, History, Totals, WakePoint
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.ledger import DeviceState
from hive_apps.core.state.records import ENDED, SERVING, ModelRecord, ModelStatus

log = logging.getLogger("ray.serve")

HISTORY_TICK_S = 10.0
HISTORY_KEY = "admin-history"  # beside the registry's model/ keys, in the same namespace


class HistoryKeeper(ControlPlane):
    def __init__(self, cluster: Cluster, settings: HiveSettings, lifecycle: Lifecycle,
                 clock: Callable[[], float] = time.time, tick_s: float = HISTORY_TICK_S):
        self.cluster, self.settings, self.lifecycle, self.clock, self.tick_s = cluster, settings, lifecycle, clock, tick_s
        self.history: History | None = None  # read back from the KV by the loop's first turn
        self._stored_minute = 0.0

    def view(self) -> dict[str, Any]:
        now = self.clock()
        return (self.history or History(since=now)).view(now)

    async def run(self) -> None:
        while True:
            try:
                if self.history is None:
                    async with asyncio.timeout(self.settings.kv_timeout_s):  # (wait_for may swallow a cancel)
                        raw = await asyncio.to_thread(self.cluster.kv_get, self.settings.state_namespace, HISTORY_KEY)
                    self.history = History.resume(raw, self.clock())
                    self._stored_minute = self.clock() // MINUTE_S
                await self.sample()
                if self.clock() // MINUTE_S != self._stored_minute:
                    await self.store()
            except Exception as e:  # e.g. the registry is restarting: this minute's point stays thinner
                log.warning("keeping the history failed: %s", e)
            await asyncio.sleep(self.tick_s)

    async def sample(self) -> None:
        """One reading of every model and device."""
        assert self.history is not None
        records: list[ModelRecord] = [r for r in await self.registry.list_models.remote()
                                      if r.status not in ENDED and r.status is not ModelStatus.DELETING]
        serving = [r for r in records if r.status in SERVING and r.resident]
        loads = await asyncio.gather(*(self.lifecycle.replica_loads(r) for r in serving))
        states: list[DeviceState] = await self.registry.device_states.remote()
        now, h = self.clock(), self.history
        for rec, ld in zip(serving, loads):
            totals = {replica: Totals(requests=r.requests_total, prompt_tokens=r.prompt_tokens_total,
                                      generation_tokens=r.generation_tokens_total, ttft_buckets=r.ttft.buckets,
                                      ttft_count=r.ttft.count, ttft_sum_s=r.ttft.sum_s) for replica, r in ld.items()}
            h.model(rec.model_id, now, totals=totals,  # none answered this time: their reads are kept for the next
                    running=sum(r.running for r in ld.values()), waiting=sum(r.waiting for r in ld.values()),
                    capacity=sum(r.capacity for r in ld.values()))
        for rec in records:
            if rec.model_id not in {r.model_id for r in serving}:
                h.model(rec.model_id, now, resident=rec.resident and rec.status in SERVING)
            if rec.last_wake is not None:
                w = rec.last_wake
                h.wake(rec.model_id, WakePoint(at=w.ready_at, how=w.how.value, total_s=w.total_s, placement_s=w.placement_s,
                                               engine_start_s=w.engine_start_s, warm_up_s=w.warm_up_s))
        for s in states:
            h.device(s.device.id, now, s.total_bytes, s.reserved_bytes, s.used_bytes, s.dormant_bytes)

    async def store(self) -> None:
        assert self.history is not None
        self.history.trim(self.clock())
        self._stored_minute = self.clock() // MINUTE_S
        async with asyncio.timeout(self.settings.kv_timeout_s):
            await asyncio.to_thread(self.cluster.kv_put, self.settings.state_namespace, HISTORY_KEY, self.history.dump())
