"""How long the admin's deploys and deletes take, with the hive started as the quickstart starts it
(Serve's HAProxy ingress when installed, ``hive_apps/ops/serve_env.py``'s settings).

    python benchmarks/bench_deploy_delete.py               # ~2.5 min on 2 cores
    python benchmarks/bench_deploy_delete.py --rounds 10
    python benchmarks/bench_deploy_delete.py --hive-env RAY_SERVE_ENABLE_HA_PROXY=0   # Serve's Python proxy

Sim engines (answering at 500 tokens/s) on the CPU node, so the figures are the hive's and
Serve's own, not an engine's start. Each round deploys a new id (``POST /admin/models?wait=true``
until it answers ready), sends its first chat through ``/<id>/v1`` until one is answered, and
deletes it (``DELETE /admin/models/<id>``). Then one id is deployed again straight after its own
DELETE. The floor is what a user of plain Ray Serve waits for the same steps: ``serve.run`` of an
app of one do-nothing deployment at its own route (it returns once the app runs), its first HTTP
answer there, and ``serve.delete`` (blocking, as ``serve delete`` is), in the same cluster. The
hive's extra is its planning, its records and reservations, and a router in front of each engine.
Stops only the ``ray start --block`` process it launched (and anything left of its tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_vllm import ADMIN_TOKEN, API_KEY, FLOOR_DRIVER, ROOT, start_hive_apps  # noqa: E402

# The floor: the same steps with Ray Serve's own API, from a driver of the hive's cluster.
FLOOR = FLOOR_DRIVER + """
import json, time
import httpx
for i in range(int(sys.argv[3])):
    name = f"floor{i}"
    t = time.time()
    serve.run(Floor.bind(), name=name, route_prefix="/" + name)
    up = time.time() - t
    t = time.time()
    while httpx.get(f"{sys.argv[2]}/{name}", timeout=30).status_code != 200:
        time.sleep(0.05)
    answer = time.time() - t
    t = time.time()
    serve.delete(name)
    print(json.dumps([up, answer, time.time() - t]), flush=True)
"""

SIM_MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
API = {"Authorization": f"Bearer {API_KEY}"}


def spec(model_id: str) -> dict:
    return {"model_id": model_id, "model": SIM_MODEL, "engine": "sim", "max_input_prompt_length": 512,
            "max_output_prompt_length": 128, "vllm_kwargs": {"sim_tokens_per_s": 500}}


def deploy(url: str, model_id: str) -> float:
    t = time.time()
    r = httpx.post(f"{url}/admin/models", params={"wait": "true"}, json=spec(model_id), headers=ADMIN, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"POST /admin/models ({model_id}): HTTP {r.status_code} {r.text[:500]}")
    return time.time() - t


def first_chat(url: str, model_id: str) -> tuple[float, list[int]]:
    """Seconds until a chat through the model's own route is answered, and what came before."""
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    t, codes = time.time(), []
    while True:
        code = httpx.post(f"{url}/{model_id}/v1/chat/completions", json=body, headers=API, timeout=30).status_code
        if code == 200:
            return time.time() - t, codes
        codes.append(code)
        if time.time() - t > 60:
            raise RuntimeError(f"/{model_id}/v1 never answered: {codes[-5:]}")
        time.sleep(0.05)


def delete(url: str, model_id: str) -> float:
    t = time.time()
    r = httpx.delete(f"{url}/admin/models/{model_id}", headers=ADMIN, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"DELETE /admin/models/{model_id}: HTTP {r.status_code} {r.text[:500]}")
    return time.time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--floor-rounds", type=int, default=2, help="rounds of the plain-Serve floor")
    ap.add_argument("--hive-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the Ray head, over the quickstart's, repeatable")
    args = ap.parse_args()
    extra_env = dict(kv.split("=", 1) for kv in args.hive_env)
    workdir = Path(tempfile.mkdtemp(prefix="bench-deploy-delete-"))
    trees: dict = {}
    try:
        print("starting the hive (ray start, serve deploy) ...", flush=True)
        url, temp_dir, _ = start_hive_apps(workdir, extra_env, trees)
        deploy(url, "warm-up")  # the first deploy also starts the planner's worker
        delete(url, "warm-up")
        rows = []
        for i in range(args.rounds):
            model_id = f"m{i}"
            d = deploy(url, model_id)
            c, before = first_chat(url, model_id)
            x = delete(url, model_id)
            rows.append((d, c, x))
            print(f"  {model_id}: POST -> ready {d:5.2f}s, then first chat via /{model_id}/v1 {c:5.2f}s"
                  f"{f' (first answers {before[:5]})' if before else ''}, DELETE {x:5.2f}s", flush=True)
        again = deploy(url, f"m{args.rounds - 1}")
        print(f"  m{args.rounds - 1} deployed again straight after its DELETE: POST -> ready {again:5.2f}s")
        delete(url, f"m{args.rounds - 1}")
        address = (temp_dir / "ray_current_cluster").read_text().strip()
        run = subprocess.run([sys.executable, "-c", FLOOR, address, url, str(args.floor_rounds)], capture_output=True,
                             text=True, timeout=600, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        floor = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("[")]
        if run.returncode != 0 or not floor:
            raise RuntimeError(f"the plain-Serve floor failed: {run.stderr[-2000:]}")
        for i, (u, a, x) in enumerate(floor):
            print(f"  plain Serve floor{i}: serve.run {u:5.2f}s, then first answer {a:5.2f}s, serve.delete {x:5.2f}s")
        med = [statistics.median(col) for col in zip(*rows)]
        fmed = [statistics.median(col) for col in zip(*floor)]
        print(f"\nmedians: hive ({args.rounds}): POST -> ready {med[0]:.2f}s, first chat after ready {med[1]:.2f}s, "
              f"DELETE {med[2]:.2f}s; plain Serve ({len(floor)}): serve.run {fmed[0]:.2f}s, first answer "
              f"{fmed[1]:.2f}s, serve.delete {fmed[2]:.2f}s")
        print(f"hive / plain Serve: deploy {med[0] / fmed[0]:.2f}x, first answer {med[1] / fmed[1]:.2f}x, "
              f"delete {med[2] / fmed[2]:.3f}x")
    finally:
        for t in trees.values():
            t.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
