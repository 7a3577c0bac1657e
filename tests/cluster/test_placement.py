"""Every placement mode and policy on the simulated cluster (node-a: 2 x H100; node-b: 2 x L4 + A10; head: CPU)."""

import pytest

from tests.cluster.conftest import SIM_MODEL
from tests.harness import ROOT

pytestmark = pytest.mark.cluster

BIG_MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "meta-llama__Llama-3.1-70B")
H100S = {"node-a:gpu0", "node-a:gpu1"}


def spec(model_id: str, **kw) -> dict:
    return {"model_id": model_id, "model": SIM_MODEL, "engine": "sim", "max_input_prompt_length": 512,
            "max_output_prompt_length": 128, **kw}


def devices_of(plan_or_status: dict) -> list[list[str]]:
    reps = plan_or_status["replicas"]
    reps = reps.values() if isinstance(reps, dict) else reps
    return [r["devices"] for r in reps]


def test_pinned_tensor_parallel_group(clean):
    hive = clean
    r = hive.deploy(**spec("tp-pin", gpu=["node-a:gpu0", "node-a:gpu1"], replicas=1))
    assert r.status_code == 200, r.text
    (r0,) = r.json()["replicas"].values()
    assert r0["devices"] == ["node-a:gpu0", "node-a:gpu1"] and r0["settings"]["tensor_parallel_size"] == 2
    gpus = hive.gpus()
    assert gpus["node-a:gpu0"]["replicas"] == gpus["node-a:gpu1"]["replicas"] == ["tp-pin/r0"]


def test_auto_uses_the_smallest_tp_group_when_no_single_gpu_fits(clean):
    r = clean.admin.post("/plan", json=spec("big", model=BIG_MODEL, max_output_prompt_length=512))
    assert r.status_code == 200, r.text
    plan = r.json()
    assert devices_of(plan) == [sorted(H100S)]
    assert plan["replicas"][0]["settings"]["tensor_parallel_size"] == 2
    assert any("node-b" in rej["device"] for rej in plan["rejected"])  # each says why


def test_every_eligible_device(clean):
    hive = clean
    r = hive.deploy(**spec("everywhere", replicas=-1))
    assert r.status_code == 200, r.text
    placed = {d for devs in devices_of(r.json()) for d in devs}
    assert placed == {"node-a:gpu0", "node-a:gpu1", "node-b:gpu0", "node-b:gpu1", "node-b:gpu2"}


def test_auto_prefers_unshared_gpus_before_co_locating(clean):
    hive = clean
    first = hive.deploy(**spec("first"))
    second = hive.deploy(**spec("second"))
    assert first.status_code == second.status_code == 200
    a, b = devices_of(first.json())[0][0], devices_of(second.json())[0][0]
    assert {a, b} == H100S  # performance policy: the two H100s, one model each


def test_conserve_tdp_policy_prefers_the_frugal_card(clean):
    r = clean.admin.post("/plan", json=spec("frugal", allocation="conserve_tdp"))
    assert r.status_code == 200, r.text
    assert devices_of(r.json())[0][0] in {"node-b:gpu0", "node-b:gpu1"}  # L4, 72 W


def test_pins_to_the_same_gpu_co_locate_when_both_fit(clean):
    hive = clean
    small = {"max_num_seqs": 8, "kv_cache_memory_bytes": 2 * 2**30}
    assert hive.deploy(**spec("co-a", gpu="node-b:gpu2", vllm_kwargs=small)).status_code == 200
    assert hive.deploy(**spec("co-b", gpu="node-b:gpu2", vllm_kwargs=small)).status_code == 200
    assert hive.gpus()["node-b:gpu2"]["replicas"] == ["co-a/r0", "co-b/r0"]
