"""Inference through the hive's OpenAI API: sync, async, batch, streaming, structured output.

Deploys ``chat`` (or uses a deployed model with ``--use MODEL_ID``) and asks it, with the
OpenAI SDK only:

- a plain chat completion (sync);
- four chats at once from ``AsyncOpenAI`` (the router spreads them over replicas);
- a batch: one completion request with a list of prompts, and one chat with ``n=3`` (the hive
  splits both across replicas and merges the answer);
- a streamed chat (tokens as they are decoded);
- structured output: the answer parsed into a pydantic model with
  ``client.chat.completions.parse`` (vLLM's guided decoding; the sim engine ignores
  ``response_format``, so this step runs with ``--engine vllm`` only);
- the same model from LangChain's ``ChatOpenAI`` when langchain-openai is installed.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/inference.py --model Qwen/Qwen3-0.6B
    python examples/inference.py --use qwen3 --engine vllm      # a model already deployed
"""

from __future__ import annotations

import asyncio
import time

from _hive import API_KEY, URL, deployed, openai_client, parser
from pydantic import BaseModel


class City(BaseModel):
    name: str
    country: str
    population_millions: float


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--use", metavar="MODEL_ID", help="ask this deployed model instead of deploying one")
    args = p.parse_args()
    model_id = args.use or "chat"
    with deployed(args, model_id, replicas=2):
        run(model_id, args.engine)


def run(model_id: str, engine: str) -> None:
    client = openai_client()
    ask = [{"role": "user", "content": "Name a large city in one word."}]

    r = client.chat.completions.create(model=model_id, messages=ask, max_tokens=16)
    print(f"sync: {r.choices[0].message.content!r} ({r.usage.completion_tokens} tokens)")

    async def many() -> list:
        aclient = openai_client(async_=True)
        return await asyncio.gather(*(aclient.chat.completions.create(
            model=model_id, max_tokens=8, messages=[{"role": "user", "content": f"Question {i}"}]) for i in range(4)))

    t = time.perf_counter()
    answers = asyncio.run(many())
    print(f"async: {len(answers)} answers in {time.perf_counter() - t:.2f} s")

    prompts = ["The sky is", "Bees make", "Ray is a", "GPUs are"]
    batch = client.completions.create(model=model_id, prompt=prompts, max_tokens=8)
    print(f"batch: {len(prompts)} prompts -> {len(batch.choices)} choices")
    # the per-model route, /<model_id>/v1, answers the same API
    samples = openai_client(model_id).chat.completions.create(model=model_id, messages=ask, max_tokens=8, n=3)
    print(f"n=3: {len(samples.choices)} samples: {[c.message.content for c in samples.choices]}")

    chunks, text = 0, ""
    for chunk in client.chat.completions.create(model=model_id, messages=ask, max_tokens=16, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            text += chunk.choices[0].delta.content
    print(f"streamed {chunks} chunks: {text!r}")

    if engine == "vllm":
        parsed = client.chat.completions.parse(
            model=model_id, response_format=City, max_tokens=128,
            messages=[{"role": "user", "content": "Give me a large city as JSON: name, country, population in millions."}])
        city = parsed.choices[0].message.parsed
        print(f"structured: {city!r}")
    else:
        print("structured: skipped (the sim engine does not follow response_format; use --engine vllm)")

    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        print("langchain: skipped (pip install langchain-openai)")
    else:
        llm = ChatOpenAI(base_url=f"{URL}/v1", api_key=API_KEY, model=model_id, max_tokens=8)
        print(f"langchain: {llm.invoke('Say hi.').content!r}")
    print("inference: ok")


if __name__ == "__main__":
    main()
