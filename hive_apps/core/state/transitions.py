"""The transitions the registry's callers may ask for: one typed message each, and one table. Pure: no Ray.

Every caller (the admin, the gateway, routers, tests) builds a message and hands it to
``Registry.transition``; the message carries the model id, the record version it read (where the
transition takes one) and the transition's own arguments, checked when it is built (and it pickles
across Ray). ``RULES`` maps each message type onto its ``ModelBook`` method (``core/state/book.py``
describes where each starts and where it leads) and says what the registry adds before it runs:
the time (``takes_now``), a setting, or a wait for the first device sample (``needs_sample``: it
books device or host memory, which the ledger knows of only once the nodes were sampled). Every
list of transition names derives from this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hive_apps.core.planning.drift import Loaded
from hive_apps.core.planning.types import Plan, ReplicaPlan
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.records import AdapterDeletion, AdapterRecord, ModelRecord, Origin, Reservation


class Transition(BaseModel):
    """One asked-for transition of one model's record."""

    model_config = ConfigDict(frozen=True)

    model_id: str

    @property
    def name(self) -> str:
        """The transition's name: its ``ModelBook`` method (what logs and metrics call it)."""
        return RULES[type(self)].method

    def arguments(self) -> dict[str, Any]:
        """The fields as they are (not dumped), by name: the ``ModelBook`` method's keyword arguments."""
        return dict(self)


class Versioned(Transition):
    """A transition from the record version the caller read: refused if the record changed since."""

    version: int


class Create(Transition):
    """``POST /models``: a new record, and the reservations of its plan."""

    record: ModelRecord
    reservations: list[Reservation]


class Applied(Versioned):
    generation: int


class Started(Versioned):
    engine_start_s: dict[str, float] | None = None
    warm_up_s: dict[str, float] | None = None
    wake_s: dict[str, float] | None = None
    loaded: dict[str, list[Loaded]] | None = None  # "r0" -> per rank: what vLLM loaded (planning/drift.py)


class Fail(Versioned):
    reason: str


class Heal(Versioned):
    replacements: list[ReplicaPlan]


class HealFailed(Versioned):
    reason: str


class Note(Versioned):
    message: str
    next_heal_at: float | None = None


class Delete(Transition):
    adapters: AdapterDeletion = AdapterDeletion.REFUSE  # what happens to the adapters on it


class CreateAdapter(Transition):
    """``POST /admin/adapters``: a new adapter on a base with ``lora`` (``model_id``: the adapter's)."""

    record: AdapterRecord


class DeleteAdapter(Transition):
    """``DELETE /admin/adapters/{id}``."""


class Deleted(Versioned):
    pass


class Sleep(Versioned):
    reason: str
    last_request_at: float | None = None


class Doze(Versioned):
    """Its drained engines can sleep in place; ``warm``: they have no sleep mode, but their processes
    stay with vLLM stopped in them (``SleepMode.WARM``)."""

    warm: bool = False


class Cool(Versioned):
    """Stop the kept processes of a model asleep warm: another model needs what they hold."""

    reason: str


class Dozed(Versioned):
    """Its engines slept in place. ``residuals``: what each engine measured it still holds, by replica
    index and device id; a replica left out (nothing measured) is booked by plan."""

    residuals: dict[int, dict[str, int]] = Field(default_factory=dict)


class Parked(Transition):
    pass


class Wake(Transition):
    pass


class Placed(Versioned):
    plan: Plan
    reservations: list[Reservation]
    placement_s: float
    evicted: list[str]


class WakeFailed(Versioned):
    reason: str


class Destroy(Versioned):
    reason: str


class ScaleUp(Versioned):
    replica: ReplicaPlan


class ScaleFailed(Versioned):
    reason: str


class Retire(Versioned):
    index: int


class Retired(Versioned):
    pass


class Respec(Versioned):
    """``PUT /admin/models/{id}`` or a declared model: settings that need no new engines
    (``core/state/changes.py``), and who asked for the model."""

    spec: ModelSpec
    origin: Origin


@dataclass(frozen=True)
class Rule:
    """How the registry runs one message: ``ModelBook.<method>(**arguments)``, with ``now`` added where
    ``takes_now``, each ``settings`` keyword taken from that ``HiveSettings`` field, and ``model_id``
    left out where ``by_record`` (the method reads it from the record)."""

    method: str
    takes_now: bool = False
    needs_sample: bool = False
    by_record: bool = False
    settings: dict[str, str] = field(default_factory=dict)
    adapter: bool = False  # it changes a LoRA adapter's record, not a model's

    def arguments(self, msg: Transition) -> dict[str, Any]:
        args = msg.arguments()
        if self.by_record:
            del args["model_id"]
        return args


RULES: dict[type[Transition], Rule] = {
    Create: Rule("create", takes_now=True, needs_sample=True, by_record=True),
    Applied: Rule("applied", takes_now=True),
    Started: Rule("started", takes_now=True),
    Fail: Rule("fail"),
    Heal: Rule("heal", takes_now=True, needs_sample=True),
    HealFailed: Rule("heal_failed", takes_now=True, settings={"backoff_cap_s": "heal_backoff_max_s"}),
    Note: Rule("note"),
    Delete: Rule("delete"),
    Deleted: Rule("deleted"),
    Sleep: Rule("sleep", takes_now=True),
    Doze: Rule("doze", needs_sample=True),  # level 1 books host RAM, known once the nodes were sampled
    Dozed: Rule("dozed", takes_now=True),
    Cool: Rule("cool"),
    Parked: Rule("parked", takes_now=True),
    Wake: Rule("wake", takes_now=True),
    Placed: Rule("placed", takes_now=True, needs_sample=True),
    WakeFailed: Rule("wake_failed", takes_now=True),
    Destroy: Rule("destroy"),
    ScaleUp: Rule("scale_up", takes_now=True, needs_sample=True),
    ScaleFailed: Rule("scale_failed"),
    Retire: Rule("retire"),
    Retired: Rule("retired"),
    Respec: Rule("respec"),
    CreateAdapter: Rule("create_adapter", takes_now=True, by_record=True, adapter=True),
    DeleteAdapter: Rule("delete_adapter", adapter=True),
}

# the lists of names, derived from the table
ASKED = frozenset(r.method for r in RULES.values())  # every transition a caller may ask for
NOW = frozenset(r.method for r in RULES.values() if r.takes_now)  # the registry adds the time
NEEDS_SAMPLE = frozenset(r.method for r in RULES.values() if r.needs_sample)  # waits for the first sample
ADAPTER = frozenset(r.method for r in RULES.values() if r.adapter)  # of LoRA adapters' records
MODEL = ASKED - ADAPTER  # of model records: the lifecycle (``records.LEGAL``)
BY_NAME: dict[str, type[Transition]] = {r.method: t for t, r in RULES.items()}


def rule_of(msg: object) -> Rule | None:
    """The rule for this message; None for anything the table does not list."""
    return RULES.get(type(msg)) if isinstance(msg, Transition) else None
