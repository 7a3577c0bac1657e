"""The admin's gate answers from the headers, before any body is read, and the registry
refuses samples that could lie the hive into oversubscription."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hive_apps.control.admin.guard import AdminGuard
from hive_apps.control.registry.samples import sample_problems
from hive_apps.core.auth import check_admin_token, node_monitor_token
from hive_apps.core.devices import Device, DeviceKind, NodeSample
from hive_apps.core.settings import HiveSettings

SETTINGS = HiveSettings(admin_token="adm", monitor_token="mon")
ADMIN = {"Authorization": "Bearer adm"}
MONITOR = {"Authorization": f"Bearer {node_monitor_token('mon', 'n')}"}  # node n's agent


def guarded(limit: int = 1024):
    reads = []

    async def echo(request: Request):
        body = await request.body()
        reads.append(len(body))
        return JSONResponse({"read": len(body)})

    routes = [Route(p, echo, methods=["GET", "POST"]) for p in ("/models", "/registry/samples", "/healthz")]
    app = AdminGuard(Starlette(routes=routes), settings=lambda: SETTINGS, max_body_bytes=limit)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin"), reads


async def test_no_token_is_refused_before_the_body_is_read():
    client, reads = guarded()
    r = await client.post("/models", content=b"x" * 500)
    assert r.status_code == 401 and "HIVE_ADMIN_TOKEN" in r.json()["error"]["message"]
    assert reads == []
    r = await client.post("/models", content=b"x" * 500, headers=ADMIN)
    assert r.status_code == 200 and reads == [500]


async def test_bodies_past_the_limit_are_refused():
    client, reads = guarded(limit=1024)
    r = await client.post("/models", content=b"x" * 2048, headers=ADMIN)
    assert r.status_code == 413 and "larger than 1 KiB" in r.json()["error"]["message"] and reads == []

    async def chunks():  # no content-length: counted while it streams in
        for _ in range(4):
            yield b"x" * 512

    r = await client.post("/models", content=chunks(), headers=ADMIN)
    assert r.status_code == 413 and reads == []


async def test_monitor_token_is_good_only_for_samples():
    client, _ = guarded()
    assert (await client.post("/registry/samples", json={}, headers=MONITOR)).status_code == 200
    assert (await client.post("/registry/samples", json={}, headers=ADMIN)).status_code == 200
    assert (await client.post("/models", json={}, headers=MONITOR)).status_code == 401
    assert (await client.get("/healthz")).status_code == 200
    r = await client.post("/registry/samples", json={}, headers={"Authorization": "Bearer mon"})
    assert r.status_code == 401 and "not an agent's token" in r.json()["error"]["message"]  # the secret itself
    forged = {"Authorization": f"Bearer {node_monitor_token('guess', 'n')}"}
    assert (await client.post("/registry/samples", json={}, headers=forged)).status_code == 401


async def test_non_ascii_authorization_is_a_401_not_a_500():
    assert check_admin_token(SETTINGS, "Bearer ädm") is not None
    client, _ = guarded()
    r = await client.get("/models", headers={"Authorization": "Bearer \u00e4dm".encode("latin-1")})
    assert r.status_code == 401


def sample(**kw) -> NodeSample:
    gpu = dict(id="n:gpu0", node_id="x", node_name="n", kind=DeviceKind.GPU, index=0, name="H100",
               uuid="GPU-1", total_bytes=80 * 2**30, used_bytes=2**30)
    devices = [Device(**{**gpu, **d}) for d in kw.pop("devices", [{}])]
    return NodeSample(**{"node_id": "x", "node_name": "n", "host_total_bytes": 2**36, "host_used_bytes": 2**34,
                         "cpu_count": 8, "devices": devices, **kw})


@pytest.mark.parametrize("bad, why", [
    ({"devices": [{"used_bytes": 90 * 2**30}]}, "used"),
    ({"devices": [{"total_bytes": 1200 * 2**30, "used_bytes": 0}]}, "1 TiB"),
    ({"devices": [{"used_bytes": -1}]}, "used"),
    ({"devices": [{}, {"id": "n:gpu1", "uuid": "GPU-2"}]}, "index appears twice"),
    ({"devices": [{}, {"id": "n:gpu1", "index": 1}]}, "uuid appears twice"),
    ({"devices": [{"node_name": "other", "id": "other:gpu0"}]}, "names node 'other'"),
    ({"devices": [{"fp16_tflops": float("nan")}]}, "finite"),
    ({"host_used_bytes": 2**37}, "host memory"),
    ({"devices": [{"driver_version": "580.65.06\u202e"}]}, "driver_version must be a version"),  # the planner compares it
    ({"devices": [{"cuda_driver_version": "99999999"}]}, "cuda_driver_version must be a version"),
    ({"cuda_runtime": "13.0 (trust me)"}, "cuda_runtime must be a version"),
])
def test_forged_samples_are_refused(bad, why):
    problems = sample_problems(sample(**bad))
    assert any(why in p for p in problems), problems


def test_an_honest_sample_passes():
    assert sample_problems(sample(devices=[{}, {"id": "n:gpu1", "index": 1, "uuid": "GPU-2"}])) == []
    drivers = {"driver_version": "580.65.06", "cuda_driver_version": "13.0", "cuda_runtime": "13.0"}
    assert sample_problems(sample(devices=[drivers], cuda_runtime="13.0")) == []
