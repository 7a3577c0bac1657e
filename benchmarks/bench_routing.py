"""Routing policies on a heterogeneous fleet: capacity-relative least-loaded vs round robin vs power of two.

    python benchmarks/bench_routing.py [--seconds 10] [--warmup 2] [--loads 0.5,0.7,0.9]
                                       [--clock virtual|real] [--reverse-fleet] [--write-results PATH]

No Ray cluster: the replicas are in-process ``SimEngine`` objects (built the way the unit tests
build them, without the start lock) in one asyncio loop, and each policy runs in a small router
that mirrors ``serving/routing/router.py``: it counts its own requests in flight per replica and refreshes
every replica's ``load()`` (running, waiting) every 250 ms into a ``ReplicaView``.

Clock: by default the loop runs on simulated time (``VirtualClockLoop``): every delay in the
simulation is an ``asyncio.sleep``, so the run is a discrete-event simulation of the same code,
deterministic for a seed and unaffected by whatever else runs on the machine (on a busy 2-core
box the wall-clock sim's per-token timers drift by several ms, which shows up as fake queueing).
``--clock real`` runs on the wall clock instead and adds an event-loop-lag column.

Fleet (one model, four replicas): 1 x H100-80GB, 2 x A10 (one GPU each), 1 x 2xL4 (tensor
parallel 2). Per-class rates and batch sizes come from the GPU catalog's memory and bandwidth
with a memory-bound decode model (``derive_classes``):
  - KV memory per replica = per GPU (0.9 x memory - weights/tp - 1.5 GB overhead), summed over
    its GPUs, for a ~3B-parameter BF16 model (6.4 GB of weights);
  - max_num_seqs proportional to KV memory, scaled so the H100 holds 32 sequences (a real engine
    batches more; 32 keeps the simulation cheap);
  - at full batch a decode step reads the weights plus the whole KV cache once: step time =
    (weights/tp + KV per GPU) / bandwidth per GPU, divided by 0.85 for tensor-parallel overhead;
    the per-sequence rate (SimEngine's ``sim_tokens_per_s``) is one token per step, scaled so the
    H100 decodes 120 tokens/s per sequence. Bigger cards hold bigger batches, so per-sequence
    rates differ less than bandwidths do: H100 : A10 : 2xL4 = 120 : 75 : 32 tokens/s per
    sequence with 32 : 7 : 17 sequences. (SimEngine's rate does not rise at partial batch.)

Requests: streaming chat completions with a 256-token prompt and 64 output tokens (SimEngine
prefills 50x faster than it decodes). Capacity is measured first: every replica filled to
max_num_seqs at once; capacity = sum over replicas of max_num_seqs / mean service time, in
requests/s. Each load level offers that fraction as Poisson arrivals with a fixed seed (the same
arrival times for every policy).

Measured per request, from its scheduled arrival: TTFT (until the first SSE chunk with content)
and end-to-end latency (until ``data: [DONE]``). Goodput = requests/s that met the SLO:
TTFT < 1 s and end-to-end < 1 s + the full-batch service time of the slowest class, that is a
request that starts within 1 s and then decodes at least as fast as the slowest GPU class does at
full batch. Arrivals in the first ``--warmup`` seconds are not measured; after the measured window
the cell waits exactly that end-to-end bound, then cancels what is left, so a latency percentile
that lands on an unfinished request is shown as ">x" (it had waited x seconds and was still going).

Policies:
  least-loaded  hive_apps.serving.routing.policy.choose_replica, imported (load / max_num_seqs);
  round-robin   replicas in turn, ignoring load;
  p2c-raw       two distinct replicas at random, the one with the lower raw load (ReplicaView.load,
                the same signal least-loaded uses, not divided by capacity; ties random), like
                Ray Serve's default power-of-two router on queue lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hive_apps.core.catalog import GPU_CATALOG  # noqa: E402
from hive_apps.serving.engine.protocol import ForwardedRequest, ResponseStart  # noqa: E402
from hive_apps.serving.engine.sim_engine import SimEngine  # noqa: E402
from hive_apps.serving.routing.liveness import LOAD_POLL_S  # noqa: E402
from hive_apps.serving.routing.policy import ReplicaView, choose_replica  # noqa: E402
from tests.unit.helpers import replica_plan  # noqa: E402

MODEL = "bench-model"
PROMPT_TOKENS = 256  # SimEngine counts len(text) // 4 tokens
TTFT_SLO_S = 1.0

# The decode model behind the per-class figures (see the module docstring).
WEIGHTS_GB = 6.4
GPU_MEM_UTIL = 0.9
OVERHEAD_GB = 1.5
TP_EFFICIENCY = 0.85
H100_SEQS = 32
H100_TOKENS_PER_S = 120.0

FLEET = [  # (label, catalog key, GPUs per replica (tensor parallel), replicas)
    ("H100", "H100-80GB", 1, 1),
    ("A10", "A10", 1, 2),
    ("2xL4", "L4", 2, 1),
]
POLICIES = ["least-loaded", "round-robin", "p2c-raw"]


def now() -> float:
    """The running loop's clock: virtual seconds under VirtualClockLoop, monotonic seconds otherwise."""
    return asyncio.get_running_loop().time()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: when nothing is ready it jumps to the next timer.

    Every delay in the simulation is an ``asyncio.sleep`` (SimEngine's prefill and per-token
    decode, the 250 ms load poll, the Poisson arrivals), so the run is a discrete-event
    simulation of the same code: deterministic for a seed, free of the scheduling noise of a
    shared machine, and faster than real time. Code itself takes no simulated time, which is
    the point here: the benchmark compares routing decisions, not router overhead
    (bench_gateway.py measures that).
    """

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0
        real_select = self._selector.select

        def select(timeout: float | None = None):
            if timeout is None:  # nothing scheduled: only I/O (a thread's wake-up) can come
                return real_select(None)
            self._virtual_now += timeout
            return real_select(0)

        self._selector.select = select

    def time(self) -> float:
        return self._virtual_now


@dataclass
class GpuClass:
    label: str
    gpus: int
    kv_gb: float
    step_s: float
    max_num_seqs: int = 0
    tokens_per_s: float = 0.0  # per sequence
    service_s: float = 0.0  # measured at full batch


def derive_classes() -> list[GpuClass]:
    classes = []
    for label, key, tp, _ in FLEET:
        g = GPU_CATALOG[key]
        mem_gb = g.memory_bytes / 1e9
        kv_per_gpu = GPU_MEM_UTIL * mem_gb - WEIGHTS_GB / tp - OVERHEAD_GB
        step_s = (WEIGHTS_GB / tp + kv_per_gpu) / g.memory_bandwidth_gbps / (TP_EFFICIENCY if tp > 1 else 1.0)
        classes.append(GpuClass(label, tp, kv_per_gpu * tp, step_s))
    ref = classes[0]
    for c in classes:
        c.max_num_seqs = max(1, round(H100_SEQS * c.kv_gb / ref.kv_gb))
        c.tokens_per_s = round(H100_TOKENS_PER_S * ref.step_s / c.step_s, 1)
    return classes


def replica_classes(classes: list[GpuClass], reverse: bool = False) -> list[GpuClass]:
    """One entry per replica, in replica index order (largest GPU first unless reversed)."""
    fleet = [c for c, (_, _, _, n) in zip(classes, FLEET) for _ in range(n)]
    return fleet[::-1] if reverse else fleet


async def build_engines(fleet: list[GpuClass]) -> list[SimEngine]:
    engines = []
    for c in fleet:
        e = SimEngine.__new__(SimEngine)
        plan = replica_plan(max_num_seqs=c.max_num_seqs, max_model_len=2048, sim_tokens_per_s=c.tokens_per_s)
        plan = plan.model_copy(update={"index": len(engines), "expected_tokens_per_s": c.tokens_per_s * c.max_num_seqs})
        await e.__init__(MODEL, "", plan, use_start_lock=False)
        engines.append(e)
    return engines


async def poll_loads(views: list[ReplicaView], engines: list[SimEngine]) -> None:
    """A router's load poll: every LOAD_POLL_S, each replica's running and waiting requests."""
    while True:
        for view, e in zip(views, engines):
            res = e.load()
            view.engine_running, view.engine_waiting, view.healthy = res.running, res.waiting, True
        await asyncio.sleep(LOAD_POLL_S)


class BenchRouter:
    """What serving/routing/router.py keeps per model, with a pluggable choice."""

    def __init__(self, policy: str, engines: list[SimEngine], seed: int):
        self.policy, self.engines = policy, engines
        self.views = [ReplicaView.of_plan(e.replica) for e in engines]  # as serving/routing/router.py builds them
        self.rng = random.Random(seed)
        self.next = 0

    async def poll_load(self) -> None:
        await poll_loads(self.views, self.engines)

    def pick(self) -> ReplicaView:
        if self.policy == "least-loaded":
            return choose_replica(self.views)
        if self.policy == "round-robin":
            view = self.views[self.next % len(self.views)]
            self.next += 1
            return view
        a, b = self.rng.sample(self.views, 2)
        if a.load == b.load:
            return self.rng.choice((a, b))
        return a if a.load < b.load else b


@dataclass
class Record:
    arrival: float
    replica: int = -1
    ttft: float | None = None
    e2e: float | None = None
    error: str | None = None


def request_body(output_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": output_tokens, "stream": True,
                       "messages": [{"role": "user", "content": "x" * (4 * PROMPT_TOKENS)}]}).encode()


def has_content(chunk: bytes) -> bool:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                return True
    return False


async def send(router: BenchRouter, req: ForwardedRequest, rec: Record, t_arrival: float) -> None:
    view = router.pick()
    rec.replica = view.index
    view.in_flight += 1
    try:
        tail = b""
        async for item in router.engines[view.index].forward(req):
            if isinstance(item, ResponseStart):
                if item.status != 200:
                    rec.error = f"HTTP {item.status}"
                continue
            if rec.ttft is None and has_content(item):
                rec.ttft = now() - t_arrival
            tail = item
        if b"data: [DONE]" in tail and rec.ttft is not None:
            rec.e2e = now() - t_arrival
        elif rec.error is None:
            rec.error = "stream ended without [DONE]"
    finally:
        view.in_flight -= 1


async def calibrate(classes: list[GpuClass], fleet: list[GpuClass], output_tokens: int) -> None:
    """Fill every replica to max_num_seqs at once; the mean latency is each class's service time."""
    engines = await build_engines(fleet)
    req = ForwardedRequest(path="/v1/chat/completions", body=request_body(output_tokens),
                           headers=[("content-type", "application/json")])
    lat: dict[str, list[float]] = {c.label: [] for c in classes}

    async def one(e: SimEngine, label: str) -> None:
        t = now()
        async for _ in e.forward(req):
            pass
        lat[label].append(now() - t)

    await asyncio.gather(*(one(e, c.label) for e, c in zip(engines, fleet) for _ in range(c.max_num_seqs)))
    for c in classes:
        c.service_s = sum(lat[c.label]) / len(lat[c.label])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


@dataclass
class Cell:
    load: float
    policy: str
    offered_rps: float
    measured: list[Record] = field(default_factory=list)
    cutoff: float = 0.0  # perf_counter time at which unfinished requests were cancelled
    lag_p99_ms: float = 0.0
    seconds: float = 0.0


async def run_cell(policy: str, load: float, fleet: list[GpuClass], capacity_rps: float, args, e2e_bound: float) -> Cell:
    engines = await build_engines(fleet)
    router = BenchRouter(policy, engines, seed=args.seed + 1)
    rate = load * capacity_rps
    arrivals_rng = random.Random(args.seed * 1000 + round(load * 100))  # same arrivals for every policy
    arrivals, t = [], 0.0
    while True:
        t += arrivals_rng.expovariate(rate)
        if t >= args.warmup + args.seconds:
            break
        arrivals.append(t)
    req = ForwardedRequest(path="/v1/chat/completions", body=request_body(args.output_tokens),
                           headers=[("content-type", "application/json")])
    cell = Cell(load, policy, rate, seconds=args.seconds)
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = now()
            await asyncio.sleep(0.01)
            lags.append(now() - t - 0.01)

    background = [asyncio.create_task(router.poll_load()), asyncio.create_task(ticker())]
    await asyncio.sleep(0.05)  # first load poll done
    tasks = []
    t0 = now()
    for a in arrivals:
        delay = t0 + a - now()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = Record(arrival=a)
        if a >= args.warmup:
            cell.measured.append(rec)
        tasks.append(asyncio.create_task(send(router, req, rec, t0 + a)))
    end = t0 + args.warmup + args.seconds + e2e_bound
    await asyncio.sleep(max(0.0, end - now()))
    cell.cutoff = now() - t0
    for task in (*tasks, *background):
        task.cancel()
    await asyncio.gather(*tasks, *background, return_exceptions=True)
    cell.lag_p99_ms = pct(lags, 0.99) * 1000 if lags else 0.0
    return cell


def summarize(cell: Cell, e2e_bound: float, fleet: list[GpuClass], labels: list[str]) -> dict:
    recs = cell.measured
    # Unfinished requests count at their censored age: at least this long.
    ttft = [(r.ttft, False) if r.ttft is not None else (cell.cutoff - r.arrival, True) for r in recs]
    e2e = [(r.e2e, False) if r.e2e is not None else (cell.cutoff - r.arrival, True) for r in recs]

    def show(xs: list[tuple[float, bool]], q: float) -> str:
        if not xs:
            return "-"
        v, _ = sorted(xs)[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]
        # An unfinished request's true value is larger than its age, so the percentile is only a
        # lower bound if any unfinished request sorts at or below it.
        return f">{v:.2f}" if any(censored and x <= v for x, censored in xs) else f"{v:.2f}"

    good = sum(1 for r in recs if r.e2e is not None and r.ttft < TTFT_SLO_S and r.e2e < e2e_bound)
    share = {lab: 0 for lab in labels}
    for r in recs:
        if r.replica >= 0:
            share[fleet[r.replica].label] += 1
    n = max(1, len(recs))
    return {
        "load": f"{cell.load:.0%}", "policy": cell.policy, "offered": f"{cell.offered_rps:.1f}",
        "arrived": str(len(recs)), "completed": str(sum(1 for r in recs if r.e2e is not None)),
        "ttft_p50": show(ttft, 0.5), "ttft_p99": show(ttft, 0.99),
        "e2e_p50": show(e2e, 0.5), "e2e_p99": show(e2e, 0.99),
        "goodput": f"{good / cell.seconds:.1f} ({good / n:.0%})",
        "share": " / ".join(f"{share[lab] / n:.0%}" for lab in labels),
        "lag": f"{cell.lag_p99_ms:.1f}",
        "errors": sum(1 for r in recs if r.error),
    }


COLUMNS = [("load", "load"), ("policy", "policy"), ("offered", "offered req/s"), ("arrived", "arrived"),
           ("completed", "completed"), ("ttft_p50", "TTFT p50 s"), ("ttft_p99", "TTFT p99 s"),
           ("e2e_p50", "e2e p50 s"), ("e2e_p99", "e2e p99 s"), ("goodput", "goodput req/s (% of arrived)"),
           ("share", "sent to {labels}"), ("lag", "loop lag p99 ms")]


def markdown_table(rows: list[dict], labels: list[str], with_lag: bool) -> str:
    cols = [(k, h) for k, h in COLUMNS if with_lag or k != "lag"]
    heads = [h.format(labels=" / ".join(labels)) for _, h in cols]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
    lines += ["| " + " | ".join(row[k] for k, _ in cols) + " |" for row in rows]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measured arrival window per cell")
    p.add_argument("--warmup", type=float, default=2.0, help="arrivals before the measured window")
    p.add_argument("--loads", default="0.5,0.7,0.9", help="fractions of the measured capacity")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--clock", choices=["virtual", "real"], default="virtual",
                   help="virtual: discrete-event time (deterministic, fast); real: wall clock, shows event-loop lag")
    p.add_argument("--reverse-fleet", action="store_true",
                   help="give the slowest replica index 0 (choose_replica breaks ties by index)")
    p.add_argument("--write-results", metavar="PATH", help="also write the table, command and setup as markdown")
    return p.parse_args()


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()

    classes = derive_classes()
    fleet = replica_classes(classes, args.reverse_fleet)
    labels = [c.label for c in classes]
    await calibrate(classes, fleet, args.output_tokens)
    capacity = sum(c.max_num_seqs / c.service_s for c in fleet)
    nominal = sum(c.max_num_seqs * c.tokens_per_s for c in fleet) / args.output_tokens
    e2e_bound = round(TTFT_SLO_S + max(c.service_s for c in classes), 1)
    setup = [f"{c.label:5s} x{n}: max_num_seqs {c.max_num_seqs:3d}, {c.tokens_per_s:6.1f} tok/s per sequence, "
             f"full-batch service {c.service_s:.2f} s (nominal {PROMPT_TOKENS / (50 * c.tokens_per_s) + args.output_tokens / c.tokens_per_s:.2f} s)"
             for c, (_, _, _, n) in zip(classes, FLEET)]
    print("\n".join(setup))
    print(f"capacity {capacity:.1f} req/s (decode alone: {nominal:.1f}); "
          f"SLO: TTFT < {TTFT_SLO_S:.0f} s and e2e < {e2e_bound:.1f} s\n", flush=True)

    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        for policy in args.policies.split(","):
            cell = await run_cell(policy, load, fleet, capacity, args, e2e_bound)
            row = summarize(cell, e2e_bound, fleet, labels)
            rows.append(row)
            print(f"  {row['load']:>4} {policy:13s} done: completed {row['completed']}/{row['arrived']}, "
                  f"goodput {row['goodput']}, errors {row['errors']}", flush=True)

    table = markdown_table(rows, labels, with_lag=args.clock == "real")
    elapsed = time.perf_counter() - started
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    print("\n" + table)
    print(f"\nran in {elapsed:.0f} s")
    print(f"command: {command}")
    if args.write_results:
        fleet_desc = ", ".join(f"{n} x {c.label} ({c.max_num_seqs} seqs, {c.tokens_per_s:g} tok/s per seq)"
                               for c, (_, _, _, n) in zip(classes, FLEET))
        clock = ("simulated time (a discrete-event run of the same asyncio code, deterministic for the seed)"
                 if args.clock == "virtual" else "the wall clock")
        text = f"""# Routing benchmark: capacity-relative least-loaded vs round robin vs power of two

One model on four in-process SimEngine replicas, no Ray, on {clock}: {fleet_desc}, derived from the GPU catalog's
memory and bandwidth with a memory-bound decode model (docstring of `benchmarks/bench_routing.py`); capacity {capacity:.1f} req/s.
Poisson arrivals (fixed seed, identical for every policy) of streaming chat requests ({PROMPT_TOKENS} prompt, {args.output_tokens} output tokens)
for {args.seconds:g} s after a {args.warmup:g} s warm-up. Each router counts its own in-flight requests and polls the engines' running/waiting
every 250 ms as `serving/routing/router.py` does; least-loaded is `choose_replica`, p2c-raw compares the same load without dividing by max_num_seqs.
Goodput: TTFT < {TTFT_SLO_S:g} s and end-to-end < {e2e_bound:.1f} s (1 s + the slowest class's full-batch service time); ">x" = percentile fell on a request
still unfinished x s after arrival (cut off); offered is the Poisson rate, arrived what the seed drew. Round robin and p2c-raw overload the small replicas, so their latencies grow with the window.

{table}

`{command}` (ran in {elapsed:.0f} s on a shared 2-core machine).
"""
        Path(args.write_results).write_text(text)
        print(f"wrote {args.write_results}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.clock == "real":
        asyncio.run(main(arguments))
    else:
        loop = VirtualClockLoop()
        try:
            loop.run_until_complete(main(arguments))
        finally:
            loop.close()
