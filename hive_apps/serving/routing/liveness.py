"""Which replicas take requests: the one definition of a live replica, and the load poll that keeps it.

A replica is live when its model's record still routes to it (``live_plan``: its replica set
holds only those) and its last load poll answered (or was late only once: a busy engine's
answer may come after LOAD_TIMEOUT_S) with no request failing on it since
(``is_live``; a new set presumes its replicas live until its first poll). Replica choice, the
queue bound and splitting (``policy.py``, ``split.py``) and the failover (``replica_set.py``)
all ask ``is_live``; only the poll (``LoadPoll``) and ``mark_failed`` change the answer.

Pure: no Ray (the poll asks each replica through ``_poll_one``, which a replica set gives).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Self

from hive_apps.core import names
from hive_apps.core.planning.types import Plan
from hive_apps.core.state.records import ModelRecord
from hive_apps.serving.engine.protocol import EngineLoad

if TYPE_CHECKING:  # policy.py asks is_live: a runtime import back would be a cycle
    from hive_apps.serving.routing.policy import ReplicaView

LOAD_POLL_S = 0.25
# Nothing sent for IDLE_AFTER_S and nothing in flight: poll every IDLE_POLL_S only (health and
# other routers' load), and poll at once when the next request comes. Each poll costs both
# processes CPU on the cores the engines use (benchmarks/bench_vs_vllm.py, idle CPU by process).
IDLE_AFTER_S = 2.0
IDLE_POLL_S = 2.0


def live_plan(rec: ModelRecord) -> Plan:
    """The replicas requests may go to: not the ones lost with their node, not the ones still
    starting (a replacement, or one added for load: its deployment may not exist yet), not
    the ones being drained for removal."""
    return rec.plan.model_copy(update={"replicas": [
        rp for rp in rec.plan.replicas
        if names.replica_label(rp.index) not in rec.lost_replicas
        and rp.index not in rec.retiring and rp.index not in rec.healing_replicas]})


def is_live(view: ReplicaView) -> bool:
    """Whether a replica of a set may be sent a request now."""
    return view.healthy


def mark_failed(view: ReplicaView) -> None:
    """A request failed on the replica before it answered: not live until the next poll says otherwise."""
    view.healthy = False


class LoadPoll(ABC):
    """A replica set's live view: each replica's load every LOAD_POLL_S (IDLE_POLL_S while idle)."""

    def __init__(self, views: dict[int, ReplicaView]):
        self.views = views
        self.loads: dict[int, EngineLoad] = {}  # the last load each replica reported
        self.on_refresh: Callable[[Self], None] | None = None  # after each load poll (the router's metrics)
        self._poller: asyncio.Task[None] | None = None
        self._used_at = 0.0  # monotonic time of the last request
        self._asking: asyncio.Task[None] | None = None  # a poll that requests finding no live replica wait on
        self._wake = asyncio.Event()

    @abstractmethod
    async def _poll_one(self, i: int) -> EngineLoad:
        """Replica ``i``'s load now; raises when it does not answer."""

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_load())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll_load(self) -> None:
        while True:
            await self._refresh()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S if self._idle() else LOAD_POLL_S)

    async def _refresh(self: Self) -> None:
        """Ask every replica for its load now."""
        indices = list(self.views)
        asked_at = time.monotonic()
        results = await asyncio.gather(*(self._poll_one(i) for i in indices), return_exceptions=True)
        for i, res in zip(indices, results):
            view = self.views[i]
            if isinstance(res, EngineLoad):
                view.engine_running, view.engine_waiting, view.healthy = res.running, res.waiting, True
                view.late = False
                view.edge_sent = [t for t in view.edge_sent if t > asked_at]  # the engine counted the rest
                view.adapters = frozenset(res.adapters)
                self.loads[i] = res
            elif isinstance(res, TimeoutError) and view.healthy and not view.late:
                view.late = True  # a busy engine (a long prefill on few cores) answers late now and then
            else:
                view.healthy = False  # refused, or late twice in a row: a dead or hung replica
        if self.on_refresh is not None:
            self.on_refresh(self)

    async def _any_live(self) -> bool:
        """Whether some replica is live; if none is, ask again before giving up: a view is at most
        one poll old, and a replica that just came up was down at the last poll. Requests that
        arrive together share one such poll."""
        if not any(is_live(v) for v in self.views.values()):
            if self._asking is None or self._asking.done():
                self._asking = asyncio.get_running_loop().create_task(self._refresh())
            await asyncio.shield(self._asking)
        return any(is_live(v) for v in self.views.values())

    def _idle(self) -> bool:
        return time.monotonic() - self._used_at > IDLE_AFTER_S and not any(v.in_flight for v in self.views.values())

    def _touch(self) -> None:
        """A request arrived: back to polling every LOAD_POLL_S, starting now if the set was idle."""
        if self._idle():
            self._wake.set()
        self._used_at = time.monotonic()
