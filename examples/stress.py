"""A stress run: many concurrent chat requests, then req/s, latency and 429s.

Deploys ``stress`` (or uses ``--use MODEL_ID``) with a small ``max_queued_requests`` so the
hive's admission control shows: once every replica is full and the queue holds that many, more
requests get 429 with ``Retry-After`` instead of piling up. Sends ``--requests`` chats with at
most ``--concurrency`` in flight (plain async HTTP, so 429s are counted, not retried) and
prints requests/s, tokens/s, p50/p95 latency and the status codes. GET /admin/load during a
run shows each replica's running and waiting requests against its planned capacity.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/stress.py --model Qwen/Qwen3-0.6B --requests 2000 --concurrency 256
    python examples/stress.py --model /models/qwen3 --engine sim --requests 200 --concurrency 64
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter

import httpx
from _hive import API_KEY, URL, deployed, parser


async def run(model_id: str, requests: int, concurrency: int, max_tokens: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    codes: Counter = Counter()
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"{URL}/v1", headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=300, limits=limits) as client:
        async def one(i: int) -> None:
            nonlocal tokens
            async with gate:
                t = time.perf_counter()
                try:
                    r = await client.post("/chat/completions", json={
                        "model": model_id, "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": f"Request {i}: tell me something."}]})
                except httpx.HTTPError as e:
                    codes[type(e).__name__] += 1
                    return
                codes[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t)
                    tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    ok = codes.get(200, 0)
    q = statistics.quantiles(latencies, n=20) if len(latencies) >= 2 else [float("nan")] * 19
    print(f"{requests} requests, concurrency {concurrency}: {wall:.1f} s, {ok / wall:.1f} req/s ok, "
          f"{tokens / wall:.0f} tokens/s")
    print(f"latency p50 {q[9]:.2f} s, p95 {q[18]:.2f} s; status codes {dict(sorted(codes.items(), key=str))}")
    print(f"429s: {codes.get(429, 0)}")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--use", metavar="MODEL_ID", help="load a deployed model instead of deploying one")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-queued", type=int, default=8, help="the deploy's max_queued_requests")
    p.add_argument("--max-concurrency", type=int, default=16, help="the deploy's max_concurrency (planned seqs)")
    args = p.parse_args()
    model_id = args.use or "stress"
    with deployed(args, model_id, max_queued_requests=args.max_queued, max_concurrency=args.max_concurrency) as st:
        if st is not None:
            seqs = sum(r["settings"]["max_num_seqs"] for r in st["replicas"].values())
            print(f"stress: {len(st['replicas'])} replica(s), {seqs} sequences at once, {args.max_queued} may wait")
        asyncio.run(run(model_id, args.requests, args.concurrency, args.max_tokens))


if __name__ == "__main__":
    main()
