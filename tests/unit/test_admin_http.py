"""The admin's HTTP shapes in-process (moved from the cluster tier): framework errors in the hive's
error body, tokens and body sizes refused from the headers. The real admin app
(its guard and routes) on the in-memory cluster, as ``test_monitor_tokens.py`` runs it."""

from __future__ import annotations

import time

import httpx
import pytest

from hive_apps import names
from hive_apps.cluster import set_cluster
from hive_apps.registry.deployment import Registry
from hive_apps.settings import get_settings
from tests.unit.fake_cluster import FakeCluster

ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture
async def admin(monkeypatch):
    """(a client of the admin app with the admin token, one without)."""
    from hive_apps.admin import app as admin_app

    monkeypatch.setenv("HIVE_ADMIN_TOKEN", "adm")
    monkeypatch.delenv("HIVE_AUTH_DISABLED", raising=False)
    get_settings.cache_clear()
    cluster = FakeCluster({"node-a": "L4"})
    set_cluster(cluster)
    registry = Registry.__new__(Registry)
    await registry.__init__(get_settings())
    registry._loop_task.cancel()
    cluster.serve(names.REGISTRY_APP, registry)

    class Admin(admin_app.Admin.func_or_class):
        def __del__(self):  # Serve's ingress wrapper shuts down a running app here; there is none
            pass

    instance = object.__new__(Admin)  # no loops started
    instance.settings, instance.cluster = get_settings(), cluster
    for route in admin_app.app.routes:  # Serve's ingress resolves ``self`` through a dependency
        for dep in getattr(getattr(route, "dependant", None), "dependencies", []):
            if dep.name == "self":
                admin_app.app.dependency_overrides[dep.call] = lambda: instance
    transport = httpx.ASGITransport(app=admin_app.app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://hive", headers=ADMIN) as c, \
                httpx.AsyncClient(transport=transport, base_url="http://hive") as anonymous:
            yield c, anonymous
    finally:
        admin_app.app.dependency_overrides.clear()
        set_cluster(None)
        get_settings.cache_clear()


async def test_admin_framework_errors_and_unauthenticated_bodies(admin):
    """From tests/cluster/test_hardening.py."""
    client, anonymous = admin
    assert (await client.get("/no-such-thing")).json()["error"]["status"] == 404
    r = await client.put("/models")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = await client.post("/models", content=b"\xff\xfe{", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and "error" in r.json()
    r = await client.post("/models", content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 or r.status_code == 413, r.text
    assert "error" in r.json()
    t0 = time.monotonic()
    r = await anonymous.post("/models", content=b"x" * (8 * 2**20))
    assert r.status_code in (401, 413) and "error" in r.json()  # refused from the headers, never parsed
    r = await anonymous.get("/models", headers={"Authorization": "Bearer \u00e4".encode("latin-1")})
    assert r.status_code == 401
    assert time.monotonic() - t0 < 30


async def test_form_body_is_told_to_send_json(admin):
    """From tests/cluster/test_sim_hive.py."""
    client, _ = admin
    r = await client.post("/plan", content=b"model_id=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 422 and "JSON object" in r.json()["error"]["message"]
