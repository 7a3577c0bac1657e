"""Response bodies of the admin API (and the monitor-token request)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, field_validator

from hive_apps.core import names
from hive_apps.core.auth import valid_node_name
from hive_apps.core.planning.drift import Loaded, loaded_drift
from hive_apps.core.planning.types import EngineSettings, MemoryBreakdown, Rejection
from hive_apps.core.state.records import (
    IllegalState,
    ModelRecord,
    ModelState,
    ModelStatus,
    Origin,
    SleepMode,
    WakeReport,
)
from hive_apps.core.weights.types import FetchProgress


class ReplicaStatus(BaseModel):
    node: str
    devices: list[str]
    device_kind: str
    settings: EngineSettings
    memory: MemoryBreakdown
    reservation_bytes: int
    engine_start_s: float | None = None
    loaded: list[Loaded] = []  # per rank: what vLLM loaded (weights, CUDA-graph pool), read at start


class ModelStatusResponse(BaseModel):
    model_id: str
    model: str
    engine: str
    routing: str = "prefix"  # the spec's routing: prefix | least_loaded
    aliases: list[str] = []  # the spec's other names on /v1
    status: ModelStatus
    # the lifecycle as one typed value: phase (= status), residency, replicas, destroy (records.ModelState;
    # the flags below stay as they were); None only for a stored record whose flags make no state
    state: ModelState | None = None
    message: str = ""
    route: str
    openai_v1: str = "/v1"
    status_url: str
    replicas: dict[str, ReplicaStatus]
    rejected: list[Rejection] = []
    notes: list[str] = []  # the plan's remarks (dtype fallbacks, multimodal budgets, deprecations)
    lost_replicas: dict[str, str] = {}
    drift: dict[str, str] = {}
    created_at: float
    ready_at: float | None = None
    deploy_seconds: float | None = None
    resident: bool = True  # its replicas hold memory (False while parked)
    sleep_mode: SleepMode | None = None  # how it sleeps, while sleeping or waking
    sleep_reason: str = ""
    can_sleep: bool = False  # it has a sleep_timeout: POST /admin/models/{id}/sleep may put it to sleep now
    slept_at: float | None = None  # epoch seconds it began to sleep (its message says no time: the page shows "for 3 min")
    last_request_at: float | None = None  # as last reported when it went to sleep
    last_wake: WakeReport | None = None  # how the last wake went: placement, engine start, warm-up
    policy_warning: str = ""  # stored before today's settings or code refused its spec: it keeps running until deleted
    revision: str | None = None  # what the source resolved to: the Hub commit, the S3 ETag set ("local" for a folder)
    weight_bytes: int | None = None  # of the source's safetensors files
    phase: str | None = None  # "fetching" while its weights download onto its nodes
    fetch: dict[str, FetchProgress] = {}  # node name -> that node's download, while fetching
    # api: POSTed; declared: listed in hive-admin's args of the hive's Serve config (docs/declared_models.md)
    origin: Origin = Origin.API

    @classmethod
    def of(cls, rec: ModelRecord, fetching: dict[str, FetchProgress] | None = None) -> ModelStatusResponse:
        weights = rec.plan.weights
        return cls(
            policy_warning=rec.policy_warning,
            revision=weights.revision if weights else None,
            weight_bytes=weights.weight_bytes if weights else None,
            phase="fetching" if fetching else None,
            fetch=fetching or {},
            model_id=rec.model_id,
            model=rec.spec.model,
            engine=rec.spec.engine.value,
            routing=rec.spec.routing.value,
            aliases=list(rec.spec.aliases),
            status=rec.status,
            state=_state(rec),
            message=rec.message,
            route=names.model_route(rec.model_id),
            status_url=f"/admin/models/{rec.model_id}",
            replicas={
                names.replica_label(rp.index): ReplicaStatus(
                    node=rp.node_name, devices=rp.devices, device_kind=rp.device_kind.value,
                    settings=rp.settings, memory=rp.memory, reservation_bytes=rp.reservation_bytes,
                    engine_start_s=rec.engine_start_s.get(names.replica_label(rp.index)),
                    loaded=rec.loaded.get(names.replica_label(rp.index), []),
                )
                for rp in rec.plan.replicas
            },
            rejected=rec.plan.rejected,
            notes=rec.plan.notes,
            lost_replicas=rec.lost_replicas,
            drift={**rec.drift, **_loaded_drift(rec)},
            created_at=rec.created_at,
            ready_at=rec.ready_at,
            deploy_seconds=round(rec.ready_at - rec.created_at, 2) if rec.ready_at else None,
            resident=rec.resident,
            sleep_mode=rec.sleep_mode,
            sleep_reason=rec.sleep_reason,
            can_sleep=rec.spec.can_sleep,
            slept_at=rec.slept_at if rec.status is ModelStatus.SLEEPING else None,
            last_request_at=rec.last_request_at,
            last_wake=rec.last_wake,
            origin=rec.origin,
        )


def _loaded_drift(rec: ModelRecord) -> dict[str, str]:
    """"r0 weights" -> how what vLLM loaded differs from the plan (beside the registry's NVML drift)."""
    out = {}
    for rp in rec.plan.replicas:
        label = names.replica_label(rp.index)
        for term, what in loaded_drift(rp.memory.weights, rp.memory.cuda_graphs, rec.loaded.get(label, [])).items():
            out[f"{label} {term}"] = what
    return out


def _state(rec: ModelRecord) -> ModelState | None:
    """A stored record loads as it was (``ModelRecord.from_stored``): one whose flags make no state
    still lists, without it."""
    try:
        return rec.state
    except IllegalState:
        return None


class DeclaredOutcome(StrEnum):
    """What became of one declared model (``DeclaredEntry.outcome``)."""

    PENDING = "pending"  # not looked at yet
    DEPLOYED = "deployed"  # deployed as declared
    UNCHANGED = "unchanged"  # running as declared
    UPDATED = "updated"  # settings changed in place
    ADOPTED = "adopted"  # a POSTed model of that id is now declared
    REPLACED = "replaced"  # deleted and deployed again (a change that needs new engines)
    RETRYING = "retrying"  # not deployed yet, tried again every retry_s
    ERROR = "error"  # refused (the entry is invalid), the running model (if any) left as it was


class DeclaredEntry(BaseModel):
    """How one model of ``hive-admin``'s ``models`` arg went, at the admin's start (``GET /admin/declared``)."""

    index: int  # its place in the list
    model_id: str | None = None  # None: the entry names none
    outcome: DeclaredOutcome
    message: str = ""
    changed: list[str] = []  # the fields its settings changed in (updated, adopted, replaced)
    at: float | None = None  # when the outcome was reached


class DeclaredReport(BaseModel):
    """``GET /admin/declared``: the declared models and what the admin did about them at its start."""

    declared: bool  # the Serve config gave hive-admin a models list (else nothing is reconciled)
    done: bool  # every entry was looked at once (retrying ones are tried again meanwhile)
    entries: list[DeclaredEntry] = []
    removed: list[str] = []  # declared models no longer listed: deleted


def validation_problems(errors: list[Any]) -> list[tuple[str, str]]:
    """A ``ValidationError``'s errors of a ``ModelSpec`` as (field, message) pairs, worded for a user."""
    from hive_apps.core.spec import ModelSpec

    problems = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
        field = ".".join(loc) or "body"
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field; allowed fields are {', '.join(ModelSpec.model_fields)}"
        elif field == "body" and err.get("type") in ("model_attributes_type", "dict_type", "json_invalid"):
            msg = "the body must be a JSON object; send it with 'Content-Type: application/json'"
        problems.append((field, msg))
    return problems


class MonitorTokenRequest(BaseModel):
    """``POST /admin/monitor-tokens``: the node whose agent the token is for."""

    node_name: str = Field(description="The node's ray-hive/node label (on Kubernetes: the node's name).")

    @field_validator("node_name")
    @classmethod
    def _label_value(cls, v: str) -> str:
        if not valid_node_name(v):
            raise ValueError("must be a node name as in the ray-hive/node label: at most 63 letters, digits, "
                             "'-', '_' or '.', beginning and ending with a letter or digit")
        return v


class MonitorToken(BaseModel):
    """A monitor token: good only for pushing samples of ``node_name``."""

    node_name: str
    token: str


class AdminError(Exception):
    """An admin refusal: answered as ``ErrorResponse`` with ``status`` (``extra``: more keys of the body;
    ``retry_after``: a Retry-After header instead)."""

    def __init__(self, status: int, message: str, field: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.field, self.extra = status, message, field, extra


class ErrorBody(BaseModel):
    model_config = {"extra": "allow"}  # e.g. ``rejected`` devices, ``status_detail`` of a failed deploy

    message: str
    field: str | None = None
    status: int


class ErrorResponse(BaseModel):
    """Every admin error: ``{"error": {"message", "field", "status", ...}}``."""

    error: ErrorBody


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the errors a route answers, so clients (and the fuzzer) know them."""
    return {code: {"model": ErrorResponse} for code in codes}
