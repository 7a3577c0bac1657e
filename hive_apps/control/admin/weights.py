"""The admin's view of every node's weight cache: room before a deploy, pre-fetch, listing, removal.

Each node's cache is its own (``hive_apps/core/weights/fetcher.py`` in a per-node actor); this class
asks the nodes and puts their answers together. Nothing here knows a path on another node.
"""

from __future__ import annotations

import asyncio
import logging

from pydantic import BaseModel, Field

from hive_apps.control.cluster import Cluster, NodeInfo, off_loop
from hive_apps.control.registry.monitor import node_name_of
from hive_apps.core.planning.types import Plan
from hive_apps.core.weights.cache import format_bytes
from hive_apps.core.weights.types import CacheDisk, CachedWeights, FetchProgress, FetchState, Manifest, SourceKind

log = logging.getLogger("ray.serve")

CALL_TIMEOUT_S = 30.0


class PrefetchRequest(BaseModel):
    """Body of ``POST /admin/weights``."""

    model: str = Field(description="A source as a deploy names it: org/name[@revision], s3://bucket/prefix.")
    nodes: list[str] | None = Field(None, description="Node names (GET /admin/nodes); null = every node with a GPU.")


class NodeWeights(BaseModel):
    """One node's cache in ``GET /admin/weights``."""

    disk: CacheDisk | None = None
    weights: list[CachedWeights] = []
    error: str = ""  # the node did not answer


class NodeCaches:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    async def _call(self, node_id: str, method: str, *args):
        return await off_loop(self.cluster.fetcher_call, node_id, method, *args, timeout=CALL_TIMEOUT_S)

    async def alive(self) -> dict[str, NodeInfo]:
        """Node name -> node, for the nodes that are up."""
        return {node_name_of(n.node_id, n.labels): n for n in await off_loop(self.cluster.nodes) if n.alive}

    async def room_problems(self, plan: Plan, in_use: set[str]) -> list[str]:
        """Why the plan's nodes cannot take its weights (empty: they can): a folder a node lacks, or
        a cache that is short even after evicting what no model uses. Checked before anything is booked."""
        manifest = plan.weights
        if manifest is None:
            return []
        nodes = {rp.node_id: rp.node_name for rp in plan.replicas}
        problems = await asyncio.gather(*(self._room_on(node_id, name, manifest, in_use)
                                          for node_id, name in nodes.items()))
        return [p for p in problems if p]

    async def _room_on(self, node_id: str, name: str, manifest: Manifest, in_use: set[str]) -> str:
        if manifest.source.kind is SourceKind.LOCAL:  # nothing to fetch: the folder must be there
            progress: FetchProgress = await self._call(node_id, "ensure", manifest, in_use)
            return "" if progress.state is FetchState.READY else f"{name}: {progress.error}"
        disk: CacheDisk = await self._call(node_id, "disk")
        entries: list[CachedWeights] = await self._call(node_id, "entries", in_use)
        have = next((e for e in entries if e.key == manifest.key), None)
        if have is not None and have.complete:
            return ""
        need = manifest.total_bytes - (have.bytes if have else 0)
        evictable = sum(e.bytes for e in entries if e.complete and not e.in_use and e.key != manifest.key)
        if need <= disk.free_bytes + evictable:
            return ""
        return (f"{name} needs {format_bytes(need - disk.free_bytes - evictable)} more disk for {manifest.source} "
                f"({format_bytes(need)} to fetch, {format_bytes(disk.free_bytes)} free in {disk.root}, {format_bytes(evictable)} of unused "
                "cached weights it could evict)")

    async def prefetch(self, manifest: Manifest, node_ids: list[str], in_use: set[str]) -> dict[str, FetchProgress]:
        names = {n.node_id: name for name, n in (await self.alive()).items()}
        progress = await asyncio.gather(*(self._call(i, "ensure", manifest, in_use) for i in node_ids))
        return {names.get(i, i): p for i, p in zip(node_ids, progress)}

    async def listing(self, in_use: set[str]) -> dict[str, NodeWeights]:
        nodes = await self.alive()

        async def one(node: NodeInfo) -> NodeWeights:
            try:
                return NodeWeights(disk=await self._call(node.node_id, "disk"),
                                   weights=await self._call(node.node_id, "entries", in_use))
            except Exception as e:  # a node whose fetcher cannot start (e.g. going away) is listed as such
                return NodeWeights(error=f"{type(e).__name__}: {e}"[:300])

        answers = await asyncio.gather(*(one(n) for n in nodes.values()))
        return dict(zip(nodes, answers))

    async def disks(self) -> dict[str, dict | None]:
        """Node name -> its cache disk (``GET /admin/nodes``), None where the node did not answer."""
        nodes = await self.alive()

        async def one(node: NodeInfo) -> dict | None:
            try:
                return (await self._call(node.node_id, "disk")).model_dump()
            except Exception:  # a node whose fetcher cannot start (e.g. going away) shows no disk
                return None

        return dict(zip(nodes, await asyncio.gather(*(one(n) for n in nodes.values()))))

    async def remove(self, key: str, node_ids: list[str], in_use: set[str]) -> list[str]:
        """Remove one cached revision from these nodes; the node names it was removed from."""
        names = {n.node_id: name for name, n in (await self.alive()).items()}
        removed = await asyncio.gather(*(self._call(i, "remove", key, in_use) for i in node_ids))
        return [names.get(i, i) for i, ok in zip(node_ids, removed) if ok]
