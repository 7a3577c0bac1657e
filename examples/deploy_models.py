"""Deploy several model configs side by side and show where the hive put each.

Three deploys of the same weights with different configs, over POST /admin/models:
``auto`` (automatic placement, one replica), ``pair`` (two replicas on two devices, sized to
serve 32 requests at once), ``napper`` (may sleep after 10 minutes without requests, and be
evicted for other models at priority 5). Prints each model's devices and planned engine
settings, asks each one question, then deletes them (``--keep`` leaves them up). The three
deploys go out at once without ``?wait=true``: each answers 202 with a ``status_url`` to poll.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/deploy_models.py --model Qwen/Qwen3-0.6B            # real vLLM engines
    python examples/deploy_models.py --model /models/qwen3 --engine sim  # simulated, no GPU
"""

from __future__ import annotations

from _hive import admin, check, delete, openai_client, parser, spec, wait_for


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--keep", action="store_true", help="leave the models deployed")
    args = p.parse_args()
    hive = admin()
    bodies = [
        spec(args, "auto"),
        spec(args, "pair", replicas=2, max_concurrency=32),
        spec(args, "napper", sleep_timeout=600, priority=5),
    ]
    try:
        for body in bodies:  # all at once: the hive plans and starts them side by side
            accepted = check(hive.post("/models", json=body))
            print(f"{body['model_id']}: {accepted['status']}, poll {accepted['status_url']}")
        for body in bodies:
            st = wait_for(hive, body["model_id"], lambda b: b["status"] in ("ready", "failed"), timeout=900)
            if st["status"] != "ready":
                raise SystemExit(f"{st['model_id']} failed: {st['message']}")
            print(f"{st['model_id']}: {st['status']} in {st['deploy_seconds']:.1f} s, route {st['route']}")
            for name, rep in st["replicas"].items():
                s = rep["settings"]
                print(f"  {name} on {','.join(rep['devices'])}: max_model_len={s['max_model_len']} "
                      f"max_num_seqs={s['max_num_seqs']} tp={s['tensor_parallel_size']}")
        client = openai_client()
        for body in bodies:
            r = client.chat.completions.create(model=body["model_id"], max_tokens=8,
                                               messages=[{"role": "user", "content": "Say hello."}])
            print(f"{body['model_id']} says: {r.choices[0].message.content!r}")
        listed = sorted(m.id for m in client.models.list().data)
        print(f"deployed {len(bodies)} models; /v1/models lists {listed}")
    finally:
        if not args.keep:
            delete(hive, *(b["model_id"] for b in bodies))


if __name__ == "__main__":
    main()
