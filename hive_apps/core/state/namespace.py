"""One namespace on ``/v1``: model ids, their aliases and LoRA adapter names. Pure: no Ray.

A client names what it wants by ``model`` alone, so a name may lead to one thing only. The registry
checks each transition that adds names against its book (``core/state/book.py``: create, respec,
create_adapter), which no two admins can race; the admin checks the same first, so a taken alias is
refused before a plan is made or a model is deleted to be deployed again.
"""

from __future__ import annotations

from collections.abc import Iterable

from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.records import ENDED, AdapterRecord, ModelRecord


def holder_of(name: str, records: Iterable[ModelRecord], adapters: Iterable[AdapterRecord],
              but: str | None = None) -> str | None:
    """Who answers to ``name`` on /v1, other than the model ``but`` (its own names); None: it is free.
    A failed or destroyed model holds no name (its id may be deployed again)."""
    for rec in records:
        if rec.model_id == but or rec.status in ENDED:
            continue
        if rec.model_id == name:
            return f"model {name!r}"
        if name in rec.spec.aliases:
            return f"model {rec.model_id!r} (an alias of it)"
    for adapter in adapters:
        if adapter.model_id == name:
            return f"LoRA adapter {name!r} (on {adapter.base!r})"
    return None


def alias_conflict(spec: ModelSpec, records: Iterable[ModelRecord], adapters: Iterable[AdapterRecord]) -> str | None:
    """Why ``spec``'s names collide with the names others hold: its model_id with another model's alias
    (ids of models and adapters are checked where they always were), or one of its aliases with
    anything; None when they are free."""
    records, adapters = list(records), list(adapters)
    for rec in records:
        if rec.model_id != spec.model_id and rec.status not in ENDED and spec.model_id in rec.spec.aliases:
            return (f"model_id {spec.model_id!r} is an alias of model {rec.model_id!r}; choose another model_id, or "
                    f"drop the alias there first (PUT /admin/models/{rec.model_id} without it)")
    for alias in spec.aliases:
        holder = holder_of(alias, records, adapters, but=spec.model_id)
        if holder is not None:
            return (f"alias {alias!r} is taken by {holder}; choose another alias, or free it there first (a "
                    "model's alias by PUT without it, an adapter by DELETE)")
    return None
