"""Durable key-value state in Ray's GCS (internal KV, through the cluster seam).

Writes go through one thread in order, so a newer record is never overwritten by an older
one, and each has a deadline, so the registry's event loop never waits on the GCS. The KV has
no multi-key transaction: what must change together is kept under one key (a model's record
and its reservations, ``records.dump_stored``), so one ``kv_put`` changes all of it or nothing.
A stored value that no longer parses (corrupt, or written by another schema version) is
moved aside under ``quarantine/`` with a warning instead of stopping the registry; what
parsing means is the caller's (a model record is read without today's policy validators).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from hive_apps.control.cluster import Cluster

T = TypeVar("T")
log = logging.getLogger("ray.serve")

QUARANTINE = "quarantine/"


class StateStore:
    def __init__(self, cluster: Cluster, namespace: str, timeout_s: float = 10.0):
        self.cluster = cluster
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hive-kv")

    async def write(self, puts: dict[str, BaseModel | bytes], deletes: Sequence[str] = ()) -> None:
        """Queue every write (puts first, then deletes) before waiting on any, so writes land in order.
        Each key lands on its own: a crash may cut a call between two of them."""
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._writer, self.cluster.kv_put, self.namespace, k,
                                        v if isinstance(v, bytes) else v.model_dump_json().encode())
                   for k, v in puts.items()]
        futures += [loop.run_in_executor(self._writer, self.cluster.kv_delete, self.namespace, k) for k in deletes]
        if futures:
            await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s)

    async def load_all_async(self, prefix: str, parse: Callable[[bytes], T]) -> list[T]:
        """``load_all`` off the event loop, with the store's deadline."""
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self._writer, self.load_all, prefix, parse), self.timeout_s * 6)

    def load_all(self, prefix: str, parse: Callable[[bytes], T]) -> list[T]:
        """Every stored value under ``prefix`` that ``parse`` reads (blocking)."""
        out = []
        for key in self.cluster.kv_keys(self.namespace, prefix):
            raw = self.cluster.kv_get(self.namespace, key)
            if raw is None:
                continue
            try:
                out.append(parse(raw))
            except (ValidationError, ValueError) as e:
                log.warning("quarantined stored %s: it does not parse (%s)", key, str(e).splitlines()[0])
                self.cluster.kv_put(self.namespace, QUARANTINE + key, raw)
                self.cluster.kv_delete(self.namespace, key)
        return out
