"""How well the router's prefix judgement matches what vLLM itself finds in its prefix cache (issue 28).

The router cannot tokenize: it keys 256-byte blocks of the prompt as the chat template lays it out
(``serving/routing/prefix.py``) and takes a matched block for ~64 tokens. vLLM keys 128-token blocks
(on CPU) of the tokens themselves. A multi-turn chat on the tiny model, each turn resending the
conversation, is judged both ways: the router's index for one replica, replayed here on the same
bodies, against vLLM's own counters (``prefix_cache_stats``: prompt tokens looked up, found), read
from the engine's load report before and after.
"""

import httpx
import pytest

from hive_apps.serving.engine.http_server import LOAD_PATH, PREFIX_PATH, TOKEN_HEADER
from hive_apps.serving.routing.prefix import BYTES_PER_TOKEN, ROUTE_BLOCK_TOKENS, PrefixIndex, block_keys, prompt_bytes

pytestmark = pytest.mark.engine

SYSTEM = ("You are the hive's scheduler. Bees arrive with nectar; you assign each to a comb cell, keep the "
          "queen informed, and never let two bees take the same cell. Answer in short sentences. ") * 3
TURNS = 6


def engine_port():
    from ray import serve

    endpoint = serve.get_deployment_handle("engine-r0", app_name="tiny").endpoint.remote().result(timeout_s=30)
    assert endpoint is not None, "the engine replica has no HTTP port (HIVE_ENGINE_HTTP=0?)"
    return endpoint


def test_the_routers_prefix_judgement_against_vllms_own_prefix_cache_hits(hive, tiny):
    endpoint = engine_port()
    headers = {TOKEN_HEADER: endpoint.token}

    def counters() -> tuple[int, int]:
        load = httpx.get(endpoint.url + LOAD_PATH, headers=headers).json()
        return load["prefix_cache_queries_total"], load["prefix_cache_hits_total"]

    index = PrefixIndex({0: 1 << 16})  # one replica, room for everything: the router's view of it
    messages = [{"role": "system", "content": SYSTEM}]
    judged_hits = judged_tokens = prompt_tokens = 0
    before = counters()
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {turn}: which cell for bee {turn * 7}, and why?"})
        body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
        keys = block_keys(prompt_bytes(body))
        judged_hits += index.matches(keys, [0])[0] * ROUTE_BLOCK_TOKENS
        judged_tokens += len(prompt_bytes(body)) // BYTES_PER_TOKEN
        index.record(0, keys)
        r = httpx.post(endpoint.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    after = counters()
    queries, hits = after[0] - before[0], after[1] - before[1]
    assert queries == prompt_tokens, "vLLM looked up every prompt token of the turns once"
    judged, found = judged_hits / judged_tokens, hits / queries
    print(f"\n[figure] prefix judgement, {TURNS}-turn chat on the tiny model: the router judged {judged:.0%} of the "
          f"prompt cached (256-byte blocks, ~{judged_tokens} tokens estimated); vLLM found {found:.0%} "
          f"({hits} of {queries} tokens, 128-token blocks)")
    assert hits > 0 and judged_hits > 0, "both see the conversation's earlier turns cached"
    assert abs(judged - found) < 0.2, (judged, found)


@pytest.fixture(scope="module")
def pair(hive, tiny_model):
    """The tiny model on two replicas (both on the one CPU node), routed by prefix (the default)."""
    r = hive.deploy(model_id="tiny-pair", model=tiny_model, max_input_prompt_length=512, max_output_prompt_length=32,
                    replicas=2)
    assert r.status_code == 200, r.text
    yield r.json()
    assert hive.admin.delete("/models/tiny-pair").status_code == 200


def test_each_conversation_stays_on_its_replica_and_only_that_replicas_prefix_cache_hits(hive, pair):
    """Two conversations start at once on the model's route (so least-loaded puts them on different
    replicas); every later turn goes back to its conversation's replica by prefix, and vLLM's own hit
    counter rises on both replicas, each from its own conversation only."""
    import threading

    from ray import serve

    from tests.harness import API_KEY

    ports = [serve.get_deployment_handle(f"engine-r{i}", app_name="tiny-pair").endpoint.remote().result(timeout_s=30)
             for i in (0, 1)]

    def hits(i: int) -> tuple[int, int]:
        load = httpx.get(ports[i].url + LOAD_PATH, headers={TOKEN_HEADER: ports[i].token}).json()
        return load["prefix_cache_queries_total"], load["prefix_cache_hits_total"]

    talks = {name: [{"role": "system", "content": f"Conversation {name}. " + SYSTEM}] for name in "AB"}
    routed: dict[str, list[tuple[str, str]]] = {"A": [], "B": []}

    def turn(name: str, n: int) -> None:
        talks[name].append({"role": "user", "content": f"Turn {n}: which cell for bee {n * 7}?"})
        r = httpx.post(f"{hive.url}/tiny-pair/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "tiny-pair", "messages": talks[name], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        routed[name].append((r.headers["x-hive-replica"], r.headers["x-hive-route"]))
        talks[name].append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    before = [hits(0), hits(1)]
    first = [threading.Thread(target=turn, args=(name, 0)) for name in "AB"]
    for th in first:
        th.start()
    for th in first:
        th.join()
    for n in range(1, 4):
        for name in "AB":
            turn(name, n)
    after = [hits(0), hits(1)]
    homes = {name: routed[name][0][0] for name in "AB"}
    print(f"\n[figure] two conversations on two tiny replicas: {routed}; vLLM prefix hits per replica "
          f"{[a[1] - b[1] for a, b in zip(after, before)]} of {[a[0] - b[0] for a, b in zip(after, before)]} tokens")
    assert homes["A"] != homes["B"], routed
    for name in "AB":
        assert all(r == (homes[name], "prefix") for r in routed[name][1:]), routed
    assert all(a[1] > b[1] for a, b in zip(after, before)), (before, after)
    # each engine remembers what it was sent, keyed as routers key it: a router that starts reads it
    # (serving/engine/prefix_memory.py) and sends each conversation back to its replica
    held = [set(httpx.get(ports[i].url + PREFIX_PATH, headers={TOKEN_HEADER: ports[i].token}).json()) for i in (0, 1)]
    for name in "AB":
        sent = block_keys(prompt_bytes({"messages": talks[name][:-1]}))
        home = int(homes[name][1:])
        assert sent and set(sent) <= held[home] and not set(sent) & held[1 - home], name
