import asyncio
import json
from types import SimpleNamespace

import pytest

from hive_apps.core.buckets import TTFT_BOUNDS_S
from hive_apps.core.devices import DeviceKind
from hive_apps.serving.engine.base import WARM_UP_SAMPLED, WARM_UP_TOKENS, EngineStartError
from hive_apps.serving.engine.protocol import EngineCounters, EngineLoad, ForwardedRequest, ResponseStart
from hive_apps.serving.engine.sim_engine import SimEngine
from tests.unit.helpers import replica_plan


async def engine(**kw) -> SimEngine:
    """Serve awaits the async constructor; do the same, without the registry's start lock."""
    e = SimEngine.__new__(SimEngine)
    await e.__init__("sim-model", "", replica_plan(**kw), use_start_lock=False)
    return e


async def test_chat_and_warm_up():
    e = await engine(sim_tokens_per_s=2000)
    assert await e.warm_up() >= 0
    status, body = await e.call_json("/v1/chat/completions", {"model": "sim-model", "max_tokens": 5,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["message"]["role"] == "assistant"


async def test_the_first_warm_up_also_samples_so_no_kernel_is_built_after_ready():
    e = await engine(sim_tokens_per_s=2000)
    sent: list[dict] = []
    real = e.call_json

    async def recording(path, body):
        sent.append(body)
        return await real(path, body)

    e.call_json = recording
    e.answer = None  # as on the engine's first warm-up (its constructor ran one already)
    await e.warm_up()
    assert [b.get("temperature") for b in sent] == [0, WARM_UP_SAMPLED["temperature"]]
    assert 0 < sent[1]["top_p"] < 1 and sent[1]["top_k"] > 0  # vLLM's top-k/top-p sampler, not greedy
    sent.clear()
    await e.warm_up()  # after a wake: the fingerprint only, the kernels are built
    assert [b.get("temperature") for b in sent] == [0]


async def test_a_failed_sampled_warm_up_fails_the_start():
    e = await engine(sim_tokens_per_s=2000)
    real = e.call_json

    async def no_sampling(path, body):
        if body.get("temperature"):
            return 400, {"error": {"message": "top_k is not supported"}}
        return await real(path, body)

    e.call_json = no_sampling
    e.answer = None
    with pytest.raises(EngineStartError, match="sampled warm-up request failed with HTTP 400"):
        await e.warm_up()


async def test_stream_ends_with_done_and_usage():
    e = await engine(sim_tokens_per_s=2000)
    body = {"model": "sim-model", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    items = [i async for i in e.forward(ForwardedRequest(path="/v1/chat/completions", body=json.dumps(body).encode()))]
    assert isinstance(items[0], ResponseStart) and items[0].content_type.startswith("text/event-stream")
    text = b"".join(i for i in items[1:]).decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 3


async def test_admission_caps_running_at_max_num_seqs():
    e = await engine(max_num_seqs=2, sim_tokens_per_s=50)
    peak = 0

    async def watch():
        nonlocal peak
        for _ in range(40):
            peak = max(peak, e.load().running)
            await asyncio.sleep(0.01)

    req = {"model": "sim-model", "prompt": "x", "max_tokens": 5}
    await asyncio.gather(watch(), *(e.call_json("/v1/completions", req) for _ in range(5)))
    assert peak == 2
    assert e.load().running == 0 and e.load().waiting == 0


async def test_errors_are_openai_shaped():
    e = await engine(max_model_len=64)
    status, body = await e.call_json("/v1/completions", {"model": "sim-model", "prompt": "x" * 400, "max_tokens": 8})
    assert status == 400 and "maximum context length is 64" in body["error"]["message"]
    status, body = await e.call_json("/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["param"] == "model"


async def test_embeddings_deterministic_and_base64():
    e = await engine()
    _, a = await e.call_json("/v1/embeddings", {"input": ["same", "other"]})
    _, b = await e.call_json("/v1/embeddings", {"input": "same"})
    assert len(a["data"][0]["embedding"]) == 384
    assert a["data"][0]["embedding"] == b["data"][0]["embedding"] != a["data"][1]["embedding"]
    _, c = await e.call_json("/v1/embeddings", {"input": "same", "encoding_format": "base64"})
    assert isinstance(c["data"][0]["embedding"], str)


async def test_failure_injection():
    with pytest.raises(RuntimeError, match="sim_fail_start"):
        await engine(sim_fail_start=True)


async def test_prompt_lists_and_n_answer_like_vllm():
    e = await engine(sim_tokens_per_s=5000)
    status, body = await e.call_json("/v1/completions", {"model": "sim-model", "prompt": ["aaaa", "bbbbbbbb", "cc"],
                                                         "n": 2, "max_tokens": 3})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"] == {"prompt_tokens": 1 + 2 + 1, "completion_tokens": 18, "total_tokens": 22}
    status, body = await e.call_json("/v1/chat/completions", {"model": "sim-model", "n": 3, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and len(body["choices"]) == 3 and body["usage"]["completion_tokens"] == 6
    status, body = await e.call_json("/v1/chat/completions", {"model": "sim-model", "n": 0,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "n"


async def test_bad_request_fields_are_400s_like_vllm():
    import httpx

    from hive_apps.serving.engine.sim_engine import SimEngine
    from tests.unit.helpers import replica_plan

    e = SimEngine.__new__(SimEngine)
    await e.__init__("m", "", replica_plan(sim_tokens_per_s=5000), use_start_lock=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=e.app), base_url="http://e")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for bad, field in [({"max_tokens": "abc"}, "max_tokens"), ({"stream_options": 5}, "stream_options"),
                       ({"n": 0}, "n"), ({"stream": "yes"}, "stream"),
                       ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role")]:
        r = await client.post("/v1/chat/completions", json={**chat, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == field
    assert (await client.post("/v1/chat/completions", json={**chat, "max_tokens": 1})).status_code == 200
    await e.http.stop() if e.http else None


async def test_a_cancelled_queued_request_does_not_stay_waiting():
    import asyncio

    from hive_apps.serving.engine.sim_engine import SimEngine
    from tests.unit.helpers import replica_plan

    e = SimEngine.__new__(SimEngine)
    await e.__init__("m", "", replica_plan(max_num_seqs=1, sim_tokens_per_s=20), use_start_lock=False)

    async def run():
        async for _ in e._generate(1, 50):
            pass

    first = asyncio.create_task(run())
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(run())
    await asyncio.sleep(0.05)
    assert e.waiting == 1
    queued.cancel()
    await asyncio.sleep(0.05)
    assert e.waiting == 0
    first.cancel()
    await asyncio.sleep(0.05)
    assert e.running == 0


async def test_sim_cold_start_takes_the_lifecycle_cold_start_time(monkeypatch):
    from hive_apps.serving.engine import sim_engine

    asked = []

    def cold(weight_bytes):
        asked.append(weight_bytes)
        return 0.3

    monkeypatch.setattr(sim_engine, "cold_start_s", cold)
    e = await engine(sim_tokens_per_s=2000, sim_cold_start=True)
    assert asked == [e.replica.memory.weights]  # the weights of one rank
    assert e.info()["engine_start_s"] >= 0.3


def test_cold_start_model_reproduces_vllms_published_figures():
    from hive_apps.core.lifecycle import cold_start_s

    assert 97 <= cold_start_s(220 * 2**30, tp=4) <= 98  # Qwen3-235B-FP8, 4 x A100: 97-98 s
    assert cold_start_s(15 * 2**30, compute_capability=(9, 0)) < cold_start_s(15 * 2**30)  # Gen5 host link


async def test_sleeps_in_place_at_both_levels_with_the_published_timings():
    from hive_apps.core.lifecycle import sleep_s, wake_s

    e = await engine(sim_tokens_per_s=2000)
    e.replica.memory.weights = 2 * 2**30  # 2 GiB on an Ampere-class link: level 1 wakes in ~0.4 s
    assert e.can_sleep() and e.info()["can_sleep"]
    slept = (await e.sleep(1)).sleep_s
    assert slept == pytest.approx(sleep_s(1, 2 * 2**30), abs=0.1) and e.info()["sleep_level"] == 1
    assert (await e.sleep(1)).sleep_s < 0.05  # asleep already
    woke = await e.wake_up()
    assert woke["wake_s"] == pytest.approx(wake_s(1, 2 * 2**30), abs=0.1) and e.sleep_level == 0
    await e.sleep(2)
    level2 = (await e.wake_up())["wake_s"]
    assert 3 * woke["wake_s"] <= level2 <= 10 * woke["wake_s"]  # vLLM: level 2 wakes 3-10x slower on small models


async def test_a_wake_that_answers_differently_is_refused():
    from hive_apps.serving.engine.base import EngineStartError

    e = await engine(sim_tokens_per_s=2000, sim_corrupt_wake=True)
    await e.sleep(1)
    with pytest.raises(EngineStartError, match="differently than before it slept"):
        await e.wake_up()
    with pytest.raises(EngineStartError):  # asked again (a new admin): still refused
        await e.wake_up()


async def test_an_engine_on_a_cpu_or_without_sleep_mode_cannot_sleep_in_place():
    assert not (await engine(sim_tokens_per_s=2000, sim_sleep_mode=False)).can_sleep()
    e = await engine(sim_tokens_per_s=2000)
    e.replica.device_kind = DeviceKind.CPU
    assert not e.can_sleep()
    with pytest.raises(RuntimeError, match="park it"):
        await e.sleep(1)


async def test_chat_media_costs_tokens_per_item_and_respects_the_limit_per_prompt():
    from hive_apps.serving.engine.sim_engine import SIM_TOKENS_PER_ITEM

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40000}}
    e = await engine(sim_tokens_per_s=2000, limit_mm_per_prompt={"image": 1})
    ask = lambda *parts: e.call_json("/v1/chat/completions", {  # noqa: E731
        "model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": [*parts]}]})
    status, body = await ask({"type": "text", "text": "what is this? " * 4}, image)
    assert status == 200 and body["usage"]["prompt_tokens"] == 14 + SIM_TOKENS_PER_ITEM  # not the base64's length
    status, body = await ask(image, image)
    assert status == 400 and body["error"]["message"] == "At most 1 image(s) may be provided in one prompt."
    status, body = await ask({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}})
    assert status == 400 and "At most 0 audio(s)" in body["error"]["message"]


def _turns(*texts: str) -> dict:
    msgs = [{"role": "system", "content": "Answer briefly and well. " * 200}]  # ~5 KB, ~1250 tokens
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    return {"model": "sim-model", "max_tokens": 1, "messages": msgs}


async def _timed_chat(e: SimEngine, body: dict) -> float:
    loop = asyncio.get_running_loop()
    t = loop.time()
    status, _ = await e.call_json("/v1/chat/completions", body)
    assert status == 200
    return loop.time() - t


async def test_prefix_cache_hit_skips_the_cached_prefill():
    e = await engine(max_num_seqs=4, max_model_len=4096, sim_tokens_per_s=50)  # prefill 2500 tokens/s
    warm_up_hits = e.info()["prefix_cache"]["hits"]  # the sampled warm-up reuses the greedy one's prompt
    cold = await _timed_chat(e, _turns("What is a hive?"))
    assert e.info()["prefix_cache"]["hits"] == warm_up_hits and e.info()["prefix_cache"]["queries"] > 1000
    warm = await _timed_chat(e, _turns("What is a hive?", "A home.", "And a router?"))
    stats = e.info()["prefix_cache"]
    assert stats["hits"] - warm_up_hits >= 1200, stats  # the system prompt and the first turn, in 16-token blocks
    assert warm < cold - 0.3, (cold, warm)  # ~0.5 s of prefill became ~0.01 s


async def test_prefix_cache_is_bounded_by_the_planned_blocks_and_can_be_off():
    e = await engine(max_num_seqs=1, max_model_len=512, sim_tokens_per_s=5000)  # 512 / 16 = 32 blocks
    assert e.prefix_cache is not None and e.prefix_cache.capacity == 32
    await e.call_json("/v1/completions", {"model": "sim-model", "prompt": "a" * 1600, "max_tokens": 1})  # 25 blocks
    await e.call_json("/v1/completions", {"model": "sim-model", "prompt": "b" * 1600, "max_tokens": 1})  # evicts most of a
    hits = e.counters.prefix_hits
    await e.call_json("/v1/completions", {"model": "sim-model", "prompt": "a" * 1600, "max_tokens": 1})
    assert e.counters.prefix_hits - hits < 25 * 16 // 2, "a's blocks were evicted (leaf first) by b's"
    load = e.load()  # what routers and the admin read, as vLLM's engines report it
    assert (load.prefix_cache_queries_total, load.prefix_cache_hits_total) == \
        (e.counters.prefix_queries, e.counters.prefix_hits) == (e.info()["prefix_cache"]["queries"],
                                                                 e.info()["prefix_cache"]["hits"])
    assert len(e.prefix_cache.keys) <= 32
    off = await engine(sim_tokens_per_s=5000, enable_prefix_caching=False)
    for _ in range(2):
        await off.call_json("/v1/completions", {"model": "sim-model", "prompt": "a" * 400, "max_tokens": 1})
    assert off.prefix_cache is None and off.info()["prefix_cache"] == {"queries": 0, "hits": 0}


# --- the load report's counters: tokens and time to first token (issue 31) ---------------------------
# The admin's history turns them into tokens/s and p50 TTFT (core/history.py); vLLM's stat-logger hook
# feeds the same counters (serving/engine/vllm_engine.py).
CHAT = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


async def test_the_sim_engine_counts_tokens_and_each_requests_time_to_first_token():
    e = await engine(max_num_seqs=1, sim_tokens_per_s=100)  # one sequence at a time, 10 ms a token
    try:
        warm = e.load()  # the warm-up (greedy, then sampled) is counted, as vLLM's own counters count it
        sampled = WARM_UP_SAMPLED["max_tokens"]
        assert warm.generation_tokens_total == WARM_UP_TOKENS + sampled and warm.prompt_tokens_total > 0
        assert warm.ttft.count == 2 and len(warm.ttft.buckets) == len(TTFT_BOUNDS_S)

        # two at once on one slot: the second waits the first's 10 tokens (>= 0.1 s) before its own first token
        answers = await asyncio.gather(*(e.call_json("/v1/chat/completions", {**CHAT, "max_tokens": 10})
                                         for _ in range(2)))
        assert [status for status, _ in answers] == [200, 200]
        ld = e.load()
        usage = [body["usage"] for _, body in answers]
        assert ld.generation_tokens_total - warm.generation_tokens_total == 20 == sum(u["completion_tokens"] for u in usage)
        assert ld.prompt_tokens_total - warm.prompt_tokens_total == sum(u["prompt_tokens"] for u in usage)
        assert ld.ttft.count == 4 and ld.ttft.sum_s - warm.ttft.sum_s >= 0.1 + 0.01
        b = ld.ttft.buckets
        assert all(x <= y for x, y in zip(b, b[1:])) and b[-1] == 4, "cumulative, every one within the last bound"
        assert b[TTFT_BOUNDS_S.index(0.1)] <= 3, "the one that waited for the slot took more than 0.1 s"
        assert b[TTFT_BOUNDS_S.index(0.001)] == 0, "a first token takes a decode step (10 ms) at least"

        # what travels to the routers and the admin: JSON, read back the same
        assert EngineLoad.model_validate_json(ld.model_dump_json()) == ld
    finally:
        if e.http is not None:
            await e.http.stop()


def test_an_engine_load_from_before_the_counters_still_parses():
    old = EngineLoad.model_validate_json(b'{"running": 2, "waiting": 1, "kv_cache_usage": 0.5, "max_num_seqs": 8,'
                                         b' "requests_total": 40}')
    assert old.running == 2 and old.requests_total == 40
    assert (old.prompt_tokens_total, old.generation_tokens_total) == (0, 0)
    assert old.ttft.buckets == [] and old.ttft.count == 0 and old.ttft.sum_s == 0.0
    assert EngineLoad().ttft is not EngineLoad().ttft, "each load its own histogram"


def test_counters_bucket_as_prometheus_does():
    c = EngineCounters()
    for s in (0.0005, 0.001, 0.3, 0.3, 5000.0):  # on a bound counts in that bound's bucket (le); past the last: count only
        c.first_token(s)
    c.tokens(7, 3)
    c.tokens(-1, 0)  # never goes back
    f = c.fields()
    b = f["ttft"].buckets
    assert b[TTFT_BOUNDS_S.index(0.001)] == 2 and b[TTFT_BOUNDS_S.index(0.25)] == 2 and b[TTFT_BOUNDS_S.index(0.5)] == 4
    assert b[-1] == 4 and f["ttft"].count == 5 and abs(f["ttft"].sum_s - 5000.6015) < 1e-6
    assert (f["prompt_tokens_total"], f["generation_tokens_total"]) == (7, 3)


def test_vllm_iteration_stats_fill_the_same_counters():
    from hive_apps.serving.engine.vllm_engine import LoadTracker

    tracker = LoadTracker()
    tracker.record(SimpleNamespace(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.1),
                   SimpleNamespace(num_prompt_tokens=40, num_generation_tokens=7, time_to_first_tokens_iter=[0.03, 0.7]))
    tracker.record(None, SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=5, time_to_first_tokens_iter=[]))
    f = tracker.counters.fields()
    assert (f["prompt_tokens_total"], f["generation_tokens_total"]) == (40, 12)
    assert f["ttft"].count == 2 and f["ttft"].buckets[TTFT_BOUNDS_S.index(0.04)] == 1
    assert f["ttft"].buckets[TTFT_BOUNDS_S.index(0.75)] == 2
