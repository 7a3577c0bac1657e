"""Added latency and throughput of the hive's HTTP path, with the sim engine (no token cost).

    python benchmarks/bench_gateway.py [--requests 300] [--concurrency 32] [--seconds 10]

Starts a local two-node cluster (one simulated H100), deploys a sim model, and compares
one-token chat requests sent
  - directly to the engine deployment over a Serve handle (the floor),
  - to /<model_id>/v1 (proxy -> router -> engine),
  - to /v1 (proxy -> gateway -> router -> engine).
Prints p50/p99 latency of sequential requests and requests/s at the given concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import API_KEY, ROOT, start_hive, stop_hive  # noqa: E402

MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")
BODY = {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def http_path(url: str, n: int, conc: int, seconds: float) -> tuple[list[float], float]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=60, limits=httpx.Limits(max_connections=conc)) as c:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            r = await c.post(url, json=BODY)
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
        done = 0
        end = time.perf_counter() + seconds

        async def worker():
            nonlocal done
            while time.perf_counter() < end:
                r = await c.post(url, json=BODY)
                assert r.status_code == 200
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return lat, done / (time.perf_counter() - t0)


async def handle_path(n: int, conc: int, seconds: float) -> tuple[list[float], float]:
    from ray import serve

    from hive_apps.engine.protocol import ForwardedRequest

    h = serve.get_deployment_handle("engine-r0", app_name="bench").options(stream=True)
    req = ForwardedRequest(path="/v1/chat/completions", body=json.dumps(BODY).encode(),
                           headers=[("content-type", "application/json")])

    async def one():
        async for _ in h.forward.remote(req):
            pass

    lat = []
    for _ in range(n):
        t = time.perf_counter()
        await one()
        lat.append(time.perf_counter() - t)
    done = 0
    end = time.perf_counter() + seconds

    async def worker():
        nonlocal done
        while time.perf_counter() < end:
            await one()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return lat, done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray-hive-bench")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    hive = start_hive([{"labels": {"ray-hive/node": "node-a", "ray-hive/sim-gpus": "H100-80GB"}}])
    try:
        r = hive.deploy(model_id="bench", model=MODEL, engine="sim", gpu="node-a:gpu0",
                        vllm_kwargs={"sim_tokens_per_s": 100000})
        assert r.status_code == 200, r.text
        rows = [("engine handle (floor)", asyncio.run(handle_path(args.requests, args.concurrency, args.seconds))),
                ("/bench/v1 (router)", asyncio.run(http_path(f"{hive.url}/bench/v1/chat/completions", args.requests, args.concurrency, args.seconds))),
                ("/v1 (gateway)", asyncio.run(http_path(f"{hive.url}/v1/chat/completions", args.requests, args.concurrency, args.seconds)))]
    finally:
        stop_hive(hive)
    floor_p50 = statistics.median(rows[0][1][0]) * 1000
    print(f"\nsim engine, 1-token chat; {args.requests} sequential requests, then {args.concurrency} concurrent for {args.seconds:.0f}s")
    print(f"{'path':24} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13} {'req/s @' + str(args.concurrency):>12}")
    for name, (lat, rps) in rows:
        p50 = statistics.median(lat) * 1000
        print(f"{name:24} {p50:8.1f} {pct(lat, 0.99):8.1f} {p50 - floor_p50:13.1f} {rps:12.1f}")
    print("\ncommand: python benchmarks/bench_gateway.py")


if __name__ == "__main__":
    main()
