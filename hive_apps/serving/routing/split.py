"""Spread one request's work over several replicas: a list of prompts, or n > 1 samples.

A completion with 32 prompts, or a chat with n = 8, is many sequences in one request; sent
whole to one replica it queues there while others idle. The router cuts such a request
into parts in proportion to each replica's free capacity (planned max_num_seqs minus its
load), sends the parts at once and merges the answers as vLLM would have written one:
choices renumbered in order (prompt i, sample j -> index i * n + j), usage added up.

Not split: streamed requests (their chunks would interleave), requests with a ``seed``
(a replica given part of n would repeat the same samples), and anything when fewer than
two replicas have room. Refused before any of this (``fanout_problem``, a 400): more than
``MAX_N`` samples or ``MAX_PROMPTS`` prompts in one request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from hive_apps.serving.routing.liveness import is_live
from hive_apps.serving.routing.policy import ReplicaView

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"

MAX_N = 128
"""The most samples (``n``) one chat or completions request may ask for. vLLM caps n per engine
request (VLLM_MAX_N_SEQUENCES, 16384) but a split request is several engine requests, so that cap
multiplies with the replicas; and one client's n = 2000 would fill every replica's batch."""
MAX_PROMPTS = 1024
"""The most prompts in one completions ``prompt`` or embeddings ``input`` list: vLLM's own
per-request cap (VLLM_MAX_COMPLETION_PROMPTS), which splitting would multiply too."""


class SplitPart(BaseModel):
    replica: int  # ReplicaView.index
    body: dict[str, Any]
    choices: int  # how many choices this part answers


class Split(BaseModel):
    kind: Literal["prompts", "n"]
    parts: list[SplitPart]


def proportional_shares(free: list[int], total: int) -> list[int]:
    """``total`` items in proportion to ``free`` (largest remainder; ties to the earlier entry)."""
    room = sum(free)
    if room <= 0:
        return [total] + [0] * (len(free) - 1)
    exact = [total * f / room for f in free]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(free)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _prompt_list(prompt: Any) -> list[Any] | None:
    """Several prompts (strings, or lists of token ids); a single list of ids is one prompt."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return None


def prompt_count(prompt: Any) -> int:
    """How many prompts a ``prompt`` / ``input`` field holds, counted as vLLM counts them: a list is
    that many prompts unless it is one prompt's token ids."""
    if isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


def fanout_problem(path: str, body: dict[str, Any]) -> tuple[str, str] | None:
    """``(message, param)`` when a request asks for more sequences than ``MAX_N`` / ``MAX_PROMPTS``."""
    n = body.get("n")
    if path in (COMPLETIONS, CHAT) and isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        return f"'n' may be at most {MAX_N} on this hive, got {n}; send several requests instead", "n"
    field = {COMPLETIONS: "prompt", EMBEDDINGS: "input"}.get(path)
    if field is not None and (count := prompt_count(body.get(field))) > MAX_PROMPTS:
        return (f"'{field}' may hold at most {MAX_PROMPTS} prompts per request on this hive, got {count}; "
                "send several requests instead", field)
    return None


def plan_split(path: str, body: dict[str, Any], views: list[ReplicaView]) -> Split | None:
    if body.get("stream") or body.get("seed") is not None or path not in (COMPLETIONS, CHAT):
        return None
    roomy = [v for v in views if is_live(v) and v.capacity - v.load > 0]
    if len(roomy) < 2:
        return None
    n = body.get("n") or 1
    if not isinstance(n, int) or n < 1:
        return None  # the engine answers the bad value with its own 400
    prompts = _prompt_list(body.get("prompt")) if path == COMPLETIONS else None
    count = len(prompts) if prompts is not None else n
    if count < 2:
        return None
    shares = proportional_shares([v.capacity - v.load for v in roomy], count)
    parts, start = [], 0
    for view, share in zip(roomy, shares):
        if share == 0:
            continue
        if prompts is not None:
            part = {**body, "prompt": prompts[start: start + share]}
            parts.append(SplitPart(replica=view.index, body=part, choices=share * n))
        else:
            parts.append(SplitPart(replica=view.index, body={**body, "n": share}, choices=share))
        start += share
    if len(parts) < 2:
        return None
    return Split(kind="prompts" if prompts is not None else "n", parts=parts)


def merge_answers(split: Split, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from the parts' answers, in the order of the parts."""
    merged = dict(answers[0])
    choices: list[dict[str, Any]] = []
    for answer in answers:
        for choice in sorted(answer.get("choices", []), key=lambda c: c.get("index", 0)):
            choices.append({**choice, "index": len(choices)})
    merged["choices"] = choices
    usages = [a.get("usage") or {} for a in answers]
    if all(usages):
        completion = sum(u.get("completion_tokens", 0) for u in usages)
        # the same prompt was read by every part of an n split; count it once, as one engine would
        prompt = usages[0].get("prompt_tokens", 0) if split.kind == "n" else sum(u.get("prompt_tokens", 0) for u in usages)
        merged["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return merged
