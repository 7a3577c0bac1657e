"""Routing state that follows the registry: long-poll its model records, keep replica sets.

The gateway (every model) and each model's router (its own model) learn of a model that
became ready, a replica that was lost or moved, or a model that went away as soon as the
registry records it (``Registry.watch``), not on a timer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from hive_apps.control.cluster import Cluster, get_cluster
from hive_apps.core import names
from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import LISTED, AdapterRecord, ModelRecord
from hive_apps.ops.metrics import Publisher
from hive_apps.serving.engine.protocol import ADAPTER_HEADER, AdapterRef, ForwardedRequest
from hive_apps.serving.routing.liveness import live_plan
from hive_apps.serving.routing.replica_set import ReplicaSet, default_queue_bound

log = logging.getLogger("ray.serve")
R = TypeVar("R")

WATCH_S = 30.0
RETRY_S = 0.5
# The longest a request that reaches a just-started gateway or router waits for the registry's
# first answer (usually milliseconds): before it, neither can tell which models exist or their state.
FIRST_VIEW_TIMEOUT_S = 10.0
# A name the gateway has not heard of costs at most one registry call before its 404, bounded:
LOOKUP_TIMEOUT_S = 1.0  # the registry answers in milliseconds; a slow one does not hold the client
MISSING_TTL_S = 2.0  # a name found missing is answered 404 without asking again for this long
MISSING_MAX = 4096  # names remembered as missing, oldest forgotten first
LOOKUPS_PER_S = 20.0  # registry lookups per second, all names together (made-up names differ each time)


def replica_fingerprint(replicas: list[ReplicaPlan]) -> tuple:
    """What identifies the engines a plan runs: changed engines need new handles."""
    return tuple((rp.index, rp.node_id, tuple(rp.device_indices)) for rp in replicas)


def model_object(rec: ModelRecord) -> dict:
    """A model as OpenAI's ``GET /v1/models`` lists it."""
    return {"id": rec.model_id, "object": "model", "created": int(rec.created_at), "owned_by": "ray-hive",
            "max_model_len": rec.plan.replicas[0].settings.max_model_len if rec.plan.replicas else None}


def alias_object(alias: str, rec: ModelRecord) -> dict:
    """One of a model's aliases as ``GET /v1/models`` lists it: an entry of its own, as vLLM lists each of
    several served names, with the model's id as its ``root``."""
    return {**model_object(rec), "id": alias, "root": rec.model_id}


def model_objects(rec: ModelRecord) -> list[dict]:
    """A model and each of its aliases, as ``GET /v1/models`` lists them."""
    return [model_object(rec), *(alias_object(a, rec) for a in rec.spec.aliases)]


def aliases_of(records: dict[str, ModelRecord]) -> dict[str, str]:
    """Alias -> model_id over ``records`` (the registry keeps each name to one model, core/state/namespace.py)."""
    return {alias: rec.model_id for rec in records.values() for alias in rec.spec.aliases}


def adapter_object(adapter: AdapterRecord, base: ModelRecord) -> dict:
    """A LoRA adapter as ``GET /v1/models`` lists it: its base is its ``parent`` (as vLLM lists its own)."""
    return {**model_object(base), "id": adapter.model_id, "created": int(adapter.created_at),
            "parent": base.model_id, "root": adapter.source}


def listed_adapters(adapters: dict[str, AdapterRecord], models: dict[str, ModelRecord]) -> dict[str, AdapterRecord]:
    """The adapters a client may name: those whose base is listed (serving, or asleep: a request wakes it)."""
    return {name: a for name, a in adapters.items() if a.base in models}


def mark_adapter(req: ForwardedRequest, adapter: AdapterRecord) -> None:
    """Tell the engine which adapter the request needs (``ADAPTER_HEADER``): it loads it before serving."""
    ref = AdapterRef(model_id=adapter.model_id, weights=adapter.weights, revision_key=adapter.revision_key)
    req.headers = [(k, v) for k, v in req.headers if k.lower() != ADAPTER_HEADER] + [(ADAPTER_HEADER, ref.model_dump_json())]


class ModelReplicas:
    """One ``ReplicaSet`` per serving model, rebuilt when its live replicas change."""

    def __init__(self, cluster: Cluster | None = None, *, settings: HiveSettings, publisher: Publisher) -> None:
        self._sets: dict[str, tuple[tuple, ReplicaSet]] = {}
        self._cluster = cluster  # None: the process's (``get_cluster``)
        self._settings, self._publisher = settings, publisher  # for the sets it builds

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
            replicas = ReplicaSet.of_app(rec.model_id, live, default_queue_bound(rec.plan, rec.spec.max_queued_requests),
                                         self._cluster, settings=self._settings, publisher=self._publisher)
            replicas.start()
            self._sets[rec.model_id] = (fingerprint, replicas)
        replicas = self._sets[rec.model_id][1]
        replicas.routing = rec.spec.routing  # a router's first set was built before its record came
        return replicas

    def adopt(self, model_id: str, plans: list[ReplicaPlan], replicas: ReplicaSet) -> None:
        """Start from a replica set made elsewhere (a router's, from its bound handles)."""
        self._sets[model_id] = (replica_fingerprint(plans), replicas)


async def registry_record(model_id: str, cluster: Cluster | None = None) -> ModelRecord | None:
    """One model's record as the registry has it now (not as the long-poll last brought it)."""
    return await (cluster or get_cluster()).app_handle(names.REGISTRY_APP).get_model.remote(model_id)


def _listed(rec: ModelRecord) -> bool:
    return rec.status in LISTED


class NewModelLookup(Generic[R]):
    """Asks the registry about a model (or, with ``usable``, an adapter) this follower has not heard of:
    it may be one whose deploy answered ready a moment before the long-poll brought it. Bounded, so a
    flood of made-up names is not a flood of registry calls: each call times out, a name found missing
    is not asked about again for a while, and past LOOKUPS_PER_S the answer is the follower's own view
    (the long-poll brings a new model within milliseconds anyway)."""

    def __init__(self, ask: Callable[[str], Awaitable[R | None]] | None = None,
                 timeout_s: float = LOOKUP_TIMEOUT_S,
                 missing_ttl_s: float = MISSING_TTL_S, max_missing: int = MISSING_MAX,
                 per_s: float = LOOKUPS_PER_S, usable: Callable[[R], bool] | None = None):
        self._ask: Callable[[str], Awaitable[R | None]] = ask or registry_record  # type: ignore[assignment]
        self._usable: Callable[[R], bool] = usable or _listed  # type: ignore[assignment]
        self.timeout_s, self.missing_ttl_s, self.max_missing, self.per_s = timeout_s, missing_ttl_s, max_missing, per_s
        self.missing: OrderedDict[str, float] = OrderedDict()  # name -> monotonic time it may be asked about again
        self._tokens, self._filled_at = per_s, time.monotonic()

    async def find(self, model_id: str) -> R | None:
        """Its record when the registry lists it (serving, or sleeping: a request wakes it), else None."""
        now = time.monotonic()
        if self.missing.get(model_id, now) > now or not self._may_ask(now):
            return None
        try:
            rec = await asyncio.wait_for(self._ask(model_id), self.timeout_s)
        except Exception as e:  # slow or restarting: the long-poll brings the model if it exists
            log.info("looking up model %.100r in the registry failed: %s", model_id, type(e).__name__)
            rec = None
        if rec is not None and self._usable(rec):
            return rec
        self.missing[model_id] = time.monotonic() + self.missing_ttl_s
        self.missing.move_to_end(model_id)
        while len(self.missing) > self.max_missing:
            self.missing.popitem(last=False)
        return None

    def _may_ask(self, now: float) -> bool:
        """A token bucket: ``per_s`` lookups a second, as many at once."""
        self._tokens = min(self.per_s, self._tokens + (now - self._filled_at) * self.per_s)
        self._filled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


async def registry_adapter(model_id: str, cluster: Cluster | None = None) -> AdapterRecord | None:
    """One LoRA adapter's record as the registry has it now."""
    return await (cluster or get_cluster()).app_handle(names.REGISTRY_APP).get_adapter.remote(model_id)


async def follow_registry(on_models: Callable[[list[ModelRecord]], None], cluster: Cluster | None = None,
                          on_adapters: Callable[[list[AdapterRecord]], None] | None = None) -> None:
    """Call ``on_models`` with every record each time the registry's book changes (and ``on_adapters``
    with every LoRA adapter, first)."""
    registry = (cluster or get_cluster()).app_handle(names.REGISTRY_APP)
    after = -1
    while True:
        try:
            view = await registry.watch.remote(after, WATCH_S)
            if view.version != after:
                after = view.version
                if on_adapters is not None:
                    on_adapters(view.adapters)
                on_models(view.models)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the registry is restarting: ask again shortly
            log.warning("following the registry failed: %s", e)
            await asyncio.sleep(RETRY_S)
