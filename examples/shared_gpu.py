"""Two models on one GPU.

Pins ``left`` and ``right`` to the same device (``--gpu node:gpuN``; default: the GPU with
the most available memory). The planner sizes each one's KV cache from what the device has
left, so both fit inside the memory budget. Prints the device's reservations from
GET /admin/gpus, then asks both models a question.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/shared_gpu.py --model Qwen/Qwen3-0.6B --gpu node-a:gpu0
    python examples/shared_gpu.py --model /models/qwen3 --engine sim
"""

from __future__ import annotations

from _hive import accelerators, admin, check, delete, deploy, gib, openai_client, parser, spec


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--gpu", help='a device id, "node:gpuN" (default: the one with the most available memory)')
    args = p.parse_args()
    hive = admin()
    gpu = args.gpu or accelerators(hive)[0]["device"]["id"]
    ids = ["left", "right"]
    try:
        for model_id in ids:
            st = deploy(hive, spec(args, model_id, gpu=gpu, max_concurrency=16))  # bounds its KV cache
            rep = st["replicas"]["r0"]
            mem = rep["memory"]
            print(f"{model_id}: {st['status']} on {rep['devices']}: weights {gib(mem['weights'])}, "
                  f"KV cache {gib(mem['kv_cache'])}, max_num_seqs {rep['settings']['max_num_seqs']}")
        dev = {d["device"]["id"]: d for d in check(hive.get("/gpus"))["devices"]}[gpu]
        print(f"{gpu} ({dev['device']['name']}): total {gib(dev['total_bytes'])}, "
              f"reserved {gib(dev['reserved_bytes'])}, available {gib(dev['available_bytes'])}, "
              f"replicas {dev['replicas']}")
        client = openai_client()
        for model_id in ids:
            r = client.chat.completions.create(model=model_id, max_tokens=8,
                                               messages=[{"role": "user", "content": "Who shares your GPU?"}])
            print(f"{model_id} says: {r.choices[0].message.content!r}")
        print(f"both on {gpu}: {sorted(dev['replicas'])}")
    finally:
        delete(hive, *ids)


if __name__ == "__main__":
    main()
