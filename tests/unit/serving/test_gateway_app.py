"""The gateway's request logic in-process: ``make_gateway_app`` on the in-memory cluster, a
registry and reconciler stepped by hand (``test_controller.Hive``), and sim engines serving
their own port for the routed requests. What the cluster tier checked of the gateway's HTTP
shapes (auth, body caps, OpenAI errors) runs here; real Serve stays there."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request

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
from tests.unit.helpers import recorded_publisher
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
    app = make_gateway_app(h.cluster, SETTINGS, publisher=recorded_publisher())
    h.gateway_app = app  # type: ignore[attr-defined]  # tests that change its settings
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


# --- the OpenAI surface: every route on both entries, forms, response ids, CORS --------------------
def echo_other_routes(sim: SimEngine) -> None:
    """The sim serves chat, completions and embeddings; every other route echoes what reached the
    engine, so a test sees the vLLM route a client's path was forwarded to."""

    @sim.app.api_route("/{rest:path}", methods=["GET", "POST"])
    async def echo(request: Request):
        body = await request.body()
        return {"method": request.method, "path": request.url.path, "query": request.url.query,
                "content_type": request.headers.get("content-type", ""), "bytes": len(body)}


@pytest.fixture
async def both(gateway, monkeypatch):
    """(the hive, one client per entry: the gateway at /v1, model m's router at /m), m served by an echoing sim."""
    from hive_apps.serving.routing import router as router_module

    h, gateway_client = gateway
    rec = await serving(h)
    echo_other_routes(h.cluster.sims[("m", 0)])
    monkeypatch.setattr(router_module, "get_settings", lambda: SETTINGS)
    router = router_module.Router("m", [h.cluster.engine_handle("m", 0)], rec.plan.replicas, 8)
    h.router = router

    async def app(scope, receive, send):
        await (await router.answer(Request(scope, receive)))(scope, receive, send)

    transport = httpx.ASGITransport(app=app, root_path="/m")
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://hive") as router_client:
            yield h, {"/v1": (gateway_client, ""), "/m": (router_client, "/m")}
    finally:
        router._follower.cancel()
        router._sets.keep_only(set())
        await asyncio.sleep(0.05)


GATEWAY_ROUTES = {  # what a client sends on /v1 -> the vLLM route it reaches
    "/v1/score": "/score", "/v1/rerank": "/rerank", "/v1/classify": "/classify",
    "/v1/tokenize": "/tokenize", "/v1/detokenize": "/detokenize",
}
ROUTER_ONLY = {"/score": "/score", "/rerank": "/rerank", "/v2/rerank": "/v2/rerank", "/classify": "/classify",
               "/tokenize": "/tokenize", "/detokenize": "/detokenize"}  # vLLM's names outside /v1: below /<model_id> only


async def test_each_route_reaches_its_vllm_route_on_both_entries(both):
    _, clients = both
    for entry, (client, prefix) in clients.items():
        table = {**GATEWAY_ROUTES, **(ROUTER_ONLY if entry == "/m" else {})}
        for path, vllm_route in table.items():
            r = await client.post(prefix + path, headers=AUTH, json={"model": "m", "prompt": "hi", "text_1": "a"})
            assert r.status_code == 200, (entry, path, r.text)
            assert r.json()["path"] == vllm_route and r.headers["x-hive-replica"], (entry, path)
            openai_shaped(await client.post(prefix + path, headers=AUTH, json={"prompt": "hi"}), 400, "model")
        r = await client.post(prefix + "/v1/embeddings", headers=AUTH, json={"model": "m", "input": "a"})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"], (entry, r.text)  # the sim's own route
    gateway_client, _ = clients["/v1"]
    err = openai_shaped(await gateway_client.post("/v1/pooling", headers=AUTH, json={"model": "m"}), 404)
    assert "/v1/tokenize" in err["message"] and "/v1/responses/{id}" in err["message"]  # says what is served
    router_client, _ = clients["/m"]
    openai_shaped(await router_client.post("/m/pooling", headers=AUTH, json={"model": "m"}), 404)


async def test_an_audio_form_is_routed_by_its_model_field_on_both_entries(both):
    _, clients = both
    audio = b"RIFF" + bytes(3 * 2**20)  # past the size parsed on the event loop
    for entry, (client, prefix) in clients.items():
        for route in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            r = await client.post(prefix + route, headers=AUTH, data={"model": "m", "language": "en"},
                                  files={"file": ("a.wav", audio, "audio/wav")})
            assert r.status_code == 200, (entry, r.text)
            echoed = r.json()
            assert echoed["path"] == route and echoed["content_type"].startswith("multipart/form-data; boundary=")
            assert echoed["bytes"] > len(audio)  # the form went on whole, boundary included
    gateway_client, _ = clients["/v1"]
    r = await gateway_client.post("/v1/audio/transcriptions", headers=AUTH, data={"language": "en"},
                                  files={"file": ("a.wav", b"RIFF", "audio/wav")})
    assert "multipart form" in openai_shaped(r, 400, "model")["message"]
    r = await gateway_client.post("/v1/audio/transcriptions", headers=AUTH, data={"model": "ghost"},
                                  files={"file": ("a.wav", b"RIFF", "audio/wav")})
    openai_shaped(r, 404, "model")
    big = b"x" * (MAX_BODY_BYTES + 1)
    r = await gateway_client.post("/v1/audio/transcriptions", headers=AUTH, data={"model": "m"},
                                  files={"file": ("a.wav", big, "audio/wav")})
    openai_shaped(r, 413)  # the body cap holds for forms


async def test_a_response_id_reaches_the_model_named_in_the_query_or_route(both):
    _, clients = both
    gateway_client, _ = clients["/v1"]
    r = await gateway_client.get("/v1/responses/resp_42?model=m&stream=false", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["path"] == "/v1/responses/resp_42" and "stream=false" in r.json()["query"]
    r = await gateway_client.post("/v1/responses/resp_42/cancel?model=m", headers=AUTH)
    assert r.status_code == 200 and r.json()["path"] == "/v1/responses/resp_42/cancel", r.text
    assert "?model=" in openai_shaped(await gateway_client.get("/v1/responses/resp_42", headers=AUTH), 400, "model")["message"]
    router_client, _ = clients["/m"]
    r = await router_client.get("/m/v1/responses/resp_42", headers=AUTH)
    assert r.status_code == 200 and r.json()["path"] == "/v1/responses/resp_42", r.text


async def test_cors_is_off_unless_origins_are_listed(gateway):
    _, client = gateway
    preflight = {"origin": "https://app.example.com", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type, x-stainless-os"}
    r = await client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers  # not a preflight answer
    r = await chat(client, "ghost")
    assert "access-control-allow-origin" not in r.headers and "vary" not in r.headers


async def test_listed_origins_get_preflights_and_readable_answers_on_both_entries(both):
    h, clients = both
    cors = SETTINGS.model_copy(update={"cors_origins": ["https://app.example.com"]})
    h.gateway_app.settings = h.router.settings = cors
    origin = {"origin": "https://app.example.com"}
    preflight = {**origin, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type, x-stainless-os"}
    for entry, (client, prefix) in clients.items():
        r = await client.options(prefix + "/v1/chat/completions", headers=preflight)  # no key: browsers send none
        assert r.status_code == 204, (entry, r.text)
        assert r.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "x-stainless-os" in r.headers["access-control-allow-headers"]  # the OpenAI JS SDK's own headers
        r = await client.options(prefix + "/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"})
        assert r.status_code == 403 and "HIVE_CORS_ORIGINS" in r.json()["error"]["message"], entry
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post(prefix + "/v1/chat/completions", headers={**AUTH, **origin}, json=body)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com", entry
        assert "x-hive-replica" in r.headers["access-control-expose-headers"] and r.headers["vary"] == "Origin"
        r = await client.post(prefix + "/v1/chat/completions", headers={**AUTH, "origin": "https://evil.example"}, json=body)
        assert "access-control-allow-origin" not in r.headers and r.headers["vary"] == "Origin", entry
        r = await client.get(prefix + "/v1/models", headers=origin)  # an error is readable by the page too
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example.com", entry


def test_cors_origins_are_origins():
    from hive_apps.core.settings import SettingsError

    assert HiveSettings(cors_origins="https://App.example.com/, http://localhost:3000,*").cors_origins == [
        "https://app.example.com", "http://localhost:3000", "*"]
    assert HiveSettings().cors_origins == []
    for bad in ("app.example.com", "https://app.example.com/chat", "ftp://x"):
        with pytest.raises((ValueError, SettingsError)):
            HiveSettings(cors_origins=bad)


# --- aliases -----------------------------------------------------------------------------------------
async def test_an_alias_reaches_its_model_on_both_entries_and_is_listed(both):
    """An alias is another name of the model on /v1 and /<model_id>/v1: listed as an entry of its own
    (its model as ``root``), served by the model's engines under the model's id, which the answer names
    (as vLLM names its first served name); it comes and goes with the record, engines untouched."""
    from hive_apps.core.state import transitions as t

    h, clients = both
    gateway_client, _ = clients["/v1"]
    router_client, _ = clients["/m"]
    rec = await h.registry.get_model("m")
    aliased = rec.spec.model_copy(update={"aliases": ["chat"]})
    assert (await h.registry.transition(t.Respec(model_id="m", version=rec.version, spec=aliased,
                                                 origin=rec.origin))).ok
    await asyncio.sleep(0.05)  # the long-polls bring the record

    listed = (await gateway_client.get("/v1/models", headers=AUTH)).json()["data"]
    assert [(m["id"], m.get("root")) for m in listed] == [("m", None), ("chat", "m")]
    one = (await gateway_client.get("/v1/models/chat", headers=AUTH)).json()
    assert (one["id"], one["root"], one["object"]) == ("chat", "m", "model")
    one = (await router_client.get("/m/v1/models/chat", headers=AUTH)).json()
    assert (one["id"], one["root"]) == ("chat", "m")

    r = await chat(gateway_client, "chat")
    assert r.status_code == 200 and r.json()["model"] == "m", r.text  # the sim, as vLLM, knows only its id
    r = await router_client.post("/m/v1/chat/completions", headers=AUTH,
                                 json={"model": "chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "m", r.text
    async with gateway_client.stream("POST", "/v1/completions", headers=AUTH,
                                     json={"model": "chat", "prompt": "hi", "max_tokens": 2, "stream": True}) as s:
        assert s.status_code == 200
        text = "".join([chunk async for chunk in s.aiter_text()])
    assert '"model": "m"' in text and text.rstrip().endswith("data: [DONE]")

    rec = await h.registry.get_model("m")
    assert (await h.registry.transition(t.Respec(model_id="m", version=rec.version,
                                                 spec=rec.spec.model_copy(update={"aliases": []}), origin=rec.origin))).ok
    await asyncio.sleep(0.05)
    assert "(models: m)" in openai_shaped(await chat(gateway_client, "chat"), 404, "model")["message"]
    openai_shaped(await router_client.get("/m/v1/models/chat", headers=AUTH), 404, "model")
    assert [m["id"] for m in (await gateway_client.get("/v1/models", headers=AUTH)).json()["data"]] == ["m"]
