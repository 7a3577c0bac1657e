"""Sleep, wake on request, swap and idle destroy through the real Serve apps, with the sim engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from hive_apps.core.planning.memory import CUDA_CONTEXT_BYTES
from tests.cluster.test_sim_hive import sim_spec
from tests.harness import API_KEY, OTHER_API_KEY

pytestmark = pytest.mark.cluster

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG = {"kv_cache_memory_bytes": 14 * 2**30}  # one such replica fills an L4
PARKS = {"sim_sleep_mode": False}  # an engine without sleep mode (as vLLM on CPU): it parks


def wait_status(hive, model_id: str, status: str, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        body = hive.admin.get(f"/models/{model_id}").json()
        if body.get("status") == status or time.time() > deadline:
            assert body.get("status") == status, body
            return body
        time.sleep(0.25)


def wait_parked(hive, model_id: str, timeout: float = 30.0) -> dict:
    """Sleeping and drained: its engines are gone and its memory released."""
    deadline = time.time() + timeout
    while (body := hive.admin.get(f"/models/{model_id}").json())["resident"]:
        assert time.time() < deadline, body
        time.sleep(0.2)
    return body


def chat(model_id: str, content: str = "hi", **kw) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": content}], "max_tokens": 3, **kw}


def test_idle_model_parks_and_requests_wake_it(clean):
    hive = clean
    r = hive.deploy(**sim_spec("nap", gpu="node-b:gpu0", sleep_timeout=1.5,
                               vllm_kwargs={"sim_tokens_per_s": 500, "sim_start_delay_s": 1.5, **PARKS}))
    assert r.status_code == 200, r.text
    assert httpx.post(f"{hive.url}/v1/chat/completions", json=chat("nap"), headers=AUTH, timeout=30).status_code == 200
    wait_status(hive, "nap", "sleeping")
    body = wait_parked(hive, "nap")
    assert body["sleep_mode"] == "parked" and body["resident"] is False
    gpu = hive.gpus()["node-b:gpu0"]
    assert gpu["reserved_bytes"] == 0 and gpu["dormant"] == ["nap/r0"]
    assert "nap" in hive.serve_apps()  # the route stays
    listed = httpx.get(f"{hive.url}/v1/models", headers=AUTH).json()["data"]
    assert "nap" in [m["id"] for m in listed]

    async def during_the_wake():
        async with httpx.AsyncClient(timeout=60) as client:
            async def stream() -> list[str]:
                async with client.stream("POST", f"{hive.url}/nap/v1/chat/completions", headers=AUTH,
                                         json=chat("nap", stream=True)) as resp:
                    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                    return [line async for line in resp.aiter_lines() if line]

            # two: one key may hold half of a gateway replica's share (HIVE_HOLD_MAX_PER_MODEL=8 here / 2 / 2)
            unary = [client.post(f"{hive.url}/v1/chat/completions", json=chat("nap", f"q{i}"), headers=AUTH)
                     for i in range(2)]
            return await asyncio.gather(stream(), *unary)

    lines, *answers = asyncio.run(during_the_wake())
    assert all(a.status_code == 200 and a.json()["choices"][0]["message"]["content"] for a in answers)
    assert any(line.startswith(": waiting for nap") for line in lines)  # keep-alives while it woke
    assert sum(1 for line in lines if line.startswith("data: {")) >= 3 and lines[-1] == "data: [DONE]"
    body = wait_status(hive, "nap", "ready")
    wake = body["last_wake"]
    assert wake["how"] == "parked" and wake["engine_start_s"] >= 1.5 and wake["total_s"] >= wake["engine_start_s"]
    assert hive.gpus()["node-b:gpu0"]["reserved_bytes"] > 0


def test_an_engine_with_sleep_mode_sleeps_in_place_and_wakes_there(clean):
    hive = clean
    r = hive.deploy(**sim_spec("doze", gpu="node-b:gpu0", sleep_timeout=1, vllm_kwargs={"sim_tokens_per_s": 500}))
    assert r.status_code == 200, r.text
    engine_start = r.json()["replicas"]["r0"]["engine_start_s"]
    body = wait_parked(hive, "doze")  # not resident: its device memory is free
    assert body["sleep_mode"] in ("level1", "level2"), body  # level 1 when this box's RAM can take the weights
    gpu = hive.gpus()["node-b:gpu0"]
    # what a sleeping engine still holds stays booked: its CUDA context and its graph pool (the sim
    # engine holds what memory.sleep_residual_bytes plans; a wake books only the rest)
    kept = CUDA_CONTEXT_BYTES + body["replicas"]["r0"]["memory"]["cuda_graphs"]
    assert gpu["reserved_bytes"] == kept > 0 and gpu["dormant"] == ["doze/r0"]
    from ray import serve

    assert "engine-r0" in serve.status().applications["doze"].deployments  # the engine stays, asleep
    host = {n["node_name"]: n["host_reserved_bytes"] for n in hive.admin.get("/nodes").json()["nodes"]}
    assert (host["node-b"] > 0) == (body["sleep_mode"] == "level1")

    async def during_the_wake():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{hive.url}/doze/v1/chat/completions", json=chat("doze", f"q{i}"),
                                                      headers=AUTH) for i in range(3)))

    assert all(a.status_code == 200 and a.json()["choices"][0]["message"]["content"] for a in asyncio.run(during_the_wake()))
    level = body["sleep_mode"]
    body = wait_status(hive, "doze", "ready")
    assert body["last_wake"]["how"] == level
    assert body["replicas"]["r0"]["engine_start_s"] == engine_start  # the same engine: it never started again
    assert hive.gpus()["node-b:gpu0"]["reserved_bytes"] > 0
    assert sum(n["host_reserved_bytes"] for n in hive.admin.get("/nodes").json()["nodes"]
               if n["node_name"] == "node-b") == 0


def test_hold_queue_is_bounded(clean):
    hive = clean
    hive.deploy(**sim_spec("crowd", gpu="node-b:gpu0", sleep_timeout=1,
                           vllm_kwargs={"sim_tokens_per_s": 500, "sim_start_delay_s": 4, **PARKS}))
    wait_parked(hive, "crowd")

    async def crowd(key: str, n: int):
        async with httpx.AsyncClient(timeout=60) as client:
            # the model's own route: its one router holds all of HIVE_HOLD_MAX_PER_MODEL (the gateway's
            # replicas share it, each holding its part: tests/unit/serving/test_gateway_bounds.py)
            return await asyncio.gather(*(client.post(f"{hive.url}/crowd/v1/chat/completions", json=chat("crowd"),
                                                      headers={"Authorization": f"Bearer {key}"}) for _ in range(n)))

    async def two_clients():
        return await asyncio.gather(crowd(API_KEY, 6), crowd(OTHER_API_KEY, 6))

    mine, theirs = ([r.status_code for r in rs] for rs in asyncio.run(two_clients()))
    # HIVE_HOLD_MAX_PER_MODEL=8 in tests/cluster/conftest.py: 8 wait, and one key at most half of them
    assert sorted(mine) == sorted(theirs) == [200] * 4 + [429] * 2


def test_two_models_that_cannot_coreside_swap_on_one_gpu(clean):
    hive = clean
    one = sim_spec("swap-a", gpu="node-b:gpu1", sleep_timeout=600, vllm_kwargs={"sim_tokens_per_s": 500, **BIG})
    two = sim_spec("swap-b", gpu="node-b:gpu1", sleep_timeout=600, vllm_kwargs={"sim_tokens_per_s": 500, **BIG})
    assert hive.deploy(**one).status_code == 200
    time.sleep(3.2)  # past the minimum residency (3 s here)
    r = hive.deploy(**two)
    assert r.status_code == 200, r.text  # room was made: swap-a went to sleep
    a = hive.admin.get("/models/swap-a").json()
    assert a["status"] == "sleeping" and "evicted to make room for swap-b" in a["sleep_reason"]
    # swap-a is asked for: it waits out swap-b's minimum residency, then swap-b is evicted
    r = httpx.post(f"{hive.url}/v1/chat/completions", json=chat("swap-a"), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    a = wait_status(hive, "swap-a", "ready")
    assert a["last_wake"]["evicted"] == ["swap-b"]
    assert hive.admin.get("/models/swap-b").json()["status"] == "sleeping"
    assert hive.gpus()["node-b:gpu1"]["replicas"] == ["swap-a/r0"]


def test_pinned_resident_model_is_not_evicted_and_the_deploy_says_who_holds_the_memory(clean):
    hive = clean
    keep = sim_spec("keeper", gpu="node-b:gpu1", sleep_timeout=600, keep_resident=True,
                    vllm_kwargs={"sim_tokens_per_s": 500, **BIG})
    assert hive.deploy(**keep).status_code == 200
    r = hive.deploy(**sim_spec("newcomer", gpu="node-b:gpu1", vllm_kwargs={"sim_tokens_per_s": 500, **BIG}))
    assert r.status_code == 503 and "keeper (keep_resident)" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    assert hive.admin.get("/models/keeper").json()["status"] == "ready"


def test_idle_destroy_frees_memory_and_requests_learn_why(clean):
    hive = clean
    hive.deploy(**sim_spec("brief", gpu="node-b:gpu2", idle_timeout=1))
    body = wait_status(hive, "brief", "destroyed")
    assert "idle_timeout 1s" in body["message"]
    assert hive.gpus()["node-b:gpu2"]["reserved_bytes"] == 0
    assert "brief" not in hive.wait_app_gone("brief")
    r = httpx.post(f"{hive.url}/v1/chat/completions", json=chat("brief"), headers=AUTH, timeout=30)
    assert r.status_code == 404 and "destroyed" in r.json()["error"]["message"]
    assert hive.deploy(**sim_spec("brief", gpu="node-b:gpu2")).status_code == 200  # the memory is free again


def park(hive, model_id: str, **spec) -> None:
    assert hive.deploy(**sim_spec(model_id, sleep_timeout=1, **spec)).status_code == 200
    wait_parked(hive, model_id)


@pytest.mark.parametrize("app", ["hive-admin", "hive-registry"])
def test_a_control_plane_kill_during_a_wake_loses_no_held_request(clean, app):
    import ray

    hive = clean
    park(hive, "steady", gpu="node-b:gpu0", vllm_kwargs={"sim_tokens_per_s": 500, "sim_start_delay_s": 3, **PARKS})

    async def held_while_killed():
        async with httpx.AsyncClient(timeout=120) as client:
            asks = [asyncio.create_task(client.post(f"{hive.url}/v1/chat/completions", json=chat("steady", f"q{i}"),
                                                    headers=AUTH)) for i in range(2)]
            # two, not more: one key may hold half of a gateway replica's share (8 / 2 replicas / 2)
            await asyncio.sleep(1.0)
            actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{app}#" in a["name"]]
            ray.kill(ray.get_actor(actors[0], namespace="serve"), no_restart=True)
            return await asyncio.gather(*asks)

    answers = asyncio.run(held_while_killed())
    for a in answers:  # served, or a clean OpenAI error; never a 500 or a hang
        assert a.status_code == 200 or (a.status_code == 503 and a.json()["error"]["message"]), a.text
    assert sum(a.status_code == 200 for a in answers) >= 1, [a.text for a in answers]
    wait_status(hive, "steady", "ready", timeout=90)


def test_delete_lets_in_flight_requests_finish(clean):
    hive = clean
    assert hive.deploy(**sim_spec("leaving", gpu="node-b:gpu0", vllm_kwargs={"sim_tokens_per_s": 20})).status_code == 200

    async def stream_then_delete():
        async with httpx.AsyncClient(timeout=60) as client:
            async def streamed() -> list[str]:
                async with client.stream("POST", f"{hive.url}/v1/chat/completions", headers=AUTH,
                                         json=chat("leaving", max_tokens=40, stream=True)) as resp:
                    return [line async for line in resp.aiter_lines() if line]

            stream = asyncio.create_task(streamed())
            await asyncio.sleep(0.5)
            deleted = await asyncio.to_thread(hive.admin.delete, "/models/leaving")
            return await stream, deleted

    lines, deleted = asyncio.run(stream_then_delete())
    assert deleted.status_code == 200
    assert lines[-1] == "data: [DONE]" and sum(line.startswith("data: {") for line in lines) >= 40


def test_load_adds_a_replica_and_its_end_removes_it(clean):
    hive = clean
    spec = sim_spec("elastic", max_replicas=2, vllm_kwargs={"sim_tokens_per_s": 20, "max_num_seqs": 2})
    assert hive.deploy(**spec).status_code == 200

    async def load_for(seconds: float) -> list[int]:
        codes: list[int] = []
        end = time.time() + seconds
        async with httpx.AsyncClient(timeout=60) as client:
            async def worker():
                while time.time() < end:
                    r = await client.post(f"{hive.url}/v1/chat/completions", json=chat("elastic", max_tokens=20),
                                          headers=AUTH)
                    codes.append(r.status_code)
                    if r.status_code not in (200, 429):
                        odd.append(r.text)

            await asyncio.gather(*(worker() for _ in range(6)))
        return codes

    odd: list[str] = []
    codes = asyncio.run(load_for(8))
    assert set(codes) <= {200, 429} and codes.count(200) > 0, odd
    body = hive.admin.get("/models/elastic").json()
    assert set(body["replicas"]) == {"r0", "r1"}, body  # every replica was full for the window (1 s here)
    deadline = time.time() + 30
    while set((body := hive.admin.get("/models/elastic").json())["replicas"]) != {"r0"}:
        assert time.time() < deadline, body
        time.sleep(0.5)
    assert body["status"] == "ready" and "scaled down" in body["message"]
    held = [d for d in hive.gpus().values() if any(r.startswith("elastic/") for r in d["replicas"])]
    assert len(held) == 1 and held[0]["replicas"] == ["elastic/r0"] or "elastic/r1" not in held[0]["replicas"]
