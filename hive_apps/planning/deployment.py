"""The ``hive-planner`` Serve app: a stateless shell around ``plan_deployment``."""

from __future__ import annotations

from pydantic import BaseModel
from ray import serve

from hive_apps.planning.planner import plan_deployment
from hive_apps.planning.profile import load_profile
from hive_apps.planning.types import DeviceCapacity, Plan, PlanningError, Rejection
from hive_apps.spec import ModelSpec


class PlanOutcome(BaseModel):
    plan: Plan | None = None
    error: str = ""
    status_code: int = 200
    rejected: list[Rejection] = []


def plan_or_error(spec: ModelSpec, devices: list[DeviceCapacity],
                  pending: list[ModelSpec] | None = None) -> PlanOutcome:
    """``pending``: deploys still to be planned after this one (``packing.py``); one whose profile
    cannot be loaded is left out (its own deploy reports why)."""
    try:
        profile = load_profile(spec.model, spec.vllm_kwargs)
        others = []
        for p in pending or []:
            try:
                others.append((p, load_profile(p.model, p.vllm_kwargs)))
            except PlanningError:
                continue
        return PlanOutcome(plan=plan_deployment(spec, devices, profile, pending=others))
    except PlanningError as e:
        return PlanOutcome(error=e.message, status_code=e.status_code, rejected=e.rejected)


@serve.deployment(num_replicas=1, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0})
class Planner:
    def plan(self, spec: ModelSpec, devices: list[DeviceCapacity],
             pending: list[ModelSpec] | None = None) -> PlanOutcome:
        return plan_or_error(spec, devices, pending)


def build(_: dict | None = None):
    return Planner.bind()
