"""The ``hive-admin`` Serve app at ``/admin``: validate, plan, and ask the registry for transitions.

A thin Serve shell around ``make_admin_app`` (``control/admin/ingress.py``), which holds the request
logic, the reconciler and the loops that follow the registry.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve

from hive_apps.control.admin.ingress import make_admin_app
from hive_apps.control.cluster import get_cluster
from hive_apps.core import names
from hive_apps.core.auth import warn_if_open
from hive_apps.core.settings import get_settings


def admin_app() -> FastAPI:
    """Built on the replica, on its event loop (the app starts its loops at once), by Serve's ingress."""
    settings = get_settings()
    warn_if_open(settings, names.ADMIN_APP)
    return make_admin_app(get_cluster(), settings)


@serve.deployment(num_replicas=1, max_ongoing_requests=200, ray_actor_options={"num_cpus": 0})
@serve.ingress(admin_app)
class Admin:
    pass


def build(_: dict | None = None):
    return Admin.bind()  # type: ignore[attr-defined]  # added by @serve.deployment
