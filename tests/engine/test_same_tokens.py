"""The hive passes vLLM's answer through unchanged: ``/v1`` and the engine itself give the same tokens.

The engine "itself" is the replica's own port (``serving/engine/http_server.py``), reached the way the
router and the gateway reach it: the address and token from ``endpoint()`` on the replica's
Serve handle. Greedy decoding, so both requests must produce the same token ids. Not a speed
check: speed lives in ``benchmarks/bench_vs_vllm.py``.
"""

import json
import time

import httpx
import pytest

from hive_apps.serving.edge.config import EDGE_HEADER
from hive_apps.serving.engine.http_server import LOAD_PATH, TOKEN_HEADER
from tests.harness import API_KEY, edge_warm

pytestmark = pytest.mark.engine


def streamed_tokens(url: str, headers: dict, via_edge: bool = False) -> tuple[list[int], str]:
    """Token ids and text of one streamed greedy chat, read from vLLM's SSE chunks. ``via_edge``: the
    answer must have come through the edge's HAProxy from the engine, not through the Serve path."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count the bees in the hive."}],
            "max_tokens": 16, "temperature": 0, "stream": True, "return_token_ids": True}
    ids, text, done = [], "", False
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert (r.headers.get(EDGE_HEADER) == "1") == via_edge, r.headers
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
                text += choice.get("delta", {}).get("content") or ""
    assert done, "the stream ended without [DONE]"
    return ids, text


def engine_port():
    from ray import serve

    endpoint = serve.get_deployment_handle("engine-r0", app_name="tiny").endpoint.remote().result(timeout_s=30)
    assert endpoint is not None, "the engine replica has no HTTP port (HIVE_ENGINE_HTTP=0?)"
    return endpoint


def test_every_route_streams_the_engines_own_tokens(hive, tiny):
    """Serve's ingress (``/v1`` through the gateway, ``/tiny/v1`` through the router) and the edge
    (both routes, bytes straight from the engine's port) all give the engine's own answer."""
    endpoint = engine_port()
    direct_ids, direct_text = streamed_tokens(f"{endpoint.url}/v1/chat/completions", {TOKEN_HEADER: endpoint.token})
    assert len(direct_ids) == 16
    key = {"Authorization": f"Bearer {API_KEY}"}
    edge_warm(hive, "tiny")
    for base, via_edge in ((hive.url, False), (hive.edge_url, True)):
        for route in ("/v1/chat/completions", "/tiny/v1/chat/completions"):
            assert streamed_tokens(base + route, key, via_edge) == (direct_ids, direct_text), (base, route)


@pytest.mark.parametrize("route", ["serve /v1", "edge /v1", "edge /tiny/v1"])
def test_a_client_that_leaves_mid_stream_frees_the_engines_slot(hive, tiny, route):
    """The engine stops generating for a client that went away: its running count goes back to 0
    long before the 128 tokens the request asked for are made."""
    endpoint = engine_port()

    def load() -> dict:
        return httpx.get(endpoint.url + LOAD_PATH, headers={TOKEN_HEADER: endpoint.token}).json()

    edge_warm(hive, "tiny")
    before = load()["generation_tokens_total"]
    base = hive.url if route.startswith("serve") else hive.edge_url
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hum."}], "max_tokens": 128,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + route.split(" ")[1] + "/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        assert (r.headers.get(EDGE_HEADER) == "1") == route.startswith("edge")
        next(r.iter_lines())  # the first chunk: the engine is generating; then the client leaves
    deadline = time.monotonic() + 15
    while (now := load())["running"] or now["waiting"]:
        assert time.monotonic() < deadline, f"the engine still runs the abandoned request: {now}"
        time.sleep(0.1)
    time.sleep(1.0)  # the stat logger's last counts
    made = load()["generation_tokens_total"] - before
    assert made < 64, f"{made} tokens made for a client that left after the first chunk"
