"""Sleep, wake on request, and idle destroy.

Deploys ``sleepy`` with ``sleep_timeout`` (seconds without requests, then it sleeps). The
script waits while the model goes ``sleeping`` and then asleep (``resident: false``: its GPU
memory is released; its route and ``/v1/models`` entry stay), sends one chat request, which is
held while the hive wakes the model, and prints ``last_wake`` (how, placement, engine start or
wake, warm-up, total). Then it deploys ``brief`` with ``idle_timeout``, waits until the hive
destroyed it for idleness, and shows the 404 a request for it gets.

How it sleeps (``sleep_mode``): on GPUs vLLM's sleep mode keeps the engine in place, ``level1``
(weights in the node's RAM; wakes in about a second per 10 GiB) or ``level2`` (weights dropped,
reloaded on wake); vLLM on CPU has no sleep mode, so it sleeps ``warm`` (vLLM stopped, the
replica's process kept: its wake is vLLM's own start, no new process), or ``parked`` with
HIVE_WARM_PARK=0 (removed; its wake is a cold start, tens of seconds).

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/sleep_idle.py --model Qwen/Qwen3-0.6B --sleep-timeout 30
    python examples/sleep_idle.py --model /models/qwen3 --engine sim --sleep-timeout 2
"""

from __future__ import annotations

import time

import openai
from _hive import admin, delete, deploy, openai_client, parser, spec, wait_for


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sleep-timeout", type=float, default=30.0)
    p.add_argument("--idle-timeout", type=float, default=None, help="for `brief` (default: the sleep timeout)")
    args = p.parse_args()
    hive = admin()
    client = openai_client()
    ask = {"messages": [{"role": "user", "content": "Are you awake?"}], "max_tokens": 8}
    try:
        st = deploy(hive, spec(args, "sleepy", sleep_timeout=args.sleep_timeout))
        print(f"sleepy: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}, "
              f"sleeps after {args.sleep_timeout:g} s without requests")
        t = time.time()
        wait_for(hive, "sleepy", lambda b: b["status"] == "sleeping", timeout=args.sleep_timeout + 120)
        print(f"sleepy: sleeping after {time.time() - t:.1f} s")
        st = wait_for(hive, "sleepy", lambda b: not b["resident"], timeout=120)
        print(f"sleepy: asleep (sleep_mode={st['sleep_mode']}, resident={st['resident']}): {st['sleep_reason']}")

        t = time.time()
        r = client.chat.completions.create(model="sleepy", **ask)  # held until the model is awake
        print(f"sleepy: answered {r.choices[0].message.content!r} after {time.time() - t:.1f} s (it woke for it)")
        wake = wait_for(hive, "sleepy", lambda b: b["status"] == "ready" and b["last_wake"])["last_wake"]
        fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
        print(f"last_wake: how={wake['how']} placement={fmt(wake['placement_s'])} "
              f"engine_start={fmt(wake['engine_start_s'])} warm_up={fmt(wake['warm_up_s'])} "
              f"total={fmt(wake['total_s'])} evicted={wake['evicted']}")

        idle = args.idle_timeout or args.sleep_timeout
        deploy(hive, spec(args, "brief", idle_timeout=idle))
        st = wait_for(hive, "brief", lambda b: b["status"] == "destroyed", timeout=idle + 120)
        print(f"brief: destroyed: {st['message']}")
        try:
            client.chat.completions.create(model="brief", **ask)
        except openai.NotFoundError as e:
            print(f"brief: a request now gets 404: {e.body['message'] if isinstance(e.body, dict) else e}")
    finally:
        delete(hive, "sleepy", "brief")


if __name__ == "__main__":
    main()
