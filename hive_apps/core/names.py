"""Every name the hive gives to a Serve app, deployment, replica or reservation, made here.

Apps, deployments and reservation keys are looked up by name across components (the admin
deletes the app it built, the gateway finds a model's engines, the registry keys a replica's
memory), so they are made in one place instead of rebuilt from string patterns.
"""

from __future__ import annotations

REGISTRY_APP = "hive-registry"
PLANNER_APP = "hive-planner"
ADMIN_APP = "hive-admin"
GATEWAY_APP = "hive-gateway"
CONTROL_PLANE_APPS = (REGISTRY_APP, PLANNER_APP, ADMIN_APP, GATEWAY_APP)

RESERVED_PREFIX = "hive-"  # app names of the control plane; a model id may not start with it
ROUTER_DEPLOYMENT = "router"


def model_app(model_id: str) -> str:
    """A model's Serve app is named after the model."""
    return model_id


def model_route(model_id: str) -> str:
    return f"/{model_id}"


def replica_label(index: int) -> str:
    """How a replica is named in statuses: ``r0``, ``r1``..."""
    return f"r{index}"


def replica_index(label: str) -> int:
    return int(label.removeprefix("r"))


def engine_deployment(index: int) -> str:
    return f"engine-{replica_label(index)}"


def is_engine_deployment(name: str) -> bool:
    return name.startswith("engine-r") and name[len("engine-r"):].isdigit()


def replica_key(model_id: str, index: int) -> str:
    """A replica's identity in the ledger and in start locks: ``<model_id>/r<i>``."""
    return f"{model_id}/{replica_label(index)}"
