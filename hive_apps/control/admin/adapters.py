"""LoRA adapters in the admin: ``POST /admin/adapters`` checks an adapter against its base and asks the
registry to record it; ``DELETE /admin/adapters/{id}`` removes it and asks the base's engines to unload it.

An adapter has no Serve app and no reservation of its own: its base's engines hold the LoRA slots
(booked with the base's plan, ``core/planning/lora.py``) and load an adapter when a request names it
(``serving/engine/adapters.py``). The checks (source, config, rank, target modules, shapes against the
base) run in the planner's worker (``core/planning/adapter_source.py``); the registry checks what it
owns (names, the base's state and ``lora``). After the record exists, the adapter's files are fetched
onto the nodes of the base's replicas in the background, so its first request does not wait for a
download; an engine on another node (a heal, a wake) has its own node fetch them when asked.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel

from hive_apps.control.admin.schemas import AdminError
from hive_apps.core.planning.adapter_source import AdapterCheck
from hive_apps.core.spec import AdapterSpec
from hive_apps.core.state.namespace import holder_of
from hive_apps.core.state.records import ENDED, LISTED, SERVING, AdapterRecord, ModelStatus
from hive_apps.core.state.transitions import CreateAdapter, DeleteAdapter
from hive_apps.core.weights.types import SourceKind

if TYPE_CHECKING:
    from hive_apps.control.admin.ingress import AdminService

log = logging.getLogger("ray.serve")

UNLOAD_TIMEOUT_S = 10.0


class AdapterStatus(BaseModel):
    """An adapter in ``GET /admin/adapters`` and the answers of its routes."""

    model_id: str
    base: str
    source: str
    revision: str
    rank: int
    alpha: float
    target_modules: list[str]
    base_model_name: str | None = None
    bytes: int
    created_at: float
    serving: bool  # its base is listed on /v1 (serving, or asleep: a request wakes it)
    base_status: str  # its base's status, or "missing" (a declared base dropped from the config)
    # the base's replicas whose engine holds it now, read from the engines (their load reports), so a
    # restart of the admin or the registry loses nothing: the engines are where it is loaded
    loaded_on: list[str] = []
    openai_v1: str = "/v1"

    @classmethod
    def of(cls, rec: AdapterRecord, base_status: ModelStatus | None, loaded_on: list[str] | None = None) -> AdapterStatus:
        return cls(model_id=rec.model_id, base=rec.base, source=rec.source, revision=rec.weights.revision,
                   rank=rec.rank, alpha=rec.alpha, target_modules=rec.target_modules,
                   base_model_name=rec.base_model_name, bytes=rec.bytes, created_at=rec.created_at,
                   serving=base_status in LISTED, base_status=base_status.value if base_status else "missing",
                   loaded_on=loaded_on or [])


async def admit_adapter(admin: AdminService, spec: AdapterSpec) -> AdapterRecord:
    """Check the adapter against its base and record it; a 4xx naming the problem otherwise."""
    registry = admin.registry
    if await registry.get_adapter.remote(spec.model_id) is not None:
        raise AdminError(409, f"adapter {spec.model_id!r} exists; DELETE /admin/adapters/{spec.model_id} first or "
                              "choose another model_id", "model_id")
    taken = await registry.get_model.remote(spec.model_id)
    if taken is not None and taken.status not in ENDED:
        raise AdminError(409, f"{spec.model_id!r} is a model's name; choose another model_id", "model_id")
    holder = holder_of(spec.model_id, await registry.list_models.remote(), ())
    if holder is not None:
        raise AdminError(409, f"{spec.model_id!r} is taken by {holder}; choose another model_id", "model_id")
    base = await registry.get_model.remote(spec.base)
    if base is None or base.status in ENDED:
        raise AdminError(404, f"unknown base {spec.base!r}: no deployed model has that model_id (GET /admin/models "
                              "lists them); deploy the base with lora first", "base")
    if base.spec.lora is None:
        raise AdminError(422, f"the base {spec.base!r} was deployed without lora; deploy it with lora: {{max_loras, "
                              f"max_lora_rank}} (PUT /admin/models/{spec.base}?recreate=true with lora in the body) "
                              "to serve adapters on it", "base")
    check: AdapterCheck = await admin.planner.check_adapter.remote(spec, base.spec, base.plan.weights)
    if check.info is None or check.weights is None:
        raise AdminError(check.status_code if check.status_code >= 400 else 422,
                         f"adapter {spec.model_id!r} cannot serve on {spec.base!r}: {check.error}", check.field)
    info = check.info
    record = AdapterRecord(model_id=spec.model_id, base=spec.base, source=spec.source, weights=check.weights,
                           rank=info.rank, alpha=info.alpha, target_modules=info.target_modules,
                           base_model_name=info.base_model_name, bytes=info.bytes)
    outcome = await registry.transition.remote(CreateAdapter(model_id=spec.model_id, record=record))
    if not outcome.ok or outcome.adapter is None:
        field = "base" if spec.base in outcome.message else "model_id"
        raise AdminError(outcome.status_code, outcome.message, field)
    stored: AdapterRecord = outcome.adapter
    if stored.weights.source.kind is not SourceKind.LOCAL:  # a folder is read in place on each node
        admin.spawn(_prefetch(admin, stored, base.plan.replicas))
    return stored


async def _prefetch(admin: AdminService, rec: AdapterRecord, replicas) -> None:
    """The adapter's files onto the nodes of its base's replicas now (each node answers at once and
    fetches in its own background), so the first request for it does not wait for a download."""
    nodes = sorted({rp.node_id for rp in replicas})
    try:
        await admin.caches.prefetch(rec.weights, nodes, await admin.reconciler.weights_in_use())
    except Exception as e:  # the engine asks its node again when a request comes
        log.warning("prefetching adapter %s onto %s failed: %s", rec.model_id, nodes, e)


async def remove_adapter(admin: AdminService, model_id: str) -> AdapterRecord:
    """Delete the record (it stops being routed at once), then ask each engine of its base to unload it."""
    rec: AdapterRecord | None = await admin.registry.get_adapter.remote(model_id)
    outcome = await admin.registry.transition.remote(DeleteAdapter(model_id=model_id))
    if not outcome.ok or rec is None:
        raise AdminError(outcome.status_code, f"no adapter {model_id!r}; GET /admin/adapters lists them", "model_id")
    await unload_everywhere(admin, rec)
    return rec


async def unload_everywhere(admin: AdminService, rec: AdapterRecord) -> list[str]:
    """Ask every live engine of the base to unload the adapter (best effort: an engine that does not
    answer no longer gets requests for it, and its LRU lets it go). The replicas that had it loaded."""
    base = await admin.registry.get_model.remote(rec.base)
    if base is None or not base.resident:
        return []

    async def one(index: int) -> str | None:
        try:
            handle = admin.cluster.engine_handle(rec.base, index)
            had = await asyncio.wait_for(handle.unload_adapter.remote(rec.model_id), UNLOAD_TIMEOUT_S)
            return f"r{index}" if had else None
        except Exception as e:
            log.info("unloading adapter %s from %s/r%d: %s", rec.model_id, rec.base, index, type(e).__name__)
            return None

    found = await asyncio.gather(*(one(rp.index) for rp in base.live_replicas))
    return [r for r in found if r]


async def adapter_status(admin: AdminService, rec: AdapterRecord,
                         held: dict[str, dict[str, list[str]]] | None = None) -> AdapterStatus:
    """``held``: base -> replica -> adapters its engine holds, shared by the adapters of one listing
    (each base's engines are asked once)."""
    held = {} if held is None else held
    base = await admin.registry.get_model.remote(rec.base)
    if base is not None and rec.base not in held:
        serving = base.status in SERVING and base.resident
        loads = await admin.lifecycle.replica_loads(base) if serving else {}
        held[rec.base] = {replica: ld.adapters for replica, ld in loads.items()}
    on = sorted(r for r, names in held.get(rec.base, {}).items() if rec.model_id in names)
    return AdapterStatus.of(rec, base.status if base is not None else None, on)
