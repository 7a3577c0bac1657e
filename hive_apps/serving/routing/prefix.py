"""Prefix-aware replica choice, bounded by each replica's planned capacity.

vLLM caches a prompt's KV in blocks of 16 tokens, each keyed by a hash chained over the blocks
before it, and keeps the freed ones as an LRU; a prompt that starts like one a replica served
recently skips most of its prefill there. The router cannot tokenize (it has no tokenizer, and
must stay cheap), so it judges the prefix on the request's text as the chat template lays it out:

- ``prompt_bytes``: each message as role and text in order (a completion: its prompt), UTF-8;
- ``block_keys``: chained CRC-32s over fixed blocks of those bytes (``ROUTE_BLOCK_BYTES``, ~64
  tokens at ~4 bytes a token), only full blocks as vLLM caches only full blocks, and at most
  ``MAX_PREFIX_BYTES`` of them (the first 64 KiB tell conversations and system prompts apart);
  each key carries its depth, so a CRC collision can only confuse blocks at the same depth.

``PrefixIndex`` mirrors, per replica, the blocks the router sent it as an LRU bounded by the
replica's planned KV cache (``cache_blocks``), touched leaf first so the older blocks of a
chain are evicted last, as vLLM evicts them; what a replica holds is then a prefix of every
chain, and its longest match is a binary search.

``choose_by_prefix``: among live replicas the plan says are not saturated (``saturated``: no
free sequence slot, load >= planned max_num_seqs; or the prompt's uncached tokens would push the
prefill this router has queued there past its planned max_num_batched_tokens), the one with the
longest match, if that match is a fair share of the prompt; else, for a LoRA adapter's request,
the least loaded of those not saturated whose engine holds the adapter (``adapter``: no load
in its way); else least loaded as ``policy.choose_replica``. The saturation point is the plan's
own, known before any traffic.

A LoRA adapter's request chains its keys from the adapter's name (``block_keys(seed=...)``), as
vLLM's prefix cache keys its blocks by the adapter too: a prompt the base cached is no hit for an
adapter, and one an adapter cached is a hit only for it.

Pure: no Ray.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.serving.routing.liveness import is_live
from hive_apps.serving.routing.policy import ReplicaView, choose_replica

ROUTE_BLOCK_BYTES = 256
MAX_PREFIX_BYTES = 64 * 1024
BYTES_PER_TOKEN = 4  # policy.prompt_tokens_estimate's rule
ROUTE_BLOCK_TOKENS = ROUTE_BLOCK_BYTES // BYTES_PER_TOKEN
MAX_INDEX_BLOCKS = 1 << 16  # per replica: bounds the router's memory (~7 MB) whatever the plan says
# A match shorter than this share of the prompt saves too little prefill to pull a request off the
# least-loaded replica (a short generic system prompt would otherwise pile every request onto one).
MIN_MATCH_SHARE = 0.25

PREFIX = "prefix"
ADAPTER = "adapter"
LEAST_LOADED = "least-loaded"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: text as is, media by their reference (vLLM hashes media by content)
        out = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                out.append(str(part.get("text", "")) if kind == "text" else f"<{kind}:{json.dumps(part.get(kind))[:256]}>")
        return "".join(out)
    return "" if content is None else str(content)


def prompt_bytes(body: dict[str, Any] | None, limit: int = MAX_PREFIX_BYTES) -> bytes:
    """What the engine's prompt starts with, approximately, up to about ``limit`` bytes; empty when
    the body has no single prompt."""
    if not body:
        return b""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for m in messages:
            if isinstance(m, dict):
                part = f"<{m.get('role')}>{_text(m.get('content'))[:limit]}\n".encode("utf-8", "replace")
                parts.append(part)
                size += len(part)
                if size >= limit:
                    break
        return b"".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:limit].encode("utf-8", "replace")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt[:limit])).encode()  # token ids
    return b""


def block_keys(data: bytes, block: int = ROUTE_BLOCK_BYTES, limit: int = MAX_PREFIX_BYTES, seed: str = "") -> list[int]:
    """One key per full block: depth << 32 | CRC-32 of everything up to the block's end, chained from
    ``seed`` (a LoRA adapter's name: its blocks are its own)."""
    view = memoryview(data)[: min(len(data), limit)]
    keys, h = [], zlib.crc32(seed.encode()) if seed else 0
    for depth, start in enumerate(range(0, len(view) - block + 1, block)):
        h = zlib.crc32(view[start: start + block], h)
        keys.append(depth << 32 | h)
    return keys


def request_keys(body: dict[str, Any] | None, adapter: str | None = None) -> list[int]:
    """A request's keys as every router and engine takes them: its laid-out prompt's blocks, chained
    from its LoRA adapter's name when it asks for one (vLLM keys an adapter's blocks apart)."""
    return block_keys(prompt_bytes(body), seed=adapter or "")


def cache_blocks(rp: ReplicaPlan, kv_bytes_per_token: int | None = None, block_tokens: int = ROUTE_BLOCK_TOKENS) -> int:
    """Blocks of ``block_tokens`` the replica's planned KV cache holds: its KV bytes over the model's
    KV bytes per token when known, else every sequence at max_model_len."""
    s = rp.settings
    if kv_bytes_per_token:
        tokens = s.kv_cache_memory_bytes * s.tensor_parallel_size // kv_bytes_per_token
    else:
        tokens = s.max_num_seqs * s.max_model_len
    return max(1, min(MAX_INDEX_BLOCKS, tokens // block_tokens))


class BlockLRU:
    """The block keys one replica is taken to hold, least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[int, None] = OrderedDict()

    def touch(self, keys: list[int]) -> None:
        """A prompt with these blocks ran here: leaf first, so its first blocks are the newest."""
        held = self.keys
        for k in reversed(keys):
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def extend(self, keys: list[int]) -> None:
        """Blocks another LRU lists, least recently used first (an engine's ``prefix_memory``), as older
        than everything this one holds: what this router sent since outranks it."""
        held = self.keys
        older = OrderedDict((k, None) for k in keys if k not in held)
        older.update(held)
        while len(older) > self.capacity:
            older.popitem(last=False)
        self.keys = older

    def matched(self, keys: list[int]) -> int:
        """How many leading blocks are held (binary search: what is held is a prefix of each chain)."""
        held, lo, hi = self.keys, 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo


class PrefixIndex:
    """Per replica of one model, the blocks the router sent it, bounded by its planned KV cache."""

    def __init__(self, capacities: dict[int, int]):
        self.replicas = {i: BlockLRU(c) for i, c in capacities.items()}

    def matches(self, keys: list[int], indices: Iterable[int]) -> dict[int, int]:
        return {i: self.replicas[i].matched(keys) if i in self.replicas else 0 for i in indices}

    def learn(self, index: int, keys: list[int]) -> None:
        """What the replica's engine says it was sent (least recently used first): a router that starts
        knows what earlier routers sent it."""
        if index in self.replicas:
            self.replicas[index].extend(keys)

    def record(self, index: int, keys: list[int]) -> None:
        if keys and index in self.replicas:
            self.replicas[index].touch(keys)

    def choose(self, views: list[ReplicaView], keys: list[int], prompt_tokens: int,
               exclude: set[int] | frozenset[int] = frozenset(), adapter: str | None = None
               ) -> tuple[ReplicaView | None, str, int]:
        """``choose_by_prefix`` on this index, and the chosen replica then holds the prompt's blocks.
        Returns the replica, why, and the prompt tokens it is taken to have cached."""
        if not keys and adapter is None:
            return choose_replica(views, exclude), LEAST_LOADED, 0
        matches = self.matches(keys, (v.index for v in views))
        view, route = choose_by_prefix(views, matches, prompt_tokens, ROUTE_BLOCK_TOKENS, exclude, adapter)
        if view is None:
            return None, route, 0
        self.record(view.index, keys)
        return view, route, min(prompt_tokens, matches[view.index] * ROUTE_BLOCK_TOKENS)


def saturated(view: ReplicaView, uncached_tokens: int) -> bool:
    """Past the plan's saturation point: the request would wait for a sequence slot, or its prefill
    would not fit the planned batch with what this router already queued there."""
    if view.load >= view.capacity:
        return True
    return view.queued_tokens > 0 and view.queued_tokens + uncached_tokens > view.token_budget


def choose_by_prefix(views: list[ReplicaView], matches: dict[int, int], prompt_tokens: int, block_tokens: int,
                     exclude: set[int] | frozenset[int] = frozenset(), adapter: str | None = None
                     ) -> tuple[ReplicaView | None, str]:
    """The replica for a request and why: ``prefix`` (the longest match among replicas not saturated,
    when it covers at least MIN_MATCH_SHARE of the prompt), ``adapter`` (the least loaded replica
    not saturated that holds the request's LoRA adapter) or ``least-loaded``."""
    live = [v for v in views if is_live(v) and v.index not in exclude]
    roomy = [v for v in live if not saturated(v, max(0, prompt_tokens - matches.get(v.index, 0) * block_tokens))]
    best = max((matches.get(v.index, 0) for v in roomy), default=0)
    if best and best * block_tokens >= MIN_MATCH_SHARE * prompt_tokens:
        return choose_replica([v for v in roomy if matches.get(v.index, 0) == best]), PREFIX
    holders = [v for v in roomy if adapter is not None and adapter in v.adapters]
    if holders:
        return choose_replica(holders), ADAPTER
    return choose_replica(live), LEAST_LOADED
