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

from hive_apps.serving.engine.http_server import TOKEN_HEADER
from tests.harness import API_KEY

pytestmark = pytest.mark.engine


def streamed_tokens(url: str, headers: dict) -> tuple[list[int], str]:
    """Token ids and text of one streamed greedy chat, read from vLLM's SSE chunks."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count the bees in the hive."}],
            "max_tokens": 16, "temperature": 0, "stream": True, "return_token_ids": True}
    ids, text, done = [], "", False
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
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


def test_v1_stream_gives_the_engines_own_tokens(hive, tiny):
    from ray import serve

    endpoint = serve.get_deployment_handle("engine-r0", app_name="tiny").endpoint.remote().result(timeout_s=30)
    assert endpoint is not None, "the engine replica has no HTTP port (HIVE_ENGINE_HTTP=0?)"
    direct_ids, direct_text = streamed_tokens(f"{endpoint.url}/v1/chat/completions", {TOKEN_HEADER: endpoint.token})
    via_ids, via_text = streamed_tokens(f"{hive.url}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"})
    assert len(direct_ids) == 16
    assert via_ids == direct_ids
    assert via_text == direct_text


def test_the_engines_counters_reach_the_admin(hive, tiny):
    """vLLM's own stats (tokens, time to first token) reach the load the admin's history reads."""
    streamed_tokens(f"{hive.url}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"})
    deadline, load = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        load = hive.admin.get("/load").json()["models"].get("tiny", {}).get("r0", {})
        if load.get("generation_tokens_total", 0) >= 16:
            break
        time.sleep(1)
    assert load["generation_tokens_total"] >= 16 and load["prompt_tokens_total"] > 0, load
    ttft = load["ttft"]
    assert ttft["count"] >= 1 and ttft["sum_s"] > 0 and 1 <= ttft["buckets"][-1] <= ttft["count"], ttft
