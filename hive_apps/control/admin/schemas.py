"""Response bodies of the admin API (and the monitor-token request)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator

from hive_apps.core import names
from hive_apps.core.auth import valid_node_name
from hive_apps.core.planning.types import EngineSettings, MemoryBreakdown, Rejection
from hive_apps.core.state.records import IllegalState, ModelRecord, ModelState, ModelStatus, SleepMode, WakeReport
from hive_apps.core.weights.types import FetchProgress


class ReplicaStatus(BaseModel):
    node: str
    devices: list[str]
    device_kind: str
    settings: EngineSettings
    memory: MemoryBreakdown
    reservation_bytes: int
    engine_start_s: float | None = None


class ModelStatusResponse(BaseModel):
    model_id: str
    model: str
    engine: str
    routing: str = "prefix"  # the spec's routing: prefix | least_loaded
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
                )
                for rp in rec.plan.replicas
            },
            rejected=rec.plan.rejected,
            notes=rec.plan.notes,
            lost_replicas=rec.lost_replicas,
            drift=rec.drift,
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
        )


def _state(rec: ModelRecord) -> ModelState | None:
    """A stored record loads as it was (``ModelRecord.from_stored``): one whose flags make no state
    still lists, without it."""
    try:
        return rec.state
    except IllegalState:
        return None


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
