"""Changing a deployed model's settings: ``PUT /admin/models/{id}`` and the declared models of the
hive's Serve config (``control/admin/declared.py``) both come here.

* the same settings: nothing to do;
* settings the lifecycle loop and the routers read from the record (``core/state/changes.py``:
  sleep_timeout, idle_timeout, priority, keep_resident, routing, aliases, min/max_replicas within what runs):
  the registry's ``respec`` transition records them and they take effect at once;
* anything else needs new engines. The hive cannot roll a model's replicas over to another plan one
  at a time (one record holds one spec and one plan; every engine of a model app loads that plan's
  one weights manifest; the model's id is its app and its route), so the only path is to delete the
  model and deploy it again: ``recreate``. It is checked first (the new settings must plan on the
  devices as they would be without the model), then the model drains (HIVE_DRAIN_GRACE_S), goes, and
  is deployed with the new settings as ``POST /admin/models`` deploys; requests for it in between
  get 404. Without ``recreate`` the change is refused (409), saying which fields and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from hive_apps.control.admin.schemas import AdminError
from hive_apps.core import names
from hive_apps.core.planning.types import DeviceCapacity
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state import transitions as t
from hive_apps.core.state.changes import SpecChange, spec_change
from hive_apps.core.state.records import AdapterDeletion, ModelRecord, ModelStatus, Origin

if TYPE_CHECKING:
    from hive_apps.control.admin.ingress import AdminService

RESPEC_ATTEMPTS = 5  # a respec refused for a stale version (a note, a drift) is read again and retried
GONE_WAIT_S = 60.0  # past the drain grace, how long a recreate waits for the old model's record to go


class Amendment(StrEnum):
    UNCHANGED = "unchanged"  # the same settings (the origin possibly recorded)
    IN_PLACE = "in_place"  # recorded; the lifecycle loop and the routers follow the record
    RECREATED = "recreated"  # deleted and deployed again with the new settings


@dataclass
class Amended:
    """What an update did: ``unchanged`` (origin possibly recorded), ``in_place`` or ``recreated``."""

    how: Amendment
    record: ModelRecord
    change: SpecChange = field(default_factory=SpecChange)


def restart_message(model_id: str, change: SpecChange) -> str:
    """Why a change needs new engines, and what to do instead."""
    why = "; ".join(f"{f} ({reason})" for f, reason in change.restart.items())
    return (f"changing {why} needs new engines, and the hive does not roll a model's replicas over to new "
            f"settings one at a time. Either PUT /admin/models/{model_id}?recreate=true with the same body (it "
            "checks the new settings fit once this model's replicas are gone, drains and deletes the model, then "
            "deploys it with them: requests for it fail until it is ready again), or POST the new settings under "
            f"another model_id and DELETE /admin/models/{model_id} once clients moved over (no downtime)")


def without_model(devices: list[DeviceCapacity], rec: ModelRecord) -> list[DeviceCapacity]:
    """The devices as they would be once ``rec``'s replicas are gone: what each booked is available
    and free again (its planned reservation, the least it frees)."""
    if not rec.holds_memory:
        return devices
    freed: dict[str, int] = {}
    keys = set()
    for rp in rec.live_replicas:
        keys.add(names.replica_key(rec.model_id, rp.index))
        for dev in rp.devices:
            freed[dev] = freed.get(dev, 0) + rp.reservation_bytes
    return [dc.model_copy(update={
        "available_bytes": dc.available_bytes + freed.get(dc.device.id, 0),
        "free_bytes": dc.free_bytes + freed.get(dc.device.id, 0),
        "hive_replicas": [r for r in dc.hive_replicas if r not in keys]}) for dc in devices]


async def amend(admin: AdminService, rec: ModelRecord, spec: ModelSpec, origin: Origin, recreate: bool) -> Amended:
    """Give a deployed model (not deleting, not ended) the settings ``spec``, recorded as asked for by
    ``origin``. Raises ``AdminError``: 409 for a change that needs new engines without ``recreate``, or
    for an alias another model or an adapter holds (checked before anything is deleted)."""
    await admin.check_names(spec)
    for _ in range(RESPEC_ATTEMPTS):
        change = spec_change(rec, spec)
        if change.restart:
            if not recreate:
                first = next(iter(change.restart))
                raise AdminError(409, restart_message(rec.model_id, change), first,
                                 restart_fields=change.restart, live_fields=list(change.live))
            return Amended(Amendment.RECREATED, await replace(admin, rec, spec, origin), change)
        if not change.changed and rec.origin is origin:
            return Amended(Amendment.UNCHANGED, rec, change)
        outcome = await admin.registry.transition.remote(t.Respec(model_id=rec.model_id, version=rec.version,
                                                                  spec=spec, origin=origin))
        if outcome.ok:  # the lifecycle loop and the routers follow the record: nothing else to do
            return Amended(Amendment.IN_PLACE if change.changed else Amendment.UNCHANGED, outcome.record, change)
        taken = outcome.message.removeprefix("respec: ")
        if taken.startswith(("alias ", "model_id ")):  # a name taken since check_names
            raise AdminError(409, taken, "aliases" if taken.startswith("alias") else "model_id")
        if outcome.record is None or outcome.record.status in (ModelStatus.DELETING, ModelStatus.FAILED,
                                                                ModelStatus.DESTROYED):
            raise AdminError(409, f"{rec.model_id!r} changed while its settings were being updated: "
                                  f"{outcome.message}", "model_id")
        rec = outcome.record  # refused for a stale version: decide again on the record as it is now
    raise AdminError(503, f"the record of {rec.model_id!r} kept changing while its settings were being updated; "
                          "try again", "model_id", retry_after=1)


async def replace(admin: AdminService, rec: ModelRecord, spec: ModelSpec, origin: Origin) -> ModelRecord:
    """Delete the model and deploy ``spec`` under its id, once the new settings are known to plan on
    the devices as they would be without it (else ``AdminError`` and the model stays as it was)."""
    await admin.plan(spec, freeing=rec)  # raises: nothing was touched
    # its adapters stay: the same model_id comes back with the new settings
    outcome = await admin.registry.transition.remote(t.Delete(model_id=rec.model_id, adapters=AdapterDeletion.KEEP))
    if not outcome.ok:
        raise AdminError(outcome.status_code, outcome.message, "model_id")
    admin.reconciler.ensure(rec.model_id)
    records = await admin.wait_for(lambda records: rec.model_id not in records,
                                   admin.settings.drain_grace_s + GONE_WAIT_S)
    if rec.model_id in records:
        raise AdminError(503, f"{rec.model_id!r} is still being deleted to be deployed with its new settings; "
                              "POST them once GET /admin/models no longer lists it", "model_id", retry_after=5)
    try:
        return await admin.admit(spec, origin)
    except AdminError as e:
        e.message = (f"{rec.model_id!r} was deleted to take its new settings, but deploying them failed: {e.message}; "
                     "POST them again once there is room")
        raise

