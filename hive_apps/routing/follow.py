"""Routing state that follows the registry: long-poll its model records, keep replica sets.

The gateway (every model) and each model's router (its own model) learn of a model that
became ready, a replica that was lost or moved, or a model that went away as soon as the
registry records it (``Registry.watch``), not on a timer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hive_apps import names
from hive_apps.cluster import get_cluster
from hive_apps.planning.types import Plan, ReplicaPlan
from hive_apps.registry.records import ModelRecord
from hive_apps.routing.replica_set import ReplicaSet, default_queue_bound

log = logging.getLogger("ray.serve")

WATCH_S = 30.0
RETRY_S = 0.5
# The longest a request that reaches a just-started gateway or router waits for the registry's
# first answer (usually milliseconds): before it, neither can tell which models exist or their state.
FIRST_VIEW_TIMEOUT_S = 10.0


def live_plan(rec: ModelRecord) -> Plan:
    """The replicas requests may go to: not the ones lost with their node, not the ones still
    starting (a replacement, or one added for load: its deployment may not exist yet), not
    the ones being drained for removal."""
    return rec.plan.model_copy(update={"replicas": [
        rp for rp in rec.plan.replicas
        if names.replica_label(rp.index) not in rec.lost_replicas
        and rp.index not in rec.retiring and rp.index not in rec.healing_replicas]})


def replica_fingerprint(replicas: list[ReplicaPlan]) -> tuple:
    """What identifies the engines a plan runs: changed engines need new handles."""
    return tuple((rp.index, rp.node_id, tuple(rp.device_indices)) for rp in replicas)


def model_object(rec: ModelRecord) -> dict:
    """A model as OpenAI's ``GET /v1/models`` lists it."""
    return {"id": rec.model_id, "object": "model", "created": int(rec.created_at), "owned_by": "ray-hive",
            "max_model_len": rec.plan.replicas[0].settings.max_model_len if rec.plan.replicas else None}


class ModelReplicas:
    """One ``ReplicaSet`` per serving model, rebuilt when its live replicas change."""

    def __init__(self) -> None:
        self._sets: dict[str, tuple[tuple, ReplicaSet]] = {}

    def keep_only(self, model_ids: set[str]) -> None:
        for gone in set(self._sets) - model_ids:
            self._sets.pop(gone)[1].close()

    def of(self, rec: ModelRecord) -> ReplicaSet:
        live = live_plan(rec)
        fingerprint = replica_fingerprint(live.replicas)
        known = self._sets.get(rec.model_id)
        if known is None or known[0] != fingerprint:
            if known is not None:
                known[1].close()
            replicas = ReplicaSet.of_app(rec.model_id, live, default_queue_bound(rec.plan, rec.spec.max_queued_requests))
            replicas.start()
            self._sets[rec.model_id] = (fingerprint, replicas)
        return self._sets[rec.model_id][1]

    def adopt(self, model_id: str, plans: list[ReplicaPlan], replicas: ReplicaSet) -> None:
        """Start from a replica set made elsewhere (a router's, from its bound handles)."""
        self._sets[model_id] = (replica_fingerprint(plans), replicas)


async def follow_registry(on_models: Callable[[list[ModelRecord]], None]) -> None:
    """Call ``on_models`` with every record each time the registry's book changes."""
    registry = get_cluster().app_handle(names.REGISTRY_APP)
    after = -1
    while True:
        try:
            view = await registry.watch.remote(after, WATCH_S)
            if view.version != after:
                after = view.version
                on_models(view.models)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the registry is restarting: ask again shortly
            log.warning("following the registry failed: %s", e)
            await asyncio.sleep(RETRY_S)
