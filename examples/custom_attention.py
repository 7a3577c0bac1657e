"""A custom attention class: tell the planner how a model's KV cache (or its media tokens) really
grows, where its built-in family would get it wrong.

``vllm_kwargs["hive_attention_cls"]`` names a class in a package the operator lists in
``HIVE_HOOK_PACKAGES`` on the hive's nodes (the hive imports nothing else). The class is mixed in
front of the model's family, so ``super()`` is the default; it may define
``kv_bytes_per_token(tensor_parallel_size)``, ``kv_bytes_per_sequence(max_model_len,
tensor_parallel_size, block_size)`` or ``mm_max_tokens_per_item(mm_processor_kwargs)`` (README
"Planning hooks"). For example, in ``myhooks/attention.py`` on every node:

    class DoubleKV:  # this model keeps twice the KV its config suggests
        def kv_bytes_per_token(self, tensor_parallel_size):
            return 2 * super().kv_bytes_per_token(tensor_parallel_size)

This script asks POST /admin/plan (a dry run) for the model with and without the class and
prints what changed: KV bytes per token, the KV cache and how many sequences fit. A class from
a package the operator did not list is refused (4xx, with the reason). ``--deploy`` then deploys
the model planned with the class.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/custom_attention.py --cls myhooks.attention.DoubleKV
    python examples/custom_attention.py --model /models/qwen3 --engine sim --cls myhooks.attention.DoubleKV --deploy
"""

from __future__ import annotations

from _hive import admin, check, deploy_and_ask, parser, spec


def summary(plan: dict) -> str:
    rep = plan["replicas"][0]
    s = rep["settings"]
    return (f"kv_bytes_per_token={plan['profile']['kv_bytes_per_token']}, "
            f"kv_cache={s['kv_cache_memory_bytes'] / 2**20:.0f} MiB, max_num_seqs={s['max_num_seqs']} "
            f"on {rep['devices']}")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--cls", required=True, help="pkg.module.Class, from a package in the hive's HIVE_HOOK_PACKAGES")
    p.add_argument("--deploy", action="store_true", help="then deploy the model planned with the class")
    args = p.parse_args()
    hive = admin()
    base = check(hive.post("/plan", json=spec(args, "plain")))
    print(f"family only: {summary(base)}")
    hooked_spec = spec(args, "hooked", vllm_kwargs={"hive_attention_cls": args.cls})
    hooked = check(hive.post("/plan", json=hooked_spec))
    print(f"with {args.cls}: {summary(hooked)}")
    ratio = hooked["profile"]["kv_bytes_per_token"] / base["profile"]["kv_bytes_per_token"]
    print(f"KV per token x{ratio:g}")
    r = hive.post("/plan", json=spec(args, "stranger", vllm_kwargs={"hive_attention_cls": "not_listed.hooks.Mine"}))
    print(f"a class outside HIVE_HOOK_PACKAGES: {r.status_code} {r.json()['error']['message']!r}")
    if args.deploy:
        deploy_and_ask(hive, hooked_spec)


if __name__ == "__main__":
    main()
