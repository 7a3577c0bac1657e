"""Weights from the page cache: vLLM's start with its weights cold on disk, in the page cache, and cold
with the engine's read-ahead (issue 27).

Run:  python benchmarks/bench_page_cache.py [--rounds 2] [--layers 16]

Builds a random-weight Qwen2 of about 0.5 GiB (bf16; the tiny model's tokenizer, 16 layers of width
1024) offline once, under ~/.cache/ray-hive/bench-page-cache. Then starts vLLM in a fresh process per
start, as an engine replica does (``AsyncLLM`` from vLLM's engine arguments, then one greedy request),
in three conditions, rounds alternating:

  warm          the weights in the node's page cache (read through just before);
  cold          evicted first (``posix_fadvise(DONTNEED)``: no root needed, ``core/weights/page_cache``);
  cold+ahead    evicted, then the process reads them through in a thread while it imports vLLM, as
                ``VLLMEngine`` does (``HIVE_READ_AHEAD``).

Prints, per start: what the page cache held before, vLLM's imports, vLLM's start (to the engine
ready), vLLM's own "Loading weights took" figure, and the first answer; then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hive_apps.core.weights import page_cache  # noqa: E402

CHILD = r"""
import asyncio, json, sys, threading, time
t0 = time.perf_counter()
folder, ahead = sys.argv[1], sys.argv[2] == "1"
if ahead:
    from hive_apps.core.weights.page_cache import read_through
    threading.Thread(target=read_through, args=(folder,), daemon=True).start()
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
imports = time.perf_counter() - t0

async def main():
    t1 = time.perf_counter()
    args = AsyncEngineArgs(model=folder, max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=64 * 2**20)
    engine = AsyncLLM.from_vllm_config(args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER),
                                       usage_context=UsageContext.OPENAI_API_SERVER)
    start = time.perf_counter() - t1
    t2 = time.perf_counter()
    async for out in engine.generate("A hive of bees is ready to serve. " * 6,
                                     SamplingParams(max_tokens=4, temperature=0), request_id="r"):
        pass
    first = time.perf_counter() - t2
    engine.shutdown()
    print("RESULT " + json.dumps({"imports": imports, "start": start, "first": first}), flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""

LOAD_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")


def build(out: Path, layers: int) -> Path:
    """A random-weight Qwen2 of the tiny model's tokenizer, ``layers`` layers of width 1024 (once)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hive_apps.models.tiny import build_tiny_model

    tiny = build_tiny_model(out.parent / "tiny-chat")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)
    base = json.loads((tiny / "config.json").read_text())
    config = Qwen2Config(vocab_size=base["vocab_size"], hidden_size=1024, intermediate_size=4096,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=base.get("bos_token_id"),
                         eos_token_id=base.get("eos_token_id"), pad_token_id=base.get("pad_token_id"), dtype="bfloat16")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def start(folder: Path, ahead: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "INFO"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(folder), "1" if ahead else "0"], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    result = next((json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        raise SystemExit(f"the vLLM start failed:\n{run.stderr[-3000:]}")
    loads = LOAD_LINE.findall(run.stdout + run.stderr)
    result["load_weights"] = float(loads[-1]) if loads else float("nan")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--cache", default="~/.cache/ray-hive/bench-page-cache")
    args = ap.parse_args()
    folder = build(Path(args.cache).expanduser() / f"qwen2-{args.layers}l", args.layers)
    size = page_cache.cached_bytes(folder)[1]
    print(f"model: {folder}, weights {size / 2**30:.2f} GiB; {args.rounds} rounds of warm, cold, cold+ahead")
    rows: dict[str, list[dict]] = {"warm": [], "cold": [], "cold+ahead": []}
    print("| round | condition | cached before | imports s | vLLM start s | vLLM's weight load s | first answer s |")
    print("|---|---|---|---|---|---|---|")
    for n in range(1, args.rounds + 1):
        for condition in rows:
            if condition == "warm":
                page_cache.read_through(folder)
            else:
                page_cache.drop(folder)
            cached = page_cache.cached_bytes(folder)[0] / size
            time.sleep(1.0)
            r = start(folder, ahead=condition == "cold+ahead")
            rows[condition].append(r)
            print(f"| {n} | {condition} | {cached:.0%} | {r['imports']:.1f} | {r['start']:.1f} | "
                  f"{r['load_weights']:.2f} | {r['first']:.2f} |", flush=True)
    print("\nmedians:")
    print("| condition | imports s | vLLM start s | vLLM's weight load s | imports + start s |")
    print("|---|---|---|---|---|")
    for condition, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("imports", "start", "load_weights")}
        total = statistics.median(r["imports"] + r["start"] for r in rs)
        print(f"| {condition} | {med['imports']:.1f} | {med['start']:.1f} | {med['load_weights']:.2f} | {total:.1f} |")


if __name__ == "__main__":
    main()
