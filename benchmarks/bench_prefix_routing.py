"""Prefix-aware routing vs least-loaded vs round robin vs llm-d's rule, on heterogeneous sim replicas.

    python benchmarks/bench_prefix_routing.py [--seconds 8] [--warmup 2] [--loads 0.5,1,1.5,2]
                                              [--workloads chat,shared,unique] [--write-results PATH]

No Ray: the four replicas of ``benchmarks/bench_routing.py`` (1 x H100, 2 x A10, 1 x 2xL4; its
``derive_classes``) are in-process ``SimEngine`` objects with their prefix cache (16-token blocks,
as many as max_num_seqs x max_model_len), driven on simulated time (its ``VirtualClockLoop``) by a
router that mirrors ``ReplicaSet``: in-flight counts, queued prompt tokens (the uncached part,
released at the first content), the engines' running/waiting polled every 250 ms.

Workloads (streaming chat, 32 output tokens; the sim prefills 50x faster than it decodes):
  chat    multi-turn: 48 conversations open at a time, each a ~1000-token document then turns of
          ~150 tokens (question + previous answer); each request is a random open conversation's
          next turn, extending its last; a conversation ends after 8 turns and a new one starts;
  shared  many users, 8 system prompts of ~2000 tokens, each request one of them + a ~100-token
          question of its own;
  unique  ~1000-token prompts that share nothing.
Policies:
  prefix        the hive's: ``serving/routing/prefix.py`` PrefixIndex.choose (longest match while the
                replica has a planned sequence slot and prefill budget, else least loaded);
  least-loaded  ``policy.choose_replica`` (today);
  round-robin   replicas in turn;
  llm-d         affinity to the longest match (the same index) until that replica's queued prefill
                passes a fixed threshold (``--llmd-threshold`` tokens, the same for every card),
                else the lowest raw queue (load), as llm-d's default scheduler does.
Loads are fractions of the fleet's capacity without any cache hit (sum of max_num_seqs / service
time of a workload's mean prompt). Per cell: TTFT p50/p99 of requests arriving after the warm-up,
completed req/s, and the prefix-hit rate (the engines' hit tokens / queried tokens). The knee is
the highest load whose TTFT p99 stays under ``--slo`` seconds with every request completed;
throughput at the knee is that cell's completed req/s.

``--decision-cost`` prints the cost of one routing decision (keys + index + choice) in µs instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_routing import (  # noqa: E402
    VirtualClockLoop,
    derive_classes,
    has_content,
    now,
    pct,
    poll_loads,
    replica_classes,
)

from hive_apps.serving.engine.protocol import ForwardedRequest, ResponseStart  # noqa: E402
from hive_apps.serving.engine.sim_engine import SimEngine  # noqa: E402
from hive_apps.serving.routing.policy import ReplicaView, choose_replica, prompt_tokens_estimate  # noqa: E402
from hive_apps.serving.routing.prefix import (  # noqa: E402
    ROUTE_BLOCK_TOKENS,
    PrefixIndex,
    block_keys,
    cache_blocks,
    prompt_bytes,
)
from tests.unit.helpers import replica_plan  # noqa: E402

MODEL = "bench-model"
OUTPUT_TOKENS = 32
MAX_MODEL_LEN = 4096
TOKEN_BUDGET = 8192  # planned max_num_batched_tokens
POLICIES = ["prefix", "least-loaded", "round-robin", "llm-d"]
WORKLOADS = ["chat", "shared", "unique"]


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text (the sim counts 4 characters a token), unlike any other."""
    return " ".join(f"{rng.getrandbits(24):06x}"[:3] for _ in range(tokens))


class Workload:
    mean_prompt_tokens = 1000

    def __init__(self, rng: random.Random):
        self.rng = rng

    def next(self) -> dict:
        raise NotImplementedError


class Chat(Workload):
    mean_prompt_tokens = 1000 + 150 * 4

    def __init__(self, rng: random.Random, open_convs: int = 48, turns: int = 8):
        super().__init__(rng)
        self.turns = turns
        self.convs = [self._new() for _ in range(open_convs)]

    def _new(self) -> list[dict]:
        return [{"role": "user", "content": "Read this document: " + words(self.rng, 1000)}]

    def next(self) -> dict:
        i = self.rng.randrange(len(self.convs))
        conv = self.convs[i]
        msgs = [*conv, {"role": "user", "content": words(self.rng, 50)}]
        conv.extend([msgs[-1], {"role": "assistant", "content": words(self.rng, 100)}])
        if len(conv) >= 1 + 2 * self.turns:
            self.convs[i] = self._new()
        return {"messages": msgs}


class Shared(Workload):
    mean_prompt_tokens = 2100

    def __init__(self, rng: random.Random, prompts: int = 8):
        super().__init__(rng)
        self.systems = [words(rng, 2000) for _ in range(prompts)]

    def next(self) -> dict:
        return {"messages": [{"role": "system", "content": self.rng.choice(self.systems)},
                             {"role": "user", "content": words(self.rng, 100)}]}


class Unique(Workload):
    def next(self) -> dict:
        return {"messages": [{"role": "user", "content": words(self.rng, 1000)}]}


WORKLOAD_OF: dict[str, Callable[[random.Random], Workload]] = {"chat": Chat, "shared": Shared, "unique": Unique}


async def build_engines(fleet) -> list[SimEngine]:
    engines = []
    for c in fleet:
        e = SimEngine.__new__(SimEngine)
        plan = replica_plan(max_num_seqs=c.max_num_seqs, max_model_len=MAX_MODEL_LEN, sim_tokens_per_s=c.tokens_per_s)
        plan = plan.model_copy(update={
            "index": len(engines), "expected_tokens_per_s": c.tokens_per_s * c.max_num_seqs,
            "settings": plan.settings.model_copy(update={"max_num_batched_tokens": TOKEN_BUDGET})})
        await e.__init__(MODEL, "", plan, use_start_lock=False)
        engines.append(e)
    return engines


class BenchRouter:
    """What ReplicaSet keeps per model, with a pluggable choice."""

    def __init__(self, policy: str, engines: list[SimEngine], llmd_threshold: int):
        self.policy, self.engines, self.llmd_threshold = policy, engines, llmd_threshold
        self.views = [ReplicaView.of_plan(e.replica) for e in engines]
        self.index = PrefixIndex({e.replica.index: cache_blocks(e.replica) for e in engines})
        self.next = 0

    async def poll_load(self) -> None:
        await poll_loads(self.views, self.engines)

    def pick(self, body: dict, tokens: int) -> tuple[ReplicaView, int]:
        """The replica and the prompt tokens it is taken to have cached."""
        if self.policy == "least-loaded":
            return choose_replica(self.views), 0
        if self.policy == "round-robin":
            self.next += 1
            return self.views[(self.next - 1) % len(self.views)], 0
        keys = block_keys(prompt_bytes(body))
        if self.policy == "prefix":
            view, _, cached = self.index.choose(self.views, keys, tokens)
            assert view is not None
            return view, cached
        matches = self.index.matches(keys, range(len(self.views)))
        best = max(self.views, key=lambda v: (matches[v.index], -v.load))
        if matches[best.index] == 0 or best.queued_tokens > self.llmd_threshold:
            best = min(self.views, key=lambda v: (v.load, v.index))
        self.index.record(best.index, keys)
        return best, min(tokens, matches[best.index] * ROUTE_BLOCK_TOKENS)


@dataclass
class Record:
    arrival: float
    ttft: float | None = None
    done: bool = False


async def send(router: BenchRouter, body: dict, rec: Record, t_arrival: float) -> None:
    raw = json.dumps(body).encode()
    tokens = prompt_tokens_estimate(raw)
    view, cached = router.pick(body, tokens)
    queued = tokens - cached
    view.in_flight += 1
    view.queued_tokens += queued
    try:
        tail = b""
        async for item in router.engines[view.index].forward(ForwardedRequest(path="/v1/chat/completions", body=raw)):
            if isinstance(item, ResponseStart):
                continue
            if rec.ttft is None and has_content(item):
                rec.ttft = now() - t_arrival
                view.queued_tokens, queued = view.queued_tokens - queued, 0
            tail = item
        rec.done = b"data: [DONE]" in tail
    finally:
        view.in_flight -= 1
        view.queued_tokens -= queued


@dataclass
class Cell:
    workload: str
    policy: str
    load: float
    rate: float
    records: list[Record] = field(default_factory=list)
    seconds: float = 0.0
    hit_rate: float = 0.0


async def run_cell(workload: str, policy: str, load: float, fleet, capacity: float, args) -> Cell:
    engines = await build_engines(fleet)
    router = BenchRouter(policy, engines, args.llmd_threshold)
    rate = load * capacity
    rng = random.Random(args.seed * 1000 + round(load * 100))  # same arrivals and prompts for every policy
    source = WORKLOAD_OF[workload](random.Random(args.seed))
    cell = Cell(workload, policy, load, rate, seconds=args.seconds)
    background = asyncio.create_task(router.poll_load())
    await asyncio.sleep(0.05)
    tasks, t, t0 = [], 0.0, now()
    while True:
        t += rng.expovariate(rate)
        if t >= args.warmup + args.seconds:
            break
        delay = t0 + t - now()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = Record(arrival=t)
        if t >= args.warmup:
            cell.records.append(rec)
        body = {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "stream": True, **source.next()}
        tasks.append(asyncio.create_task(send(router, body, rec, t0 + t)))
    await asyncio.sleep(max(0.0, t0 + args.warmup + args.seconds + args.drain - now()))
    for task in (*tasks, background):
        task.cancel()
    await asyncio.gather(*tasks, background, return_exceptions=True)
    queries = sum(e.counters.prefix_queries for e in engines)
    cell.hit_rate = sum(e.counters.prefix_hits for e in engines) / queries if queries else 0.0
    return cell


def stats(cell: Cell, slo: float) -> dict:
    ttfts = [r.ttft for r in cell.records if r.ttft is not None]
    unfinished = sum(1 for r in cell.records if not r.done)
    p50 = pct(ttfts, 0.5) if ttfts else float("inf")
    p99 = pct(ttfts, 0.99) if ttfts and not unfinished else float("inf")
    return {"p50": p50, "p99": p99, "rps": sum(r.done for r in cell.records) / cell.seconds,
            "ok": unfinished == 0 and p99 < slo, "hit": cell.hit_rate, "unfinished": unfinished}


def fmt(x: float) -> str:
    return ">cut" if x == float("inf") else f"{x:.2f}"


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    classes = derive_classes()
    fleet = replica_classes(classes)
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    detail, summary = [], []
    for workload in args.workloads.split(","):
        prompt = WORKLOAD_OF[workload].mean_prompt_tokens
        capacity = sum(c.max_num_seqs / (prompt / (50 * c.tokens_per_s) + OUTPUT_TOKENS / c.tokens_per_s) for c in fleet)
        print(f"{workload}: capacity without cache hits {capacity:.1f} req/s", flush=True)
        per_policy: dict[str, list[tuple[float, dict]]] = {p: [] for p in policies}
        for load in loads:
            for policy in policies:
                s = stats(await run_cell(workload, policy, load, fleet, capacity, args), args.slo)
                per_policy[policy].append((load, s))
                detail.append(f"| {workload} | {load:.0%} ({load * capacity:.1f}) | {policy} | {fmt(s['p50'])} | "
                              f"{fmt(s['p99'])} | {s['rps']:.1f} | {s['unfinished']} | {s['hit']:.0%} |")
                print(detail[-1], flush=True)
        base = per_policy.get("least-loaded")
        for policy, cells in per_policy.items():
            knee = max((c for c in cells if c[1]["ok"]), key=lambda c: c[0], default=None)
            first = cells[0][1]
            at_knee = f"{knee[1]['rps']:.1f} ({knee[0]:.0%})" if knee else "-"
            row = f"| {workload} | {policy} | {fmt(first['p50'])} | {fmt(first['p99'])} | {at_knee} | {first['hit']:.0%} |"
            if base is not None:
                bknee = max((c for c in base if c[1]["ok"]), key=lambda c: c[0], default=None)
                ratio_ttft = base[0][1]["p50"] / first["p50"] if first["p50"] else float("inf")
                ratio_knee = knee[1]["rps"] / bknee[1]["rps"] if knee and bknee else float("nan")
                row += f" {ratio_ttft:.2f}x | {ratio_knee:.2f}x |"
            summary.append(row)
    head = ("| workload | policy | TTFT p50 s @" + f"{loads[0]:.0%}" + " | TTFT p99 s @" + f"{loads[0]:.0%}"
            + " | throughput at the knee req/s (load) | prefix-hit rate @" + f"{loads[0]:.0%}"
            + " | TTFT p50 vs least-loaded | knee vs least-loaded |\n|---|---|---|---|---|---|---|---|")
    table = head + "\n" + "\n".join(summary)
    dhead = ("| workload | load (req/s) | policy | TTFT p50 s | TTFT p99 s | completed req/s | unfinished | prefix-hit rate |\n"
             "|---|---|---|---|---|---|---|---|")
    details = dhead + "\n" + "\n".join(detail)
    elapsed = time.perf_counter() - started
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    print("\n" + table + "\n\n" + details + f"\n\nran in {elapsed:.0f} s\ncommand: {command}")
    if args.write_results:
        fleet_desc = ", ".join(f"{c.label} ({c.max_num_seqs} seqs, {c.tokens_per_s:g} tok/s per seq)" for c in fleet)
        Path(args.write_results).write_text(f"""# Prefix-aware routing benchmark (sim replicas)

Four in-process SimEngine replicas with their prefix cache, no Ray, simulated time: {fleet_desc}.
Workloads, policies and the knee as in the docstring of `benchmarks/bench_prefix_routing.py`; {args.seconds:g} s
measured after {args.warmup:g} s of warm-up, {args.drain:g} s to drain; SLO for the knee: TTFT p99 < {args.slo:g} s, all completed.
llm-d's threshold: {args.llmd_threshold} queued prefill tokens. ">cut": a request was still unfinished at the cut-off.

{table}

Every cell:

{details}

`{command}` (ran in {elapsed:.0f} s on a shared 2-core machine).
""")
        print(f"wrote {args.write_results}")


def decision_cost() -> None:
    """µs per routing decision on four replicas: prompt bytes, keys, index lookup and update, choice."""
    views = [ReplicaView(index=i, capacity=32) for i in range(4)]
    index = PrefixIndex({i: 1 << 16 for i in range(4)})
    rng = random.Random(1)
    for chars in (2_000, 16_000, 64_000, 400_000):
        bodies = [{"messages": [{"role": "system", "content": words(rng, chars // 8)},
                                {"role": "user", "content": words(rng, chars // 8)}]} for _ in range(20)]
        n = 2000
        t = time.perf_counter()
        for i in range(n):
            body = bodies[i % len(bodies)]
            index.choose(views, block_keys(prompt_bytes(body)), chars // 4)
        prefix_us = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        for _ in range(n):
            choose_replica(views)
        least_us = (time.perf_counter() - t) / n * 1e6
        print(f"prompt of {chars:7d} chars: prefix decision {prefix_us:6.1f} µs, least-loaded {least_us:5.1f} µs")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--drain", type=float, default=6.0, help="seconds after the last arrival before the cut-off")
    p.add_argument("--loads", default="0.5,1,1.5,2", help="fractions of the capacity without cache hits")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--llmd-threshold", type=int, default=TOKEN_BUDGET)
    p.add_argument("--slo", type=float, default=2.0, help="TTFT p99 bound of the knee, seconds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--decision-cost", action="store_true")
    p.add_argument("--write-results", metavar="PATH")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.decision_cost:
        decision_cost()
        sys.exit(0)
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(main(arguments))
    finally:
        loop.close()
