"""Prefix affinity that outlives a router: each engine keeps the prompt blocks it was sent, keyed as the
routers key them (``serving/engine/prefix_memory.py``), and a replica set that starts reads them
(``ReplicaSet._learn``), over the engine's port or over Serve."""

import asyncio
import json

import aiohttp
import pytest

from hive_apps.core.settings import HiveSettings
from hive_apps.serving.engine.http_server import PREFIX_PATH, TOKEN_HEADER
from hive_apps.serving.engine.prefix_memory import note
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.routing.prefix import PREFIX, BlockLRU, block_keys, prompt_bytes
from hive_apps.serving.routing.replica_set import ReplicaSet
from tests.unit.helpers import routing
from tests.unit.serving.test_engine_http import FakeHandle, engine

SYSTEM = "You keep the hive's ledger of cells and bees, and answer briefly. " * 12  # ~12 route blocks


def chat(*turns: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": t} for t in turns]
    return {"model": "sim-model", "max_tokens": 2, "messages": messages}


def test_an_lru_learns_anothers_keys_as_older_than_its_own_within_its_capacity():
    lru = BlockLRU(4)
    lru.touch([10, 11])  # its own: [11, 10] oldest first (leaf first)
    lru.extend([1, 2, 3, 10])  # the engine's, oldest first; 10 is already its own
    assert list(lru.keys) == [2, 3, 11, 10], "the engine's oldest go first; its own stay newest"
    assert BlockLRU(8).matched([1, 2]) == 0


def test_a_request_is_noted_with_the_keys_a_router_gives_it_an_adapters_chained_from_its_name(monkeypatch):
    from types import SimpleNamespace

    from hive_apps.serving.engine import prefix_memory

    body = chat("Which cell?")
    memory = BlockLRU(1000)
    note(memory, json.dumps(body).encode(), {"headers": []})
    assert set(memory.keys) == set(block_keys(prompt_bytes(body))) and memory.keys
    adapter = BlockLRU(1000)
    monkeypatch.setattr(prefix_memory, "adapter_ref", lambda scope: SimpleNamespace(model_id="bees-lora"))
    note(adapter, json.dumps(body).encode(), {"headers": []})  # (the adapter header, as the router marks it)
    assert set(adapter.keys) == set(block_keys(prompt_bytes(body), seed="bees-lora"))
    assert adapter.keys and not set(adapter.keys) & set(memory.keys), "a base's blocks are no adapter's"
    note(memory, b"not json", {"headers": []})  # vLLM answers that itself; nothing noted, nothing raised
    note(memory, b"[1, 2]", {"headers": []})


async def test_the_engine_notes_every_generate_request_and_says_so_on_its_port_without_counting_it():
    e = await engine(sim_tokens_per_s=5000)
    body = chat("Which cell for bee 7?")
    endpoint = e.endpoint()
    headers = {TOKEN_HEADER: endpoint.token}
    async with aiohttp.ClientSession() as s:
        async with s.post(endpoint.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
        taken = e.requests_total
        async with s.get(endpoint.url + PREFIX_PATH, headers=headers) as r:
            assert r.status == 200
            keys = await r.json()
        async with s.get(endpoint.url + PREFIX_PATH) as r:
            assert r.status == 403, "the replica's token guards it as every path"
    assert set(keys) == set(block_keys(prompt_bytes(body))) and keys
    assert e.requests_total == taken, "reading it is not a request (the idle clock does not move)"
    # the Serve path notes too, and the Serve transport reads the same
    await e.forward_unary(ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                                           body=json.dumps(chat("Another question")).encode()))
    assert set(block_keys(prompt_bytes(chat("Another question")))) <= set(e.prefix_keys())
    await e.http.stop()


@pytest.mark.parametrize("engine_http", [True, False])
async def test_a_replica_set_that_starts_sends_a_conversation_back_to_the_replica_that_holds_it(engine_http):
    engines = [await engine(i, max_num_seqs=8, sim_tokens_per_s=5000) for i in range(2)]
    handles = {i: FakeHandle(e) for i, e in enumerate(engines)}

    def new_set() -> ReplicaSet:
        return ReplicaSet("sim-model", handles, [e.replica for e in engines], queue_bound=8,
                          **routing(HiveSettings(engine_http=engine_http)))

    async def turn(rs: ReplicaSet, body: dict) -> tuple[str, str]:
        req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                               body=json.dumps(body).encode())
        start, _ = await rs.call(req, body)
        assert start.status == 200
        h = dict(start.headers)
        return h["x-hive-replica"], h["x-hive-route"]

    first = new_set()
    await first._refresh()
    first.views[0].in_flight = 1  # r0 busy: the conversation starts on r1 (least loaded)
    where, _ = await turn(first, chat("Turn 1"))
    assert where == "r1"
    first.close()

    restarted = new_set()  # a router restart: it sent nothing yet
    assert restarted.prefixes.matches(block_keys(prompt_bytes(chat("Turn 1", "Turn 2"))), [0, 1]) == {0: 0, 1: 0}
    await restarted._refresh()  # reaches both replicas, and reads what their engines were sent
    for _ in range(50):
        if restarted._learnt == {0, 1} and not restarted._learning:
            break
        await asyncio.sleep(0.02)
    assert await turn(restarted, chat("Turn 1", "Turn 2")) == ("r1", PREFIX), "back where its blocks are"
    restarted.close()
    await asyncio.sleep(0)
    for e in engines:
        await e.http.stop()
