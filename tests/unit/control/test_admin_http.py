"""The admin's HTTP shapes in-process (moved from the cluster tier): framework errors in the hive's
error body, tokens and body sizes refused from the headers. The admin app built by
``make_admin_app`` (its guard and routes) on the in-memory cluster (``test_admin_app.admin_on``)."""

from __future__ import annotations

import time

import pytest

from tests.unit.control.test_admin_app import admin_on
from tests.unit.fake_cluster import FakeCluster


@pytest.fixture
async def admin():
    """(a client of the admin app with the admin token, one without)."""
    async with admin_on(FakeCluster({"node-a": "L4"})) as a:
        yield a.client, a.anonymous


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
