"""The gateway's request logic in-process: ``make_gateway_app`` on the in-memory cluster, a
registry and reconciler stepped by hand (``test_controller.Hive``), and sim engines serving
their own port for the routed requests. What the cluster tier checked of the gateway's HTTP
shapes (auth, body caps, OpenAI errors) runs here; real Serve stays there."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from hive_apps.control.cluster import set_cluster
from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import ModelStatus
from hive_apps.serving.engine.sim_engine import SimEngine
from hive_apps.serving.gateway.ingress import make_gateway_app
from hive_apps.serving.routing.http import MAX_BODY_BYTES
from tests.unit.control.test_controller import Hive
from tests.unit.core.test_lifecycle import idle_for, ready
from tests.unit.fake_cluster import FakeCluster, LocalHandle
from tests.unit.serving.test_engine_http import FakeHandle

KEY = "key-a"
AUTH = {"authorization": f"Bearer {KEY}"}
SETTINGS = HiveSettings(api_keys=[KEY], deploy_timeout_s=30, min_residency_s=0, drain_grace_s=0.2,
                        hold_timeout_s=5, hold_max_per_model=4)


class EngineHandle:
    """A model's engine as both sides see it: the admin's calls (info, sleep, wake, load for idleness)
    go to the fake cluster's engine; the routing calls (its port, forwarding) to a running SimEngine."""

    def __init__(self, admin_side: LocalHandle, sim: FakeHandle | None, loads_set: bool):
        self._admin, self._sim, self._loads_set = admin_side, sim, loads_set

    def __getattr__(self, name: str):
        if self._sim is not None and (name in ("endpoint", "forward", "forward_unary")
                                      or (name == "load" and not self._loads_set)):
            return getattr(self._sim, name)
        return getattr(self._admin, name)

    def options(self, **_):
        return self


class SimCluster(FakeCluster):
    def __init__(self, nodes: dict[str, str]):
        super().__init__(nodes)
        self.sims: dict[tuple[str, int], SimEngine] = {}

    async def start_sim(self, model_id: str, replica: ReplicaPlan) -> SimEngine:
        e = SimEngine.__new__(SimEngine)
        await e.__init__(model_id, "", replica, use_start_lock=False)
        self.sims[(model_id, replica.index)] = e
        return e

    def engine_handle(self, model_id: str, index: int):
        sim = self.sims.get((model_id, index))
        return EngineHandle(super().engine_handle(model_id, index), FakeHandle(sim) if sim else None,
                            model_id in self.loads)


@pytest.fixture
async def gateway():
    """(the hive on the in-memory cluster, a client of the gateway app built on it)."""
    h = Hive(SimCluster({"node-a": "L4"}))
    await h.start_registry()
    await h.sample()
    app = make_gateway_app(h.cluster, SETTINGS)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hive") as client:
            yield h, client
    finally:
        app.close()
        for e in h.cluster.sims.values():
            await e.http.stop()
        await asyncio.sleep(0.05)  # the replica sets close their connections
        set_cluster(None)


async def serving(h: Hive, model_id: str = "m", **spec):
    rec = await ready(h, model_id, **spec)
    await h.cluster.start_sim(model_id, rec.plan.replicas[0])
    await asyncio.sleep(0.05)  # the gateway's long-poll brings the record
    return rec


def chat(client: httpx.AsyncClient, model: str = "m", **extra):
    return client.post("/v1/chat/completions", headers=AUTH,
                       json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra})


def openai_shaped(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["code"] == status, err
    if param is not None:
        assert err["param"] == param, err
    return err


async def test_a_request_without_a_valid_key_is_a_401_in_openais_shape(gateway):
    _, client = gateway
    body = {"model": "x", "messages": []}
    err = openai_shaped(await client.post("/v1/chat/completions", json=body), 401)
    assert err["type"] == "AuthenticationError"
    openai_shaped(await client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"}), 401)
    openai_shaped(await client.get("/v1/models"), 401)  # the list too


async def test_a_body_over_the_cap_is_a_413_from_its_length_or_as_it_streams(gateway):
    _, client = gateway
    big = b"x" * (MAX_BODY_BYTES + 1)
    openai_shaped(await client.post("/v1/chat/completions", content=big, headers=AUTH), 413)

    async def chunked():
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b"y" * 2**20

    err = openai_shaped(await client.post("/v1/chat/completions", content=chunked(), headers=AUTH), 413)
    assert "MAX_BODY_BYTES" in err["message"]


async def test_bad_bodies_are_400s_and_unknown_names_404s(gateway):
    """From the cluster tier's test_openai_errors_on_v1, and more."""
    _, client = gateway
    r = await client.post("/v1/chat/completions", json={"model": "ghost", "messages": [{"role": "user", "content": "x"}]},
                          headers=AUTH)
    err = openai_shaped(r, 404, "model")
    assert err["type"] == "NotFoundError" and "none yet" in err["message"]
    openai_shaped(await client.post("/v1/chat/completions", content=b"not json", headers=AUTH), 400, "model")
    openai_shaped(await client.post("/v1/chat/completions", json={"messages": []}, headers=AUTH), 400, "model")
    openai_shaped(await client.post("/v1/chat/completions", content=b"[" * 100_000, headers=AUTH), 400)
    openai_shaped(await client.get("/v1/models/ghost", headers=AUTH), 404, "model")
    for path in ("/v1/unknown", "/hive/load", "/v1/../m/hive/load"):
        openai_shaped(await client.post(path, json={"model": "m"}, headers=AUTH), 404)


async def test_a_chat_is_routed_to_the_models_engine_and_listed(gateway):
    h, client = gateway
    await serving(h)
    listed = (await client.get("/v1/models", headers=AUTH)).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["m"]
    assert (await client.get("/v1/models/m", headers=AUTH)).json()["id"] == "m"
    r = await chat(client)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    openai_shaped(await chat(client, messages=[{"role": "wizard", "content": "x"}]), 400)  # checked before the engine
    async with client.stream("POST", "/v1/chat/completions", headers=AUTH,
                             json={"model": "m", "max_tokens": 2, "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in s.aiter_text()])
    assert text.rstrip().endswith("data: [DONE]")
    r = await chat(client, "other")
    assert "(models: m)" in openai_shaped(r, 404, "model")["message"]


async def test_a_request_for_a_sleeping_model_is_held_while_it_wakes(gateway):
    h, client = gateway
    await serving(h, sleep_timeout=5)
    h.lifecycle = h.reconciler.lifecycle
    idle_for(h, "m", 6)
    await h.lifecycle.tick(await h.registry.list_models())
    assert (await h.settle("m")).status is ModelStatus.SLEEPING
    del h.cluster.loads["m"]  # the replica set reads the sim engine's own load again
    await asyncio.sleep(0.05)  # the gateway's long-poll brings the sleeping record
    held = asyncio.create_task(chat(client))
    await asyncio.sleep(0.2)
    assert not held.done()
    assert (await h.registry.get_model("m")).status is ModelStatus.WAKING  # the held request asked for the wake
    rec = await h.settle("m")
    assert rec.status is ModelStatus.READY, rec.message
    r = await asyncio.wait_for(held, 5)
    assert r.status_code == 200, r.text
