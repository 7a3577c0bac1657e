"""A LoRA adapter's name on ``/v1``: the gateway routes it to its base's replicas with the name kept, the
engine replica loads the adapter on demand (the sim engine models LoRA: a load reads the adapter's files),
keeps at most max_cpu_loras loaded, and answers a failed load with an OpenAI-shaped error, never a hang."""

from __future__ import annotations

import asyncio
import shutil

import httpx

from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import AdapterRecord, ModelStatus
from hive_apps.core.weights.listing import list_source
from hive_apps.core.weights.source import parse_source
from hive_apps.models.tiny import build_tiny_lora
from hive_apps.serving.engine.protocol import ADAPTER_HEADER
from tests.unit.control.test_controller import MODEL
from tests.unit.core.test_lifecycle import idle_for
from tests.unit.serving import test_gateway_app
from tests.unit.serving.test_gateway_app import AUTH, chat, openai_shaped, serving

gateway = test_gateway_app.gateway  # the fixture: the gateway app on the in-memory hive, sim engines behind it


async def add_adapter(h, name: str, folder, base: str = "m") -> AdapterRecord:
    weights = list_source(parse_source(str(folder)))
    rec = AdapterRecord(model_id=name, base=base, source=str(folder), weights=weights, rank=8, alpha=16,
                        target_modules=["q_proj", "v_proj"])
    out = await h.registry.transition(t.CreateAdapter(model_id=name, record=rec))
    assert out.ok, out.message
    await asyncio.sleep(0.05)  # the gateway's long-poll brings it
    return out.adapter


def engine(h, model: str = "m"):
    return h.cluster.sims[(model, 0)]


async def test_an_adapter_is_served_by_its_bases_engine_and_listed_with_its_parent(gateway, tmp_path):
    h, client = gateway
    await serving(h, lora={"max_loras": 2, "max_lora_rank": 8})
    await add_adapter(h, "a1", build_tiny_lora(MODEL, tmp_path / "a1", rank=8))
    listed = {m["id"]: m for m in (await client.get("/v1/models", headers=AUTH)).json()["data"]}
    assert set(listed) == {"m", "a1"} and listed["a1"]["parent"] == "m" and "parent" not in listed["m"]
    one = (await client.get("/v1/models/a1", headers=AUTH)).json()
    assert one["parent"] == "m" and one["root"] == str(tmp_path / "a1")
    r = await chat(client, "a1")
    assert r.status_code == 200, r.text
    assert r.headers["x-hive-replica"] == "r0"
    cache = engine(h)._adapters
    assert cache is not None and list(cache.loaded) == ["a1"] and cache.loads == 1 and not cache.busy
    assert (await chat(client, "a1")).status_code == 200 and cache.loads == 1  # loaded once
    assert (await chat(client, "m")).status_code == 200  # the base itself, unchanged


async def test_more_adapters_than_max_cpu_loras_evict_the_least_recently_used(gateway, tmp_path):
    h, client = gateway
    await serving(h, lora={"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 2})
    for name in ("a1", "a2", "a3"):
        await add_adapter(h, name, build_tiny_lora(MODEL, tmp_path / name, rank=8))
    for name in ("a1", "a2", "a1", "a3", "a2"):
        r = await chat(client, name)
        assert r.status_code == 200, (name, r.text)
    cache = engine(h)._adapters
    assert cache is not None and cache.capacity == 2
    # a1 a2 | a1 (hit) | a3 evicts a2 | a2 evicts a1
    assert list(cache.loaded) == ["a3", "a2"] and cache.loads == 4 and cache.evictions == 2
    assert engine(h).info()["adapters"]["evictions"] == 2


async def test_a_failed_load_is_an_openai_error_and_is_not_tried_again_until_the_adapter_changes(gateway, tmp_path):
    h, client = gateway
    await serving(h, lora={"max_loras": 2, "max_lora_rank": 8})
    folder = build_tiny_lora(MODEL, tmp_path / "gone", rank=8)
    await add_adapter(h, "gone", folder)
    shutil.rmtree(folder)
    err = openai_shaped(await asyncio.wait_for(chat(client, "gone"), 10), 404, "model")
    assert "is not on this node" in err["message"]
    cache = engine(h)._adapters
    assert cache is not None and "gone" in cache.failed
    build_tiny_lora(MODEL, folder, rank=8)  # the files are back, but the adapter is the same deploy
    openai_shaped(await chat(client, "gone"), 404, "model")
    await h.registry.transition(t.DeleteAdapter(model_id="gone"))
    await add_adapter(h, "gone", folder)  # deployed again: another revision, tried again
    assert (await chat(client, "gone")).status_code == 200


async def test_a_deleted_adapter_is_a_404_and_its_engine_unloads_it(gateway, tmp_path):
    h, client = gateway
    await serving(h, lora={"max_loras": 2, "max_lora_rank": 8})
    await add_adapter(h, "a1", build_tiny_lora(MODEL, tmp_path / "a1", rank=8))
    assert (await chat(client, "a1")).status_code == 200
    assert (await h.registry.transition(t.DeleteAdapter(model_id="a1"))).ok
    await asyncio.sleep(0.05)
    err = openai_shaped(await chat(client, "a1"), 404, "model")
    assert "does not exist" in err["message"]
    assert await engine(h).unload_adapter("a1") and not engine(h)._adapters.loaded  # what DELETE asks of each engine


async def test_an_adapter_header_reaches_only_an_engine_with_lora_and_never_from_a_client(gateway, tmp_path):
    h, client = gateway
    await serving(h)  # no lora
    r = await client.post("/v1/chat/completions", headers={**AUTH, ADAPTER_HEADER: '{"model_id": "x"}'},
                          json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text  # a client's header never reaches the engine (only PASSED_HEADERS do)
    assert engine(h)._adapters is None


async def test_an_adapter_of_a_sleeping_base_wakes_it_and_is_loaded_after_the_wake(gateway, tmp_path):
    h, client = gateway
    await serving(h, sleep_timeout=5, lora={"max_loras": 2, "max_lora_rank": 8})
    await add_adapter(h, "a1", build_tiny_lora(MODEL, tmp_path / "a1", rank=8))
    h.lifecycle = h.reconciler.lifecycle
    idle_for(h, "m", 6)
    await h.lifecycle.tick(await h.registry.list_models())
    assert (await h.settle("m")).status is ModelStatus.SLEEPING
    del h.cluster.loads["m"]  # the replica set reads the sim engine's own load again
    await asyncio.sleep(0.05)
    assert "a1" in {m["id"] for m in (await client.get("/v1/models", headers=AUTH)).json()["data"]}  # still listed
    held = asyncio.create_task(chat(client, "a1"))
    await asyncio.sleep(0.2)
    assert not held.done() and (await h.registry.get_model("m")).status is ModelStatus.WAKING
    assert (await h.settle("m")).status is ModelStatus.READY
    r = await asyncio.wait_for(held, 5)
    assert r.status_code == 200, r.text
    assert "a1" in engine(h)._adapters.loaded


async def test_the_bases_own_route_serves_its_adapters_by_name(gateway, tmp_path, monkeypatch):
    from starlette.requests import Request

    from hive_apps.serving.routing import router as router_module

    h, _ = gateway
    rec = await serving(h, lora={"max_loras": 2, "max_lora_rank": 8})
    await add_adapter(h, "a1", build_tiny_lora(MODEL, tmp_path / "a1", rank=8))
    monkeypatch.setattr(router_module, "get_settings", lambda: test_gateway_app.SETTINGS)
    router = router_module.Router("m", [h.cluster.engine_handle("m", 0)], rec.plan.replicas, 8)

    async def app(scope, receive, send):
        await (await router.answer(Request(scope, receive)))(scope, receive, send)

    try:
        await asyncio.sleep(0.05)  # the router's long-poll brings the adapters of its model
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path="/m"), base_url="http://hive") as c:
            r = await c.post("/m/v1/chat/completions", headers=AUTH,
                             json={"model": "a1", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            assert list(engine(h)._adapters.loaded) == ["a1"]
    finally:
        router._follower.cancel()
        router._sets.keep_only(set())
        await asyncio.sleep(0.05)
