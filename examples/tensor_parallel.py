"""Tensor parallel: one replica spread over several GPUs of one node.

A deploy whose ``gpu`` is a list of devices on one node with ``replicas: 1`` is one
tensor-parallel group (``tensor_parallel_size`` = the number of devices). The script finds a
node with at least ``--tp`` GPUs (or takes ``--gpu`` ids), asks POST /admin/plan (a dry run)
and prints the per-rank plan; ``--deploy`` also deploys it and asks it a question (that needs
the GPUs, or ``--engine sim``).

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/tensor_parallel.py --model Qwen/Qwen3-8B --tp 2 --deploy
    python examples/tensor_parallel.py --model /models/qwen3 --engine sim
"""

from __future__ import annotations

import sys
from collections import defaultdict

from _hive import accelerators, admin, check, deploy_and_ask, gib, parser, spec


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tp", type=int, default=2, help="GPUs in the group")
    p.add_argument("--gpu", nargs="+", help="the devices, all on one node (default: the first node with --tp GPUs)")
    p.add_argument("--deploy", action="store_true", help="deploy the plan and ask it a question")
    args = p.parse_args()
    hive = admin()
    gpus = args.gpu
    if not gpus:
        by_node = defaultdict(list)
        for d in accelerators(hive):
            by_node[d["device"]["node_name"]].append(d["device"]["id"])
        nodes = [sorted(ids)[: args.tp] for ids in by_node.values() if len(ids) >= args.tp]
        if not nodes:
            sys.exit(f"no node has {args.tp} GPUs: {dict(by_node)}")
        gpus = nodes[0]
    body = spec(args, "tp-group", gpu=gpus, replicas=1)
    plan = check(hive.post("/plan", json=body))
    rep = plan["replicas"][0]
    s, mem = rep["settings"], rep["memory"]
    print(f"plan: tensor_parallel_size={s['tensor_parallel_size']} on {rep['devices']} ({rep['node_name']}); "
          f"per rank: weights {gib(mem['weights'])}, KV cache {gib(mem['kv_cache'])}; "
          f"max_num_seqs={s['max_num_seqs']}, max_model_len={s['max_model_len']}")
    if args.deploy:
        deploy_and_ask(hive, body)


if __name__ == "__main__":
    main()
