"""The edge end to end, in-process: the gateway's decision (``edge_choice``) on the in-memory hive,
the real HAProxy and Lua in front (``serving/edge``), sim engines serving their own token-guarded
ports, and the same gateway app as "Serve's ingress" behind the edge for what it declines."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from hive_apps.core.state.records import ModelStatus
from hive_apps.serving.edge.config import EdgeConfig
from hive_apps.serving.edge.process import EdgeUnavailable, haproxy_binary
from hive_apps.serving.edge.service import start_edge
from hive_apps.serving.engine.http_server import serve_on
from tests.unit.core.test_lifecycle import idle_for
from tests.unit.serving.test_gateway_app import AUTH, gateway, openai_shaped, serving  # noqa: F401  # fixture

try:
    haproxy_binary()
except EdgeUnavailable:  # pragma: no cover - ray[serve] on Linux brings one
    pytest.skip("no haproxy binary", allow_module_level=True)

CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _bound() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture
async def edge(gateway):  # noqa: F811  # the fixture imported above
    """(the hive, its gateway app, a client of the edge in front of it)."""
    h, _ = gateway
    app = h.gateway_app
    sock = _bound()  # the gateway app as Serve's ingress: what the edge declines is answered by it
    serve, serving_task = await serve_on(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False), sock)
    port_sock = _bound()
    port = port_sock.getsockname()[1]
    port_sock.close()
    edge = await start_edge(EdgeConfig(port=port, serve_addr=f"127.0.0.1:{sock.getsockname()[1]}",
                                       read_timeout_s=30), app.edge_choice)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
            yield h, app, client
    finally:
        await edge.stop()
        serve.should_exit = True
        await serving_task


async def _routable(app, model_id: str = "m") -> None:
    """Until the gateway's replica set has learnt the engine's port (its first load poll)."""
    for _ in range(100):
        replicas = app.replicas_of(app._records[model_id])
        if all(replicas.endpoints.values()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine port was never learnt")


async def test_a_chat_goes_from_the_edge_to_the_engine_and_is_counted_there(edge):
    h, app, client = edge
    await serving(h)
    await _routable(app)
    r = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-hive-replica"] == "r0" and r.headers["x-hive-route"] == "least-loaded"
    assert r.headers["x-hive-edge"] == "1"
    routed = app.publisher.backend.total("hive_edge_routed", model="m")
    assert routed == 1
    assert app.publisher.backend.total("hive_requests", model="m") == 0  # the gateway relayed nothing
    async with client.stream("POST", "/m/v1/chat/completions", headers=AUTH, json={**CHAT, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in s.aiter_text()])
    assert text.rstrip().endswith("data: [DONE]")
    assert app.publisher.backend.total("hive_edge_routed", model="m") == 2


async def test_the_edges_picks_count_as_load_until_a_poll_sees_them(edge):
    h, app, _ = edge
    await serving(h)
    await _routable(app)
    replicas = app.replicas_of(app._records["m"])
    view = replicas.views[0]
    before = view.load
    assert replicas.pick("/v1/chat/completions", b"{}", {}) is not None
    assert view.load == before + 1
    await replicas._refresh()
    assert view.edge_sent == [] and view.load == before  # the engine's own counts have it now (or it ended)


async def test_what_the_gateway_declines_is_answered_on_the_serve_path(edge):
    h, app, client = edge
    await serving(h)
    await _routable(app)
    openai_shaped(await client.post("/v1/chat/completions", json=CHAT), 401)
    openai_shaped(await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=AUTH), 404, "model")
    openai_shaped(await client.post("/v1/chat/completions", headers=AUTH,
                                    json={**CHAT, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    r = await client.get("/v1/models", headers=AUTH)
    assert [m["id"] for m in r.json()["data"]] == ["m"]
    assert app.publisher.backend.total("hive_edge_routed") == 0


async def test_a_request_for_a_sleeping_model_is_held_on_the_serve_path_while_it_wakes(edge):
    h, app, client = edge
    await serving(h, sleep_timeout=5)
    await _routable(app)
    h.lifecycle = h.reconciler.lifecycle
    idle_for(h, "m", 6)
    await h.lifecycle.tick(await h.registry.list_models())
    assert (await h.settle("m")).status is ModelStatus.SLEEPING
    del h.cluster.loads["m"]
    await asyncio.sleep(0.05)
    held = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
    await asyncio.sleep(0.2)
    assert not held.done()
    rec = await h.settle("m")
    assert rec.status is ModelStatus.READY, rec.message
    r = await asyncio.wait_for(held, 10)
    assert r.status_code == 200, r.text
    assert "x-hive-route" in r.headers
