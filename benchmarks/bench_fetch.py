"""Getting weights onto a node: the hive's fetch against ``hf download``, and what a cached model adds to a deploy.

    python benchmarks/bench_fetch.py                      # ~3 min on 2 cores
    python benchmarks/bench_fetch.py --files 8 --file-mib 64 --rounds 3 --deploy-rounds 5
    python benchmarks/bench_fetch.py --skip-deploy         # the download part only (no Ray)

1. Throughput. One local Hub-compatible server (``tests/fixtures/fake_hub.py``, in this process)
   serves a multi-file model (``--files`` safetensors files of ``--file-mib`` MiB, plus its config).
   Each round downloads all of it into an empty cache twice, in turn: with ``hf download`` (the
   huggingface_hub CLI a user runs, ``--max-workers 8``) and with the hive's fetch
   (``hive_apps.core.weights``: list the source, then a node's ``WeightFetcher`` downloads, verifies each
   file's sha256 and moves it into place), each in its own process started the same way. The order
   alternates between rounds. Reported: MiB/s of each (median over rounds) and the ratio.
2. Deploy of a cached model. The hive as the quickstart starts it (``ray start``, ``serve deploy``),
   sim engines: ``POST /admin/models?wait=true`` of the same config from a local folder, and from the
   Hub repo once its weights are in the node's cache (the first Hub deploy fetches them and is not
   counted), interleaved, each after the last one's app has gone. Reported: the medians and their
   difference (on 2 cores a deploy varies by a second either way), and from the admin's log the
   hive's own steps for each (planning, with the listing; the room check; asking the node for the
   weights), which are what naming a Hub repo adds once its weights are on the node.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tests.fixtures.fake_hub import FakeHub  # noqa: E402

REPO = "bench/multi-file"
SIM_CONFIG = ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B" / "config.json"
MiB = 2**20

HIVE_FETCH = """
import sys, time
from pathlib import Path
from hive_apps.core.weights.fetcher import WeightFetcher
from hive_apps.core.weights.listing import list_source
from hive_apps.core.weights.source import parse_source
from hive_apps.core.weights.types import FetchState
manifest = list_source(parse_source(sys.argv[1]))
fetcher = WeightFetcher(Path(sys.argv[2]), "bench", workers=int(sys.argv[3]))
fetcher.ensure(manifest)
progress = fetcher.wait(manifest.key, 3600)
assert progress.state is FetchState.READY, progress.error
"""


def make_model(folder: Path, files: int, file_mib: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SIM_CONFIG, folder / "config.json")
    rng = random.Random(0)
    for i in range(files):
        (folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors").write_bytes(rng.randbytes(file_mib * MiB))
    return sum(p.stat().st_size for p in folder.iterdir())


def timed(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed: {run.stderr[-2000:]}")
    return time.perf_counter() - t


def throughput(hub: FakeHub, rounds: int, workers: int, total: int) -> tuple[float, float]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_OFFLINE", None)
    hf = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
    runs: dict[str, list[float]] = {"hf download": [], "hive fetch": []}
    for r in range(rounds):
        order = ["hf download", "hive fetch"] if r % 2 == 0 else ["hive fetch", "hf download"]
        for who in order:
            cache = Path(tempfile.mkdtemp(prefix="bench-fetch-"))
            try:
                argv = ([hf, "download", REPO, "--cache-dir", str(cache), "--max-workers", str(workers)]
                        if who == "hf download" else [sys.executable, "-c", HIVE_FETCH, REPO, str(cache), str(workers)])
                seconds = timed(argv, env)
                got = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.is_symlink())
                assert got >= total, f"{who} wrote {got} bytes of {total}"
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            runs[who].append(seconds)
            print(f"  round {r + 1}: {who:12s} {seconds:6.2f}s  {total / MiB / seconds:7.1f} MiB/s", flush=True)
    hf_s, hive_s = statistics.median(runs["hf download"]), statistics.median(runs["hive fetch"])
    return total / MiB / hf_s, total / MiB / hive_s


def deploy_overhead(hub: FakeHub, rounds: int, settle_s: float) -> tuple[float, float]:
    from bench_vs_vllm import ADMIN_TOKEN, start_hive_apps

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    workdir = Path(tempfile.mkdtemp(prefix="bench-fetch-deploy-"))
    folder = workdir / "local-model"
    folder.mkdir()
    shutil.copy(SIM_CONFIG, folder / "config.json")
    trees: dict = {}

    def deploy(model_id: str, model: str) -> float:
        body = {"model_id": model_id, "model": model, "engine": "sim", "max_input_prompt_length": 512,
                "max_output_prompt_length": 128, "vllm_kwargs": {"sim_tokens_per_s": 500}}
        t = time.perf_counter()
        r = httpx.post(f"{url}/admin/models", params={"wait": "true"}, json=body, headers=admin, timeout=600)
        seconds = time.perf_counter() - t
        if r.status_code != 200:
            raise RuntimeError(f"deploy {model}: HTTP {r.status_code} {r.text[:500]}")
        assert httpx.delete(f"{url}/admin/models/{model_id}", headers=admin, timeout=120).status_code == 200
        time.sleep(settle_s)  # the deleted app's router drains behind HAProxy: let it go before the next
        return seconds

    try:
        print("starting the hive (ray start, serve deploy) ...", flush=True)
        url, temp_dir, _ = start_hive_apps(workdir, {"HF_ENDPOINT": hub.url,
                                                     "HIVE_WEIGHTS_CACHE": str(workdir / "cache")}, trees)
        print(f"  Ray's logs: {temp_dir}/session_latest/logs/serve", flush=True)
        deploy("warm-up", str(folder))  # starts the planner's worker
        first = deploy("fetch", REPO)
        print(f"  first deploy from the Hub (fetches the weights): {first:.2f}s", flush=True)
        local, cached = [], []
        for i in range(rounds):
            local.append(deploy(f"local{i}", str(folder)))
            cached.append(deploy(f"hub{i}", REPO))
            print(f"  round {i + 1}: local folder {local[-1]:.2f}s, cached Hub repo {cached[-1]:.2f}s", flush=True)
        own = hive_steps(temp_dir / "session_latest" / "logs" / "serve")
        for kind in ("local", "hub"):
            steps = [own[f"{kind}{i}"] for i in range(rounds) if f"{kind}{i}" in own]
            if steps:
                print(f"  the hive's own steps, {kind:5s} (median of {len(steps)}): planning "
                      f"{statistics.median(s[0] for s in steps) * 1000:.0f} ms, room for the weights "
                      f"{statistics.median(s[1] for s in steps) * 1000:.0f} ms, weights on the node "
                      f"{statistics.median(s[2] for s in steps) * 1000:.0f} ms", flush=True)
        return statistics.median(local), statistics.median(cached)
    finally:
        for tree in trees.values():
            tree.stop()


def hive_steps(logs: Path) -> dict[str, tuple[float, float, float]]:
    """Per model id, from the admin's log: seconds planning, checking room for the weights on the
    nodes, and asking the nodes for the weights (the steps a cached Hub repo adds to, or not)."""
    plans, asks = {}, {}
    for path in logs.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if m := re.search(r"-- (\S+): planned in ([\d.]+)s, room for its weights checked in ([\d.]+)s", line):
                plans[m[1]] = (float(m[2]), float(m[3]))
            elif m := re.search(r"-- (\S+): weights on .*: ready \(asked in ([\d.]+)s\)", line):
                asks[m[1]] = float(m[2])
    return {k: (*plans[k], asks[k]) for k in plans if k in asks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--deploy-rounds", type=int, default=5)
    ap.add_argument("--skip-deploy", action="store_true")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between deploys (a deleted app's router drains)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-fetch-model-"))
    total = make_model(work / "model", args.files, args.file_mib)
    with FakeHub() as hub:
        hub.add_repo(REPO, work / "model")
        print(f"{args.files} x {args.file_mib} MiB safetensors + config ({total / MiB:.0f} MiB) from {hub.url}, "
              f"{args.workers} parallel downloads each", flush=True)
        hf_rate, hive_rate = throughput(hub, args.rounds, args.workers, total)
        print(f"\nmedians: hf download {hf_rate:.1f} MiB/s, hive fetch {hive_rate:.1f} MiB/s: "
              f"hive / hf download = {hive_rate / hf_rate:.2f}x (target >= 0.90x)")
        if not args.skip_deploy:
            local, cached = deploy_overhead(hub, args.deploy_rounds, args.settle)
            print(f"\nmedians: POST ?wait=true of a local folder {local:.2f}s, of a cached Hub repo {cached:.2f}s: "
                  f"+{cached - local:.2f}s for naming the Hub repo (target <= 0.50s)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
