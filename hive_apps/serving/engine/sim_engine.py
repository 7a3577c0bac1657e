"""The simulated engine: an OpenAI-shaped engine with token timing, admission and failures.

A product feature for what-if capacity runs and load tests without GPUs, and the engine of
the fast cluster tests. It honours the plan like vLLM would: at most ``max_num_seqs``
sequences decode at once (the rest wait), and each sequence decodes at a per-GPU-class
rate. Options come from ``vllm_kwargs`` keys starting with ``sim_``:

- ``sim_tokens_per_s``: decode rate of one sequence (default: the plan's estimate / seqs);
- ``sim_fail_start``: raise in the constructor (a deploy that fails);
- ``sim_start_delay_s``: seconds the constructor takes;
- ``sim_cold_start``: take as long as a real engine would to start with these weights on a
  GPU (``hive_apps/core/lifecycle.py`` ``cold_start_s``, from vLLM's published figures), so what-if
  runs of sleeping and waking models see realistic wake times;
- ``sim_memory_factor``: the share of its reservation the engine really allocates (default 1.0),
  which is what its simulated GPU then shows as used;
- ``sim_sleep_mode``: false: the engine has no sleep mode (as vLLM on CPU), so it parks instead
  of sleeping in place (default true on a GPU);
- ``sim_corrupt_wake``: after a wake from sleep, answer differently than before (as an engine
  whose weights came back corrupted would), so the admin's check after a wake can be seen to work.

On a (simulated) GPU it sleeps in place as vLLM's sleep mode does, level 1 or 2, taking the
time ``hive_apps/core/lifecycle.py`` derives from vLLM's published figures for its weights
(``sleep_s``, ``wake_s``). Asleep it still holds what vLLM would by plan (its CUDA context, and
what its start options keep: ``planning/memory.sleep_residual_bytes``, times ``sim_memory_factor``),
and says so as a real engine reports what NVML shows; that residual stays booked on its devices,
and its simulated GPU shows it as used.

Prefix cache, as vLLM's with ``enable_prefix_caching`` (on unless that is false): an LRU of
16-token blocks (64 bytes of the prompt's text, keyed as ``serving/routing/prefix.py`` keys
them), as many as the plan's KV cache holds; a prompt's leading blocks found there are not
prefilled again. ``info()["prefix_cache"]`` counts queried and hit tokens like vLLM's counters.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import struct
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from hive_apps.core.lifecycle import cold_start_s, sleep_s, wake_s
from hive_apps.core.openai_errors import openai_error
from hive_apps.core.planning.memory import sleep_residual_bytes
from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.core.settings import HiveSettings
from hive_apps.core.weights.types import Manifest
from hive_apps.ops.metrics import Publisher
from hive_apps.serving.engine.adapters import AdapterLoadError
from hive_apps.serving.engine.base import EngineBase, weights_folder
from hive_apps.serving.engine.protocol import EngineCounters, EngineLoad
from hive_apps.serving.engine.start_lock import start_lock
from hive_apps.serving.routing.prefix import BYTES_PER_TOKEN, BlockLRU, block_keys, cache_blocks, prompt_bytes

WORDS = "the hive plans serves routes replicas tokens quickly and calmly across every device".split()
EMBED_DIM = 384
BLOCK_TOKENS = 16  # vLLM's default KV block


def fake_embedding(text: str) -> list[float]:
    """Deterministic unit vector from the text's hash: same text, same vector."""
    seed = hashlib.sha256(text.encode()).digest()
    raw = (seed * (EMBED_DIM * 4 // len(seed) + 1))[: EMBED_DIM * 4]
    vals = [b / 255.0 - 0.5 for b in raw[::4]]
    norm = sum(v * v for v in vals) ** 0.5 or 1.0
    return [v / norm for v in vals]


MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}
SIM_TOKENS_PER_ITEM = 64  # what one image, audio clip or video costs in the prompt (the sim has no encoder)


def chat_prompt(messages: list, limits: dict[str, int]) -> int | str:
    """Prompt tokens of a chat: ~4 characters of text per token plus SIM_TOKENS_PER_ITEM per media
    item; or, like vLLM, why it is refused when a modality passes ``limit_mm_per_prompt``."""
    chars, items = 0, {}  # type: int, dict[str, int]
    for m in messages:
        content = m.get("content", "") if isinstance(m, dict) else ""
        parts = content if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                items[MEDIA_PARTS[kind]] = items.get(MEDIA_PARTS[kind], 0) + 1
            else:
                chars += len(str(part.get("text", "") if isinstance(part, dict) else part))
    for modality, n in items.items():
        if n > limits.get(modality, 0):
            return f"At most {limits.get(modality, 0)} {modality}(s) may be provided in one prompt."
    return max(1, chars // 4) + SIM_TOKENS_PER_ITEM * sum(items.values())


class SimMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]


class SimStreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


class SimRequest(BaseModel):
    """The request fields the sim engine reads, typed as vLLM's OpenAI layer types them, so
    a bad value is a 400 here as it is there."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[SimMessage] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: StrictBool | None = None
    stream_options: SimStreamOptions | None = None


class SimEngine(EngineBase):
    async def __init__(self, model_id: str, weights: Manifest | str, replica: ReplicaPlan,  # type: ignore[misc]
                       use_start_lock: bool = True, settings: HiveSettings | None = None,  # Serve awaits it
                       publisher: Publisher | None = None):
        super().__init__(settings, publisher)
        self.model_id, self.replica = model_id, replica
        self.use_start_lock = use_start_lock
        self.weights_path = weights_folder(weights, self.settings.weights_cache)  # like a real engine: the weights must be on this node
        kw = replica.engine_kwargs
        if use_start_lock:
            async with start_lock(model_id, replica, self.settings.deploy_timeout_s) as report:
                await self._start(kw)
                report.measured_bytes = int(replica.reservation_bytes * float(kw.get("sim_memory_factor", 1.0)))
        else:
            await self._start(kw)
        self.runner = "pooling" if kw.get("runner") == "pooling" else "generate"
        self.skew = 0  # sim_corrupt_wake: words shifted after a wake
        seqs = replica.settings.max_num_seqs
        est = replica.expected_tokens_per_s
        self.tokens_per_s = float(kw.get("sim_tokens_per_s") or (est / seqs if est else 100.0))
        self.max_model_len = replica.settings.max_model_len
        self.slots = asyncio.Semaphore(seqs)
        self.prefix_cache = (BlockLRU(cache_blocks(replica, block_tokens=BLOCK_TOKENS))
                             if kw.get("enable_prefix_caching", True) else None)
        self.counters = EngineCounters()  # tokens in and out, time to first token (EngineLoad)
        self.running = 0
        self.waiting = 0
        self.app = self._build_app()
        self.warm_up_s = await self.warm_up()
        await self.start_http()

    async def _start(self, kw: dict) -> None:
        """What a real engine does while it holds the start lock: take time, maybe fail."""
        self.start_began = time.time()
        delay = float(kw.get("sim_start_delay_s") or 0.0)
        if kw.get("sim_cold_start"):
            delay += cold_start_s(self.replica.memory.weights)  # per rank: ranks load in parallel
        # by the wall clock its start is reported in: the loop's timers may fire a little early
        while (left := self.start_began + delay - time.time()) > 0:
            await asyncio.sleep(left)
        if kw.get("sim_fail_start"):
            raise RuntimeError("simulated engine start failure (sim_fail_start=true)")
        self.start_ended = time.time()

    async def _load_adapter(self, name: str, folder: str) -> None:
        """A simulated LoRA load: the adapter's files must be there, as vLLM reads them."""
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            raise AdapterLoadError(404, f"LoRA adapter {name!r}: no adapter_config.json in {folder}")

    def can_sleep(self) -> bool:
        return self.replica.device_kind.is_gpu and self.replica.engine_kwargs.get("sim_sleep_mode", True)

    async def _sleep(self, level: int) -> None:
        await asyncio.sleep(sleep_s(level, self.replica.memory.weights))

    def _residual(self, before: list[int] | None) -> dict[str, int]:
        """What it keeps on each device asleep: vLLM's residual by plan, scaled as its start was."""
        kept = int(sleep_residual_bytes(self.replica) * float(self.replica.engine_kwargs.get("sim_memory_factor", 1.0)))
        return {dev: kept for dev in self.replica.devices}

    async def _wake_up(self) -> None:
        await asyncio.sleep(wake_s(self.sleep_level, self.replica.memory.weights))
        if self.replica.engine_kwargs.get("sim_corrupt_wake"):
            self.skew += 1

    def info(self) -> dict[str, Any]:
        return {**super().info(), "start_began": self.start_began, "start_ended": self.start_ended,
                "engine_start_s": self.start_ended - self.start_began, "warm_up_s": self.warm_up_s,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # the pin it was started with
                "prefix_cache": {"queries": self.counters.prefix_queries, "hits": self.counters.prefix_hits}}

    def prompt_keys(self, body: dict[str, Any]) -> list[int]:
        """The prompt's block keys for the prefix cache (none when it is off)."""
        if self.prefix_cache is None:
            return []
        limit = self.max_model_len * BYTES_PER_TOKEN
        return block_keys(prompt_bytes(body, limit), BLOCK_TOKENS * BYTES_PER_TOKEN, limit)

    def cached_tokens(self, keys: list[int], prompt_tokens: int) -> int:
        """Look the prompt up as the scheduler does when it admits it; its blocks are then cached.
        The last prompt token is always computed, as in vLLM."""
        if self.prefix_cache is None:
            return 0
        hit = min(prompt_tokens - 1, self.prefix_cache.matched(keys) * BLOCK_TOKENS)
        self.prefix_cache.touch(keys)
        self.counters.prefix_cache(prompt_tokens, hit)
        return hit

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=self.running, waiting=self.waiting, **self.activity(),
            max_num_seqs=self.replica.settings.max_num_seqs, updated_at=time.time(),
            kv_cache_usage=self.running / self.replica.settings.max_num_seqs, **self.counters.fields(),
        )

    async def _generate(self, prompt_tokens: int, max_tokens: int, keys: list[int] | None = None):
        """Admit like a scheduler, then yield one word per decode step; ``keys``: the prompt's blocks.
        Its time to first token runs from its arrival, as vLLM's does: the wait for a slot, the prefill
        and the first decode step."""
        arrived = time.monotonic()
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:  # a request cancelled while queued must not stay counted as waiting
            self.waiting -= 1
        self.running += 1
        try:
            computed = prompt_tokens - self.cached_tokens(keys or [], prompt_tokens)
            await asyncio.sleep(computed / (self.tokens_per_s * 50))  # prefill is ~50x faster than decode
            self.count_tokens(prompt_tokens, 0)
            self.counters.tokens(prompt_tokens, 0)
            for i in range(max_tokens):
                await asyncio.sleep(1.0 / self.tokens_per_s)
                self.count_tokens(0, 1)
                self.counters.tokens(0, 1)
                if i == 0:
                    self.counters.first_token(time.monotonic() - arrived)
                yield WORDS[(prompt_tokens + i + self.skew) % len(WORDS)] + " "
        finally:
            self.running -= 1
            self.slots.release()

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        engine = self

        async def parse(request: Request) -> dict[str, Any] | JSONResponse:
            try:
                body = json.loads(await request.body() or b"{}")
            except ValueError:
                return openai_error(400, "request body is not valid JSON")
            if not isinstance(body, dict):
                return openai_error(400, "request body must be a JSON object")
            try:
                SimRequest.model_validate(body)
            except ValidationError as e:
                err = e.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                return openai_error(400, f"{field}: {err['msg']}", param=field)
            if body.get("model") not in (None, engine.model_id, *(engine._adapters.loaded if engine._adapters else ())):
                return openai_error(404, f"The model `{body.get('model')}` does not exist.", param="model")
            return body

        def budget(prompt_tokens: int, body: dict) -> int | JSONResponse:
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            if prompt_tokens + max_tokens > engine.max_model_len:
                return openai_error(
                    400,
                    f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
                    f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                    f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
                    param="max_tokens",
                )
            return max_tokens

        def count_tokens(text: str) -> int:
            return max(1, len(text) // 4)

        async def respond(body: dict, prompts: list[int], kind: str):
            """Answer like vLLM: choice i * n + j is sample j of prompt i; usage counts every prompt once."""
            n = 1 if body.get("n") is None else body["n"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                return openai_error(400, "'n' must be a positive integer", param="n")
            max_tokens = budget(max(prompts), body)
            if isinstance(max_tokens, JSONResponse):
                return max_tokens
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            created = int(time.time())
            obj = "chat.completion" if kind == "chat" else "text_completion"
            prompt_total = sum(prompts)
            usage = lambda done: {"prompt_tokens": prompt_total, "completion_tokens": done, "total_tokens": prompt_total + done}  # noqa: E731
            samples = [(i * n + j, tokens) for i, tokens in enumerate(prompts) for j in range(n)]
            keys = engine.prompt_keys(body) if len(prompts) == 1 else []

            def choice(index: int, text: str, finish: str | None, stream: bool) -> dict:
                if kind == "chat":
                    key = "delta" if stream else "message"
                    return {"index": index, key: {"role": "assistant", "content": text}, "finish_reason": finish}
                return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}

            if not body.get("stream"):
                async def sample(tokens: int) -> list[str]:
                    return [w async for w in engine._generate(tokens, max_tokens, keys)]

                texts = await asyncio.gather(*(sample(tokens) for _, tokens in samples))
                return JSONResponse({"id": rid, "object": obj, "created": created, "model": engine.model_id,
                                     "choices": [choice(index, "".join(parts), "length", False)
                                                 for (index, _), parts in zip(samples, texts)],
                                     "usage": usage(sum(len(parts) for parts in texts))})

            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def event(choices: list[dict], **extra) -> str:
                return f"data: {json.dumps({'id': rid, 'object': chunk_obj, 'created': created, 'model': engine.model_id, 'choices': choices, **extra})}\n\n"

            async def sse():
                words: asyncio.Queue = asyncio.Queue()

                async def sample(index: int, tokens: int) -> None:
                    async for w in engine._generate(tokens, max_tokens, keys):
                        await words.put((index, w))
                    await words.put((index, None))

                tasks = [asyncio.create_task(sample(index, tokens)) for index, tokens in samples]
                done = finished = 0
                try:
                    while finished < len(samples):
                        index, w = await words.get()
                        if w is None:
                            finished += 1
                            yield event([choice(index, "", "length", True)])
                        else:
                            done += 1
                            yield event([choice(index, w, None, True)])
                finally:
                    for t in tasks:
                        t.cancel()
                if include_usage:
                    yield event([], usage=usage(done))
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "owned_by": "ray-hive",
                                                "max_model_len": engine.max_model_len}]}

        @app.get("/health")
        async def health():
            return {}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await parse(request)
            if isinstance(body, JSONResponse):
                return body
            if engine.runner == "pooling":
                return openai_error(404, "this model serves embeddings only; use /v1/embeddings")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return openai_error(400, "'messages' must be a non-empty list", param="messages")
            prompt = chat_prompt(messages, engine.replica.engine_kwargs.get("limit_mm_per_prompt") or {})
            if isinstance(prompt, str):
                return openai_error(400, prompt, param="messages")
            return await respond(body, [prompt], "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await parse(request)
            if isinstance(body, JSONResponse):
                return body
            prompt = body.get("prompt")
            if not isinstance(prompt, (str, list)) or not prompt:
                return openai_error(400, "'prompt' must be a string or a non-empty list", param="prompt")
            if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
                prompts = [count_tokens(p) if isinstance(p, str) else max(1, len(p)) for p in prompt]
            else:  # one string, or one prompt of token ids
                prompts = [count_tokens(prompt) if isinstance(prompt, str) else len(prompt)]
            return await respond(body, prompts, "completion")

        @app.post("/v1/embeddings")
        async def embeddings(request: Request):
            body = await parse(request)
            if isinstance(body, JSONResponse):
                return body
            inputs = body.get("input")
            inputs = [inputs] if isinstance(inputs, str) else inputs
            if not isinstance(inputs, list) or not inputs:
                return openai_error(400, "'input' must be a string or a non-empty list", param="input")
            data = []
            for i, text in enumerate(inputs):
                vec = fake_embedding(str(text) + "~" * engine.skew)
                if body.get("encoding_format") == "base64":
                    emb: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
                else:
                    emb = vec
                data.append({"object": "embedding", "index": i, "embedding": emb})
            tokens = sum(count_tokens(str(t)) for t in inputs)
            return {"object": "list", "data": data, "model": engine.model_id,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        return app
