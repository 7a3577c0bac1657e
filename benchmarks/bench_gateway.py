"""Added latency and throughput of the hive's HTTP paths against calling the engine directly.

    python benchmarks/bench_gateway.py [--engine sim|vllm] [--stream] [--requests 300] [--concurrency 32] [--seconds 10]

Starts a local two-node cluster (one simulated H100 for the sim engine; the CPU node for
the tiny vLLM model), then sends one-token chat requests
  - to the engine deployment over a Serve handle from this process (no HTTP at all),
  - to the same engine class deployed as its own HTTP app, ``/bench-direct`` (proxy -> engine):
    the floor every HTTP path is measured against,
  - to ``/<model_id>/v1`` (proxy -> router -> engine),
  - to ``/v1`` (proxy -> gateway -> engine).
The direct engine runs first and is deleted before the hive deploys the model, so only one
engine is ever up. Prints p50/p99 of sequential requests, requests/s at the given
concurrency, and what each path adds to the floor.
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

    from hive_apps.engine.protocol import ForwardedRequest

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

    from hive_apps.admin.model_app import engine_class, replica_actor_options
    from hive_apps.planning.types import Plan
    from hive_apps.routing.http import read_forwarded, to_response

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
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10)
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
        rows = [("engine over a handle", asyncio.run(handle_path("bench-direct", body, *run))),
                ("engine over HTTP (floor)", asyncio.run(http_path(f"{hive.url}/bench-direct/v1/chat/completions", body, *run)))]
        serve.delete("bench-direct")
        r = hive.deploy(**spec)
        assert r.status_code == 200, r.text
        rows += [("/bench/v1 (router)", asyncio.run(http_path(f"{hive.url}/bench/v1/chat/completions", body, *run))),
                 ("/v1 (gateway)", asyncio.run(http_path(f"{hive.url}/v1/chat/completions", body, *run)))]
    finally:
        stop_hive(hive)
    floor_lat, floor_rps = rows[1][1]
    floor_p50 = statistics.median(floor_lat) * 1000
    kind = "sim engine" if sim else "tiny vLLM model (CPU)"
    print(f"\n{kind}, 1-token chat{' (streamed)' if args.stream else ''}; {args.requests} sequential requests, "
          f"then {args.concurrency} concurrent for {args.seconds:.0f}s")
    print(f"| path | p50 ms | p99 ms | added p50 ms | req/s @{args.concurrency} | throughput vs floor |")
    print("|---|---|---|---|---|---|")
    for name, (lat, rps) in rows:
        p50 = statistics.median(lat) * 1000
        print(f"| {name} | {p50:.1f} | {pct(lat, 0.99):.1f} | {p50 - floor_p50:+.1f} | {rps:.1f} | {100 * (rps / floor_rps - 1):+.0f} % |")
    flags = (" --engine vllm" if not sim else "") + (" --stream" if args.stream else "")
    print(f"\ncommand: python benchmarks/bench_gateway.py{flags}")


if __name__ == "__main__":
    main()
