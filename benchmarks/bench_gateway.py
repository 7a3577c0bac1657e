"""Added latency and throughput of the hive's HTTP paths against calling the engine directly.

    python benchmarks/bench_gateway.py [--engine sim|vllm] [--stream] [--rounds 3] [--requests 100] [--concurrency 32] [--seconds 8]

Starts a local two-node cluster (one simulated H100 for the sim engine; the CPU node for
the tiny vLLM model), then sends one-token chat requests
  - to the engine deployment over a Serve handle from this process (no HTTP at all),
  - to the same engine class deployed as its own HTTP app, ``/bench-direct`` (proxy -> engine):
    the floor every HTTP path is measured against,
  - to ``/<model_id>/v1`` (proxy -> router -> engine),
  - to ``/v1`` (proxy -> gateway -> engine).
The direct engine and the hive's engine (same plan, same device) stay up side by side, and
the paths are measured in turns, round after round, so a slow minute of this shared
machine does not land on one path only. Prints, per path, the median over rounds of the
sequential p50/p99 and of requests/s at the given concurrency, and what each path adds to
the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import API_KEY, ROOT, start_hive, stop_hive  # noqa: E402

SIM_MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")

Result = tuple[list[float], float]  # sequential latencies (s), requests/s under concurrency


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def measure(one, n: int, conc: int, seconds: float) -> Result:
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


async def http_path(url: str, body: dict, n: int, conc: int, seconds: float) -> Result:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=httpx.Limits(max_connections=conc)) as c:
        async def one():
            async with c.stream("POST", url, json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
                assert r.status_code == 200, r.status_code

        return await measure(one, n, conc, seconds)


async def handle_path(app: str, body: dict, n: int, conc: int, seconds: float) -> Result:
    from ray import serve

    from hive_apps.serving.engine.protocol import ForwardedRequest

    h = serve.get_deployment_handle("engine-direct", app_name=app)
    stream_h = h.options(stream=True)
    req = ForwardedRequest(path="/v1/chat/completions", body=json.dumps(body).encode(),
                           headers=[("content-type", "application/json")])

    async def one():
        if body.get("stream"):
            async for _ in stream_h.forward.remote(req):
                pass
        else:
            start, _ = await h.forward_unary.remote(req)
            assert start.status == 200, start.status

    return await measure(one, n, conc, seconds)


def direct_engine_app(spec: dict, plan_json: dict, sim: bool):
    """The model's first replica as an HTTP app of its own: the engine with nothing in front."""
    from ray import serve
    from starlette.requests import Request

    from hive_apps.control.admin.model_app import engine_class, replica_actor_options
    from hive_apps.core.planning.types import Plan
    from hive_apps.serving.routing.http import read_forwarded, to_response

    rp = Plan.model_validate(plan_json).replicas[0]
    base = engine_class("sim" if sim else "vllm")

    class DirectEngine(base):
        async def __call__(self, request: Request):
            req = await read_forwarded(request, request.url.path[len(request.scope.get("root_path", "")):])
            return await to_response(self.forward(req))

    args = (spec["model_id"], plan_json["profile"]["path"], rp) + ((False,) if sim else ())
    return serve.deployment(DirectEngine, name="engine-direct", max_ongoing_requests=10_000,
                            ray_actor_options=replica_actor_options(rp)).bind(*args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    ap.add_argument("--stream", action="store_true", help="streamed answers (SSE) instead of one JSON body")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8)
    args = ap.parse_args()
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray-hive-bench")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    sim = args.engine == "sim"
    if sim:
        spec = {"model_id": "bench", "model": SIM_MODEL, "engine": "sim", "gpu": "node-a:gpu0",
                "vllm_kwargs": {"sim_tokens_per_s": 100000}}
        nodes = [{"labels": {"ray-hive/node": "node-a", "ray-hive/sim-gpus": "H100-80GB"}}]
    else:
        from hive_apps.models.tiny import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-chat"))
        spec = {"model_id": "bench", "model": model, "max_input_prompt_length": 512, "max_output_prompt_length": 128}
        nodes = [{"labels": {"ray-hive/node": "node-a"}}]
    body = {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "stream": args.stream}
    run = (args.requests, args.concurrency, args.seconds)
    hive = start_hive(nodes)
    try:
        from ray import serve

        r = hive.admin.post("/plan", json=spec)
        assert r.status_code == 200, r.text
        serve.run(direct_engine_app(spec, r.json(), sim), name="bench-direct", route_prefix="/bench-direct")
        r = hive.deploy(**spec)
        assert r.status_code == 200, r.text
        paths = {
            "engine over a handle": lambda: handle_path("bench-direct", body, *run),
            "engine over HTTP (floor)": lambda: http_path(f"{hive.url}/bench-direct/v1/chat/completions", body, *run),
            "/bench/v1 (router)": lambda: http_path(f"{hive.url}/bench/v1/chat/completions", body, *run),
            "/v1 (gateway)": lambda: http_path(f"{hive.url}/v1/chat/completions", body, *run),
        }
        rounds: dict[str, list[Result]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, measure_path in paths.items():
                rounds[name].append(asyncio.run(measure_path()))
    finally:
        stop_hive(hive)
    rows = {name: (statistics.median(statistics.median(lat) for lat, _ in results) * 1000,
                   statistics.median(pct(lat, 0.99) for lat, _ in results),
                   statistics.median(rps for _, rps in results)) for name, results in rounds.items()}
    floor_p50, _, floor_rps = rows["engine over HTTP (floor)"]
    kind = "sim engine" if sim else "tiny vLLM model (CPU)"
    print(f"\n{kind}, 1-token chat{' (streamed)' if args.stream else ''}; {args.rounds} rounds of {args.requests} "
          f"sequential requests, then {args.concurrency} concurrent for {args.seconds:.0f}s; medians over rounds")
    print(f"| path | p50 ms | p99 ms | added p50 ms | req/s @{args.concurrency} | throughput vs floor |")
    print("|---|---|---|---|---|---|")
    for name, (p50, p99, rps) in rows.items():
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {p50 - floor_p50:+.1f} | {rps:.1f} | {100 * (rps / floor_rps - 1):+.0f} % |")
    flags = (" --engine vllm" if not sim else "") + (" --stream" if args.stream else "")
    print(f"\ncommand: python benchmarks/bench_gateway.py{flags}")


if __name__ == "__main__":
    main()
