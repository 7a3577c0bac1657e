"""Declared models: the models the hive's Serve config lists in ``hive-admin``'s args.

    - name: hive-admin
      import_path: hive_apps.control.admin.app:build
      route_prefix: /admin
      args:
        models:                  # each entry: a POST /admin/models body
          - model_id: qwen3
            model: Qwen/Qwen3-0.6B
            max_output_prompt_length: 2048
            sleep_timeout: 600

At every start of the admin's replica the admin reconciles the list with the registry's records (a
``serve deploy`` / RayService update that changes these args redeploys the admin app, and its new
replica starts), one entry at a time, in the list's order, after removing what is no longer listed:

* an entry is validated exactly as a ``POST /admin/models`` body is (``ModelSpec.under_policy`` with
  the admin's settings), and a valid one deployed through the same admission (``AdminService.admit``:
  planning, making room, the weights' room, the registry's ``create``);
* missing (or failed/destroyed with other settings): deployed, recorded with origin ``declared``;
* deployed with other settings: changed as ``PUT /admin/models/{id}?recreate=true`` changes it
  (``control/admin/updates.py``): in place where it can be, else deleted and deployed again;
* deployed by ``POST`` under the same id: adopted (origin ``declared``, settings as listed);
* a record of origin ``declared`` whose id the list no longer names: deleted. POSTed models are
  never touched unless the list names them;
* an invalid entry (or an id listed twice) is refused and reported; a model running under its id is
  left as it is; the other entries go on. An entry that could not be placed yet is tried again,
  waiting ``RETRY_S`` and doubling up to ``RETRY_MAX_S``.

``GET /admin/declared`` reports every entry's outcome; the admin's log has the same lines. Changes
made over the API to a declared model (``PUT``, ``DELETE``) last until the admin next starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hive_apps.control.admin.schemas import (
    AdminError,
    DeclaredEntry,
    DeclaredOutcome,
    DeclaredReport,
    validation_problems,
)
from hive_apps.control.admin.updates import GONE_WAIT_S, Amendment, amend
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state import transitions as t
from hive_apps.core.state.changes import spec_change
from hive_apps.core.state.records import ENDED, AdapterDeletion, ModelRecord, ModelStatus, Origin

if TYPE_CHECKING:
    from hive_apps.control.admin.ingress import AdminService

log = logging.getLogger("ray.serve")

RETRY_S = 30.0  # first wait before an entry that could not be deployed is tried again
RETRY_MAX_S = 600.0
REGISTRY_RETRY_S = 1.0


class AdminArgs(BaseModel):
    """``hive-admin``'s application args in the Serve config. An unknown key, or ``models`` that is not a
    list, fails the deploy (a typo must never read as an empty list, which deletes every declared
    model); each entry is checked by the admin, which reports a bad one and goes on with the rest."""

    model_config = ConfigDict(extra="forbid")

    models: list[Any] = Field(
        default_factory=list, description="Declared models: each a POST /admin/models body (docs/declared_models.md).")


def _model_id_of(raw: Any) -> str | None:
    model_id = raw.get("model_id") if isinstance(raw, dict) else None
    return model_id if isinstance(model_id, str) else None


class DeclaredModels:
    """The admin's declared models (``entries``; None: the admin was built without a list, and
    reconciles nothing) and what became of each at this replica's start."""

    def __init__(self, admin: AdminService, entries: list[Any] | None):
        self.admin, self.entries = admin, entries
        self.report = [DeclaredEntry(index=i, model_id=_model_id_of(raw), outcome=DeclaredOutcome.PENDING)
                       for i, raw in enumerate(entries or [])]
        self.removed: list[str] = []
        self.done = asyncio.Event()  # every entry was looked at once
        self.retry_s, self.retry_max_s = RETRY_S, RETRY_MAX_S

    def view(self) -> DeclaredReport:
        return DeclaredReport(declared=self.entries is not None, done=self.done.is_set(),
                              entries=[e.model_copy() for e in self.report], removed=list(self.removed))

    def _set(self, index: int, outcome: DeclaredOutcome, message: str = "", changed: tuple[str, ...] | list[str] = ()) -> None:
        entry = self.report[index]
        self.report[index] = entry.model_copy(update={"outcome": outcome, "message": message, "changed": list(changed),
                                                      "at": self.admin.clock()})
        what = entry.model_id or f"entry {index}"
        if outcome in (DeclaredOutcome.ERROR, DeclaredOutcome.RETRYING):
            log.warning("declared model %s: %s: %s", what, outcome, message)
        else:
            log.info("declared model %s: %s%s", what, outcome, f" ({message})" if message else "")

    # --- the reconcile ----------------------------------------------------------------------
    async def run(self) -> None:
        if self.entries is None:
            self.done.set()
            return
        records = await self._records()
        specs = self._validate()
        await self._remove_unlisted(records, {e.model_id for e in self.report if e.model_id})
        pending, wait = sorted(specs), self.retry_s
        while True:
            pending = [i for i in pending if not await self._one(i, specs[i], wait)]
            self.done.set()
            if not pending:
                return
            await asyncio.sleep(wait)
            wait = min(self.retry_max_s, wait * 2)

    async def _records(self) -> list[ModelRecord]:
        """Every record, once the registry answers (it may be starting with the admin)."""
        while True:
            try:
                return await self.admin.registry.list_models.remote()
            except Exception as e:
                log.warning("declared models wait for the registry: %s", e)
                await asyncio.sleep(REGISTRY_RETRY_S)

    def _validate(self) -> dict[int, ModelSpec]:
        """Each entry checked as a POST body is; ids listed twice are refused (every entry of them)."""
        assert self.entries is not None
        counts = Counter(e.model_id for e in self.report if e.model_id)
        specs: dict[int, ModelSpec] = {}
        for i, raw in enumerate(self.entries):
            model_id = self.report[i].model_id
            if model_id is not None and counts[model_id] > 1:
                at = [e.index for e in self.report if e.model_id == model_id]
                self._set(i, DeclaredOutcome.ERROR, f"model_id {model_id!r} is declared {counts[model_id]} times (entries {at}); "
                                      "declare it once. A model running under it is left as it is")
                continue
            if not isinstance(raw, dict):
                self._set(i, DeclaredOutcome.ERROR, "an entry must be a mapping of POST /admin/models fields")
                continue
            try:
                specs[i] = ModelSpec.under_policy(raw, self.admin.settings)
            except ValidationError as e:
                problems = "; ".join(f"{f}: {m}" for f, m in validation_problems(e.errors()))
                left = " A model running under it is left as it is." if model_id else ""
                self._set(i, DeclaredOutcome.ERROR, f"invalid, as a POST /admin/models body would be (422): {problems}.{left}")
        return specs

    async def _remove_unlisted(self, records: list[ModelRecord], named: set[str | None]) -> None:
        """Delete the declared models the list no longer names (POSTed ones stay)."""
        for rec in records:
            if rec.origin is not Origin.DECLARED or rec.model_id in named or rec.status is ModelStatus.DELETING:
                continue
            try:
                outcome = await self.admin.registry.transition.remote(  # its adapters wait for it to be declared again
                    t.Delete(model_id=rec.model_id, adapters=AdapterDeletion.KEEP))
            except Exception as e:
                log.warning("declared model %s is no longer listed, but deleting it failed: %s", rec.model_id, e)
                continue
            if outcome.ok:
                self.admin.reconciler.ensure(rec.model_id)
                self.removed.append(rec.model_id)
                log.info("declared model %s is no longer listed in hive-admin's models: deleting it", rec.model_id)

    async def _one(self, index: int, spec: ModelSpec, wait_s: float) -> bool:
        """Reconcile one entry; False: try it again later."""
        try:
            outcome, message, changed = await self._reconcile(spec)
        except AdminError as e:
            self._set(index, DeclaredOutcome.RETRYING, f"{e.message} (HTTP {e.status}); trying again in {wait_s:.0f}s")
            return False
        except Exception as e:  # e.g. the registry restarting
            self._set(index, DeclaredOutcome.RETRYING, f"{type(e).__name__}: {e}; trying again in {wait_s:.0f}s")
            return False
        self._set(index, outcome, message, changed)
        return True

    async def _reconcile(self, spec: ModelSpec) -> tuple[DeclaredOutcome, str, tuple[str, ...]]:
        admin, model_id = self.admin, spec.model_id
        rec = await admin.registry.get_model.remote(model_id)
        if rec is not None and rec.status is ModelStatus.DELETING:  # e.g. removed by an earlier config: wait
            records = await admin.wait_for(lambda r: model_id not in r or r[model_id].status is not ModelStatus.DELETING,
                                           admin.settings.drain_grace_s + GONE_WAIT_S)
            rec = records.get(model_id)
            if rec is not None and rec.status is ModelStatus.DELETING:
                raise AdminError(503, f"{model_id!r} is still being deleted")
        if rec is None:
            await admin.admit(spec, Origin.DECLARED)
            return DeclaredOutcome.DEPLOYED, f"deploying; GET /admin/models/{model_id} follows it", ()
        if rec.status in ENDED:
            change = spec_change(rec, spec)
            if not change.changed and rec.origin is Origin.DECLARED:
                return DeclaredOutcome.UNCHANGED, (f"{rec.status.value} with these settings ({rec.message}); PUT "
                                     f"/admin/models/{model_id} with its body deploys it again"), ()
            await admin.admit(spec, Origin.DECLARED)
            return DeclaredOutcome.DEPLOYED, f"it was {rec.status.value}", change.changed
        adopted = rec.origin is not Origin.DECLARED
        amended = await amend(admin, rec, spec, Origin.DECLARED, recreate=True)
        if amended.how is Amendment.RECREATED:
            why = "; ".join(f"{f}: {w}" for f, w in amended.change.restart.items())
            return DeclaredOutcome.REPLACED, f"deleted and deployed again: {why}", amended.change.changed
        if adopted:
            return DeclaredOutcome.ADOPTED, f"deployed by POST before; now declared (was {rec.origin.value})", amended.change.changed
        updated = amended.how is Amendment.IN_PLACE
        return (DeclaredOutcome.UPDATED if updated else DeclaredOutcome.UNCHANGED), "", amended.change.changed

