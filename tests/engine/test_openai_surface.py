"""The OpenAI surface through the hive, served by vLLM's own layer: logprobs, n, stop, seed,
lists of prompts, async and streaming SDK use, parse() with a pydantic model, tool calls,
reasoning content, base64 embeddings, LangChain, and what Open WebUI calls.

Tool calls use ``strict`` tools whose arguments are enums: vLLM 0.32 (hermes parser)
constrains a named or required call with a structural tag and pins the argument schema of
strict tools, and with only enum values even a random model must finish a valid call
within a few tokens. (Without ``strict`` the arguments are only held to be JSON.) The
structural tag lets JSON whitespace through, which a random model would pad forever, so
tool requests carry a logit_bias that rules out whitespace-only tokens, and room enough
(200 tokens: the tiny vocabulary spends about one token per character) to close the call."""

import asyncio
import base64
import json
import struct
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.harness import openai_clients

pytestmark = pytest.mark.engine

CHAT = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def no_padding(tiny_model) -> dict[str, int]:
    """logit_bias against every whitespace-only token of the tiny model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    return {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip() and i not in tok.all_special_ids}


def valid_call(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return args["city"] in ("Paris", "Rome") and args["unit"] in ("c", "f")
    return name == "get_time" and args["city"] in ("Paris", "Rome")


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


def test_named_tool_choice_returns_a_valid_call(hive, tiny, no_padding):
    for client in openai_clients(hive, "tiny"):
        out = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice=NAMED,
                                             max_tokens=200, logit_bias=no_padding)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and valid_call(call.function.name, call.function.arguments)


def test_auto_tool_choice_on_a_deploy_that_named_no_parser(hive, tiny, no_padding):
    """vLLM answers tool_choice='auto' with a 400 unless auto tool choice and a parser are on: the hive chose them."""
    assert any("tool_call_parser='hermes' chosen" in n for n in tiny["notes"]), tiny["notes"]
    for client in openai_clients(hive, "tiny"):
        out = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="auto",
                                             max_tokens=16, logit_bias=no_padding)
        choice = out.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        for call in choice.message.tool_calls or []:  # a random model seldom calls, but any call is parsed
            assert call.function.name in ("get_weather", "get_time")


def test_required_and_none_tool_choice(hive, tiny, no_padding):
    client = openai_clients(hive, "tiny")[0]
    out = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, logit_bias=no_padding)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and valid_call(calls[0].function.name, calls[0].function.arguments)
    out = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert not out.choices[0].message.tool_calls


def test_streamed_tool_call_arguments_add_up(hive, tiny, no_padding):
    client = openai_clients(hive, "tiny")[1]
    stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], tool_choice=NAMED,
                                            max_tokens=200, stream=True, logit_bias=no_padding)
    names, arguments = set(), ""
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function.name:
                names.add(call.function.name)
            arguments += call.function.arguments or ""
    assert names == {"get_weather"} and valid_call("get_weather", arguments)


def test_reasoning_is_split_out_when_the_deploy_names_a_parser(hive, tiny, tiny_model):
    from transformers import AutoTokenizer

    r = hive.deploy(model_id="tiny-think", model=tiny_model, max_input_prompt_length=256, max_output_prompt_length=32,
                    vllm_kwargs={"reasoning_parser": "deepseek_r1"})
    assert r.status_code == 200, r.text
    end_think = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("</think>")
    # With </think> forbidden the model never stops thinking: everything it writes is reasoning.
    ask = dict(messages=CHAT, max_tokens=6, temperature=0, logit_bias={str(end_think): -100})
    think = openai_clients(hive, "tiny-think")[0].chat.completions.create(model="tiny-think", **ask).choices[0].message
    reasoning = (think.model_extra or {}).get("reasoning") or (think.model_extra or {}).get("reasoning_content")
    assert reasoning and not think.content
    # The same request to the deploy without a parser: the same words, as content.
    plain = openai_clients(hive, "tiny")[0].chat.completions.create(model="tiny", **ask).choices[0].message
    assert plain.content and not (plain.model_extra or {}).get("reasoning")
    stream = openai_clients(hive, "tiny-think")[1].chat.completions.create(model="tiny-think", stream=True, **ask)
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in stream if c.choices)
    assert streamed == reasoning
    assert hive.admin.delete("/models/tiny-think").status_code == 200


def test_langchain_chat_openai(hive, tiny, no_padding):
    from langchain_openai import ChatOpenAI

    from tests.harness import API_KEY

    for base_url in (f"{hive.url}/v1", f"{hive.url}/tiny/v1"):
        llm = ChatOpenAI(model="tiny", base_url=base_url, api_key=API_KEY, max_tokens=5, temperature=0)
        msg = llm.invoke("hello there")
        assert isinstance(msg.content, str) and msg.usage_metadata["output_tokens"] >= 1
        assert "".join(chunk.content for chunk in llm.stream("hello there")) == msg.content
        caller = ChatOpenAI(model="tiny", base_url=base_url, api_key=API_KEY, max_tokens=200, temperature=0,
                            logit_bias=no_padding)
        tools = caller.bind_tools([WEATHER], tool_choice="get_weather", strict=True)
        answer = tools.invoke("weather in Rome?")
        assert answer.tool_calls, (answer.content, answer.invalid_tool_calls, answer.response_metadata)
        call = answer.tool_calls[0]
        assert call["name"] == "get_weather" and valid_call("get_weather", json.dumps(call["args"]))
