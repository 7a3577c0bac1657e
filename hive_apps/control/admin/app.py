"""The ``hive-admin`` Serve app at ``/admin``: validate, plan, and ask the registry for transitions.

A thin Serve shell around ``make_admin_app`` (``control/admin/ingress.py``), which holds the request
logic, the reconciler and the loops that follow the registry. Its application args in the Serve
config declare models (``args: {models: [...]}``, ``control/admin/declared.py``): each start of its
replica reconciles them, and a config update that changes them redeploys it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve

from hive_apps.control.admin.declared import AdminArgs
from hive_apps.control.admin.ingress import make_admin_app
from hive_apps.control.cluster import RayCluster, set_cluster
from hive_apps.core import names
from hive_apps.core.auth import warn_if_open
from hive_apps.core.settings import get_settings


def admin_app(models: list[Any] | None = None) -> FastAPI:
    """Built on the replica, on its event loop (the app starts its loops at once), by Serve's ingress."""
    settings = get_settings()
    warn_if_open(settings, names.ADMIN_APP)
    cluster = RayCluster(namespace=settings.state_namespace)  # the weight fetchers' namespace
    set_cluster(cluster)  # and the process's seam (``get_cluster``)
    return make_admin_app(cluster, settings, declared=models)


@serve.deployment(num_replicas=1, max_ongoing_requests=200, ray_actor_options={"num_cpus": 0})
@serve.ingress()  # late-bound: the app is built by __serve_build_asgi_app__, after __init__ has the args
class Admin:
    def __init__(self, models: list[Any] | None = None):
        self.models = models

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve awaits this on the replica's event loop once ``__init__`` ran."""
        return admin_app(self.models)


def build(args: dict[str, Any] | None = None):
    """``hive-admin``'s args in the Serve config: ``models``, the declared models (an unknown key
    fails the deploy with the key named, rather than reading as no models)."""
    parsed = AdminArgs.model_validate(args or {})
    return Admin.bind(parsed.models)  # type: ignore[attr-defined]  # added by @serve.deployment
