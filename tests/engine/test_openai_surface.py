"""The OpenAI surface through the hive, served by vLLM's own layer: logprobs, n, stop, seed,
lists of prompts, async and streaming SDK use, parse() with a pydantic model, base64
embeddings, and what Open WebUI calls. (Tool calls are not asserted: the random tiny model
does not reliably finish a call even under a named tool_choice.)"""

import asyncio
import base64
import struct
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.harness import openai_clients

pytestmark = pytest.mark.engine

CHAT = [{"role": "user", "content": "weather in Paris?"}]


def test_n_logprobs_stop_and_seed(hive, tiny):
    client = openai_clients(hive, "tiny")[0]
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2, logprobs=True, top_logprobs=2)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) >= 1 and len(choice.logprobs.content[0].top_logprobs) == 2
    a, b = (client.completions.create(model="tiny", prompt="import os", max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample
    first = a.choices[0].text.strip().split()[0] if a.choices[0].text.strip() else None
    if first:
        stopped = client.completions.create(model="tiny", prompt="import os", max_tokens=8, temperature=1.0,
                                            seed=7, stop=[first])
        assert first not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_list_of_prompts(hive, tiny):
    client = openai_clients(hive, "tiny")[1]
    out = client.completions.create(model="tiny", prompt=["one", "two", "three"], max_tokens=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]


def test_parse_with_a_pydantic_model(hive, tiny):
    class Answer(BaseModel):
        ok: bool
        color: Literal["red", "green"]

    client = openai_clients(hive, "tiny")[0]
    out = client.chat.completions.parse(model="tiny", messages=CHAT, response_format=Answer, max_tokens=40)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Answer)


def test_async_client_streams(hive, tiny):
    async def run():
        texts = []
        for client in openai_clients(hive, "tiny", async_=True):
            stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, stream=True)
            texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
            await client.close()
        return texts

    assert all(asyncio.run(run()))


def test_what_open_webui_calls(hive, tiny):
    """Open WebUI lists models, then streams a chat with the id it found."""
    import httpx

    from tests.harness import API_KEY

    headers = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{hive.url}/v1/models", headers=headers).json()
    assert models["object"] == "list" and "tiny" in [m["id"] for m in models["data"]]
    with httpx.stream("POST", f"{hive.url}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": "tiny", "stream": True, "messages": CHAT, "max_tokens": 4}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_embeddings_base64_matches_float(hive, tiny, minilm_path):
    r = hive.deploy(model_id="minilm-b64", model=minilm_path, max_input_prompt_length=128,
                    max_output_prompt_length=0, vllm_kwargs={"runner": "pooling"})
    assert r.status_code == 200, r.text
    client = openai_clients(hive, "minilm-b64")[0]
    floats = client.embeddings.create(model="minilm-b64", input="same text").data[0].embedding
    raw = client.with_raw_response.embeddings.create(model="minilm-b64", input="same text", encoding_format="base64")
    b64 = raw.http_response.json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(b64))
    assert len(decoded) == 384 and max(abs(x - y) for x, y in zip(decoded, floats)) < 1e-3
    assert hive.admin.delete("/models/minilm-b64").status_code == 200
