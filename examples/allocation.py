"""Allocation policies: where automatic placement puts a model under each built-in policy.

Asks POST /admin/plan (a dry run: it reserves nothing) for the same model under
``allocation: performance`` (fastest device for this model first: throughput estimate, then
memory bandwidth, then room) and ``allocation: conserve_tdp`` (lowest board power first), and
prints the device, its TDP and the planned tokens/s of each. ``--deploy`` then deploys it with
the chosen policy. A policy of your own is a class named in
``vllm_kwargs.hive_placement_policy`` (README "Planning hooks").

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=...
    python examples/allocation.py --model Qwen/Qwen3-0.6B
    python examples/allocation.py --model /models/qwen3 --engine sim --deploy conserve_tdp
"""

from __future__ import annotations

from _hive import accelerators, admin, check, delete, deploy, openai_client, parser, spec

POLICIES = ["performance", "conserve_tdp"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--deploy", choices=POLICIES, help="then deploy with this policy and ask it a question")
    args = p.parse_args()
    hive = admin()
    tdp = {d["device"]["id"]: d["device"].get("tdp_w") for d in accelerators(hive)}
    for policy in POLICIES:
        plan = check(hive.post("/plan", json=spec(args, f"by-{policy.replace('_', '-')}", allocation=policy)))
        for rep in plan["replicas"]:
            devs = ",".join(rep["devices"])
            tps = rep.get("expected_tokens_per_s")
            print(f"{policy}: {devs} (TDP {tdp.get(rep['devices'][0]) or '?'} W), "
                  f"max_num_seqs={rep['settings']['max_num_seqs']}, "
                  f"expected {tps:.0f} tokens/s" if tps else f"{policy}: {devs}")
    if args.deploy:
        model_id = f"by-{args.deploy.replace('_', '-')}"
        try:
            st = deploy(hive, spec(args, model_id, allocation=args.deploy))
            print(f"deployed {model_id} on {[r['devices'] for r in st['replicas'].values()]}")
            r = openai_client().chat.completions.create(model=model_id, max_tokens=8,
                                                        messages=[{"role": "user", "content": "Hi"}])
            print(f"{model_id} says: {r.choices[0].message.content!r}")
        finally:
            delete(hive, model_id)


if __name__ == "__main__":
    main()
