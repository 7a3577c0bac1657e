"""Prefix-aware routing: block keys, the per-replica index, the capacity bound, and the ReplicaSet headers."""

import json

from hive_apps.core.spec import Routing
from hive_apps.core.weights.source import parse_source
from hive_apps.core.weights.types import Manifest
from hive_apps.serving.engine.protocol import ADAPTER_HEADER, AdapterRef, ForwardedRequest, ResponseStart
from hive_apps.serving.routing import prefix
from hive_apps.serving.routing.policy import ReplicaView
from hive_apps.serving.routing.prefix import (
    ADAPTER,
    LEAST_LOADED,
    PREFIX,
    ROUTE_BLOCK_BYTES,
    ROUTE_BLOCK_TOKENS,
    BlockLRU,
    PrefixIndex,
    block_keys,
    cache_blocks,
    choose_by_prefix,
    prompt_bytes,
    saturated,
)
from hive_apps.serving.routing.replica_set import ReplicaSet
from tests.unit.helpers import replica_plan
from tests.unit.helpers import routing as seams

SYSTEM = "You are a careful assistant. " * 40  # ~1.1 KB: four full routing blocks


def chat(*turns: str) -> dict:
    msgs = [{"role": "system", "content": SYSTEM}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": msgs}


def test_keys_are_chained_over_full_blocks_only():
    a = b"a" * (3 * ROUTE_BLOCK_BYTES + 10)
    keys = block_keys(a)
    assert len(keys) == 3  # the partial fourth block is not cached by vLLM, so not keyed
    b = a[:ROUTE_BLOCK_BYTES] + b"b" + a[ROUTE_BLOCK_BYTES + 1:]
    other = block_keys(b)
    assert other[0] == keys[0]
    assert other[1] != keys[1] and other[2] != keys[2], "a change in block 1 changes every later key"
    assert keys[1] != keys[2] and {k >> 32 for k in keys} == {0, 1, 2}, "each key carries its depth"
    assert len(block_keys(b"x" * 10 * ROUTE_BLOCK_BYTES, limit=4 * ROUTE_BLOCK_BYTES)) == 4


def test_a_later_turn_extends_the_earlier_turns_prefix():
    first = block_keys(prompt_bytes(chat("What is a hive?")))
    later = block_keys(prompt_bytes(chat("What is a hive?", "A colony's home. " * 20, "And a router?")))
    assert len(later) > len(first) and later[: len(first)] == first
    stranger = block_keys(prompt_bytes({"messages": [{"role": "user", "content": SYSTEM}]}))
    assert stranger[0] != first[0], "the role is part of the prompt, as in the chat template"
    assert prompt_bytes({"prompt": "abc"}) == b"abc"
    assert prompt_bytes({"prompt": [1, 2, 3]}) == b"1,2,3"
    assert prompt_bytes({"prompt": ["a", "b"]}) == b"" and prompt_bytes(None) == b""
    parts = prompt_bytes({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                     {"type": "image_url", "image_url": {"url": "u"}}]}]})
    assert b"hi" in parts and b'"url": "u"' in parts


def test_lru_evicts_the_tail_of_a_chain_first_and_matches_by_prefix():
    lru = BlockLRU(capacity=5)
    conv = [1, 2, 3, 4]
    lru.touch(conv)
    assert lru.matched(conv) == 4 and lru.matched([1, 2, 9, 4]) == 2 and lru.matched([9]) == 0
    lru.touch([10, 11])  # one over capacity: conv's last block goes, not its first
    assert len(lru.keys) == 5
    assert lru.matched(conv) == 3
    lru.touch([20, 21, 22])
    assert lru.matched(conv) == 0 and lru.matched([10, 11]) == 2


def test_longest_match_wins_over_lower_load():
    a = ReplicaView(index=0, capacity=8, in_flight=3)
    b = ReplicaView(index=1, capacity=8)
    view, route = choose_by_prefix([a, b], {0: 10, 1: 2}, prompt_tokens=700, block_tokens=64)
    assert (view.index, route) == (0, PREFIX)
    view, route = choose_by_prefix([a, b], {0: 0, 1: 0}, prompt_tokens=700, block_tokens=64)
    assert (view.index, route) == (1, LEAST_LOADED)


def test_affinity_yields_when_the_holder_has_no_planned_slot():
    full = ReplicaView(index=0, capacity=4, in_flight=4)
    partial = ReplicaView(index=1, capacity=4, in_flight=1)
    idle = ReplicaView(index=2, capacity=4)
    assert saturated(full, 0) and not saturated(partial, 0)
    view, route = choose_by_prefix([full, partial, idle], {0: 10, 1: 5, 2: 0}, 700, 64)
    assert (view.index, route) == (1, PREFIX), "the next-longest match with room"
    view, route = choose_by_prefix([full, idle], {0: 10, 2: 0}, 700, 64)
    assert (view.index, route) == (2, LEAST_LOADED)


def test_affinity_yields_when_queued_prefill_would_pass_the_token_budget():
    holder = ReplicaView(index=0, capacity=64, in_flight=2, queued_tokens=7000, token_budget=8192)
    other = ReplicaView(index=1, capacity=64)
    # 15 blocks of 64 cached: 3000 - 960 = 2040 uncached tokens, over the budget with 7000 queued
    view, route = choose_by_prefix([holder, other], {0: 15}, 3000, 64)
    assert (view.index, route) == (1, LEAST_LOADED)
    holder.queued_tokens = 5000
    view, route = choose_by_prefix([holder, other], {0: 15}, 3000, 64)
    assert (view.index, route) == (0, PREFIX)


def test_a_short_match_does_not_pull_a_request_off_the_least_loaded_replica():
    busy = ReplicaView(index=0, capacity=8, in_flight=4)
    idle = ReplicaView(index=1, capacity=8)
    short = int(prefix.MIN_MATCH_SHARE * 6400 / 64) - 1
    assert choose_by_prefix([busy, idle], {0: short}, 6400, 64)[0].index == 1
    assert choose_by_prefix([busy, idle], {0: short + 1}, 6400, 64)[0].index == 0


def test_dead_and_excluded_replicas_are_never_chosen_for_their_prefix():
    dead = ReplicaView(index=0, capacity=8, healthy=False)
    live = ReplicaView(index=1, capacity=8, in_flight=5)
    assert choose_by_prefix([dead, live], {0: 10}, 640, 64) == (live, LEAST_LOADED)
    assert choose_by_prefix([ReplicaView(index=0, capacity=8), live], {0: 10}, 640, 64, exclude={0})[0] is live
    assert choose_by_prefix([dead], {0: 10}, 640, 64) == (None, LEAST_LOADED)


def test_index_records_the_choice_and_reports_cached_tokens():
    idx = PrefixIndex({0: 100, 1: 100})
    views = [ReplicaView(index=0, capacity=8), ReplicaView(index=1, capacity=8)]
    keys = block_keys(prompt_bytes(chat("hello")))
    tokens = len(prompt_bytes(chat("hello"))) // 4
    first, route, cached = idx.choose(views, keys, tokens)
    assert (first.index, route, cached) == (0, LEAST_LOADED, 0)
    first.in_flight = 3  # busier now, but it holds the prefix
    again, route, cached = idx.choose(views, keys, tokens)
    assert (again.index, route, cached) == (0, PREFIX, len(keys) * ROUTE_BLOCK_TOKENS)
    assert idx.choose(views, [], tokens)[:2] == (views[1], LEAST_LOADED), "no keys: least loaded"


def test_cache_blocks_come_from_the_planned_kv_cache():
    rp = replica_plan(max_num_seqs=4, max_model_len=512)  # kv_cache_memory_bytes = 2**30
    assert cache_blocks(rp, kv_bytes_per_token=2**20) == 1024 // ROUTE_BLOCK_TOKENS
    assert cache_blocks(rp) == 4 * 512 // ROUTE_BLOCK_TOKENS, "without the model's KV size: every sequence full"
    assert cache_blocks(rp, kv_bytes_per_token=1) == prefix.MAX_INDEX_BLOCKS


class StubTransport:
    """Answers every call at once, or fails on the replicas in ``down``."""

    def __init__(self, down: set[int] | None = None):
        self.down = down or set()
        self.sent: list[int] = []

    async def call(self, i: int, req: ForwardedRequest):
        self.sent.append(i)
        if i in self.down:
            raise ConnectionError("down")
        return ResponseStart(status=200, headers=[("content-type", "application/json")]), b"{}"

    async def stream(self, i: int, req: ForwardedRequest):
        self.sent.append(i)
        if i in self.down:
            raise ConnectionError("down")
        yield ResponseStart(status=200, headers=[("content-type", "text/event-stream")])
        yield b"data: [DONE]\n\n"

    def failed(self, i: int, e: Exception) -> None:
        pass

    def close(self) -> None:
        pass


def replica_set(n: int = 2, routing: Routing = Routing.PREFIX, down: set[int] | None = None) -> ReplicaSet:
    plans = [replica_plan(max_num_seqs=8).model_copy(update={"index": i}) for i in range(n)]
    rs = ReplicaSet("m", {}, plans, queue_bound=8, routing=routing, **seams())
    rs.transport = StubTransport(down)  # type: ignore[assignment]
    return rs


def request(body: dict) -> ForwardedRequest:
    return ForwardedRequest(path="/v1/chat/completions", body=json.dumps(body).encode())


def route_of(start: ResponseStart) -> tuple[str, str]:
    h = dict(start.headers)
    return h["x-hive-replica"], h["x-hive-route"]


async def test_a_conversation_stays_on_its_replica_and_says_why():
    rs = replica_set()
    turn1 = chat("What is a hive?")
    start, _ = await rs.call(request(turn1), turn1)
    assert route_of(start) == ("r0", "least-loaded")
    rs.views[0].engine_running = 3  # r0 is busier now: least-loaded alone would pick r1
    turn2 = chat("What is a hive?", "A home. " * 40, "And the router?")
    start, _ = await rs.call(request(turn2), turn2)
    assert route_of(start) == ("r0", "prefix")
    items = [i async for i in rs.stream(request({**turn2, "stream": True}))]  # parsed by the set itself
    assert route_of(items[0]) == ("r0", "prefix")


async def test_least_loaded_routing_ignores_prefixes():
    rs = replica_set(routing=Routing.LEAST_LOADED)
    turn = chat("What is a hive?")
    await rs.call(request(turn), turn)
    rs.views[0].engine_running = 3
    start, _ = await rs.call(request(turn), turn)
    assert route_of(start) == ("r1", "least-loaded")


async def test_a_failover_is_a_retry_and_splits_say_split():
    rs = replica_set(down={0})
    turn = chat("What is a hive?")
    start, _ = await rs.call(request(turn), turn)
    assert route_of(start) == ("r1", "retry") and rs.transport.sent == [0, 1]
    rs = replica_set()
    body = {"model": "m", "prompt": ["a", "b", "c", "d"], "max_tokens": 1}
    start, _ = await rs.call(ForwardedRequest(path="/v1/completions", body=json.dumps(body).encode()), body)
    assert dict(start.headers)["x-hive-route"] == "split"


async def test_queued_prefill_counts_only_the_uncached_tokens():
    rs = replica_set()
    seen: list[int] = []

    async def call(i: int, req: ForwardedRequest):
        seen.append(rs.views[i].queued_tokens)
        return ResponseStart(status=200), b"{}"

    rs.transport.call = call  # type: ignore[method-assign]
    turn = chat("What is a hive?")
    body = request(turn).body
    await rs.call(request(turn), turn)
    rs.views[1].engine_running = 0
    await rs.call(request(turn), turn)
    cached = len(block_keys(prompt_bytes(turn))) * ROUTE_BLOCK_TOKENS
    assert seen == [len(body) // 4, len(body) // 4 - cached]


# --- LoRA adapters: the replica that holds the adapter, within its planned capacity (issue #29) -------------

def test_an_adapters_blocks_are_its_own_as_in_vllms_prefix_cache():
    data = prompt_bytes(chat("What is a hive?"))
    base, a, b = block_keys(data), block_keys(data, seed="sql-lora"), block_keys(data, seed="poem-lora")
    assert len(base) == len(a) == len(b) and not set(base) & set(a) and not set(a) & set(b)
    assert block_keys(data, seed="sql-lora") == a


def test_a_replica_holding_the_adapter_wins_over_lower_load_until_it_is_saturated():
    views = [ReplicaView(index=0, capacity=8), ReplicaView(index=1, capacity=8, engine_running=5,
                                                           adapters=frozenset({"sql-lora"}))]
    assert choose_by_prefix(views, {}, 100, ROUTE_BLOCK_TOKENS, adapter="sql-lora") == (views[1], ADAPTER)
    assert choose_by_prefix(views, {}, 100, ROUTE_BLOCK_TOKENS, adapter="poem-lora") == (views[0], LEAST_LOADED)
    assert choose_by_prefix(views, {}, 100, ROUTE_BLOCK_TOKENS) == (views[0], LEAST_LOADED)  # the base
    views[1].engine_running = 8  # no planned slot left: loading it elsewhere beats waiting
    assert choose_by_prefix(views, {}, 100, ROUTE_BLOCK_TOKENS, adapter="sql-lora") == (views[0], LEAST_LOADED)


def adapter_request(body: dict, adapter: str) -> ForwardedRequest:
    ref = AdapterRef(model_id=adapter, weights=Manifest(source=parse_source("/adapters/" + adapter), revision="local"),
                     revision_key="k")
    return ForwardedRequest(path="/v1/chat/completions", body=json.dumps({**body, "model": adapter}).encode(),
                            headers=[(ADAPTER_HEADER, ref.model_dump_json())])


async def test_a_request_for_an_adapter_goes_where_the_engine_reports_it_loaded():
    rs = replica_set(n=3)
    rs.views[2].adapters = frozenset({"sql-lora"})  # as the load poll sets it (liveness._refresh)
    rs.views[2].engine_running = 2
    turn = chat("Count the rows.")
    start, _ = await rs.call(adapter_request(turn, "sql-lora"), turn)
    assert route_of(start) == ("r2", "adapter")
    items = [i async for i in rs.stream(adapter_request({**turn, "stream": True}, "sql-lora"))]
    assert route_of(items[0]) == ("r2", "prefix")  # and now its blocks are there too, under the adapter's chain
    start, _ = await rs.call(request(turn), turn)  # the base's request: its own chain, which no replica holds
    assert route_of(start)[1] == "least-loaded"
    least = replica_set(n=2, routing=Routing.LEAST_LOADED)  # no prefixes, but the adapter still counts
    least.views[1].adapters, least.views[1].engine_running = frozenset({"sql-lora"}), 3
    start, _ = await least.call(adapter_request(turn, "sql-lora"), turn)
    assert route_of(start) == ("r1", "adapter")
