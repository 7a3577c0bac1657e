"""Plain Ray CPU tasks on the hive's cluster.

The hive is Ray Serve apps on an ordinary Ray cluster, so the same cluster keeps running your
own Ray work: this script connects as a Ray driver (``RAY_ADDRESS``, default ``auto`` = the
cluster on this machine), estimates pi with ``--tasks`` CPU tasks and prints which nodes ran
them. It uses Ray, not the hive's HTTP API: it is about Ray tasks beside the hive. The tasks ask
for a fraction of a CPU so they fit beside the hive's actors on a small cluster.

    RAY_ADDRESS=auto python examples/ray_tasks.py --tasks 16
    RAY_ADDRESS=ray://head:10001 python examples/ray_tasks.py   # from outside (needs ray[client])
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import time
from collections import Counter

import ray


@ray.remote(num_cpus=0.25)
def sample(n: int, seed: int) -> tuple[int, str]:
    rng = random.Random(seed)
    inside = sum(1 for _ in range(n) if rng.random() ** 2 + rng.random() ** 2 <= 1.0)
    labels = ray.get_runtime_context().get_node_labels() if hasattr(ray.get_runtime_context(), "get_node_labels") else {}
    return inside, labels.get("ray-hive/node") or socket.gethostname()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--samples", type=int, default=200_000, help="per task")
    args = p.parse_args()
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="WARNING", log_to_driver=False)
    print(f"cluster: {len(ray.nodes())} nodes, {ray.cluster_resources().get('CPU', 0):g} CPUs")
    t = time.perf_counter()
    results = ray.get([sample.remote(args.samples, seed) for seed in range(args.tasks)], timeout=300)
    inside = sum(r[0] for r in results)
    pi = 4 * inside / (args.samples * args.tasks)
    print(f"pi ~ {pi:.4f} from {args.tasks} tasks in {time.perf_counter() - t:.1f} s; "
          f"tasks per node {dict(Counter(r[1] for r in results))}")
    ray.shutdown()


if __name__ == "__main__":
    main()
