"""Engine settings per device: throughput-first sizing, vLLM's rules, overrides, errors, the report."""

from __future__ import annotations

import math

import pytest

from hive_apps.core.catalog import GIB
from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.memory import CUDA_CONTEXT_BYTES, KV_FLOOR_BYTES, MIB, kv_need
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.report import render_plan_table
from hive_apps.core.planning.sizing import DEFAULT_SEQS
from hive_apps.core.planning.types import EngineSettings, PlanningError
from hive_apps.core.spec import ModelSpec
from tests.unit.planning_fixtures import cpu, fixture_path, gpu, profile

QWEN8 = "Qwen__Qwen3-8B"


def plan(name: str, devices, *, budget_is_applied: bool = True, **spec_fields):
    spec = ModelSpec(model_id="m", model=fixture_path(name), **spec_fields)
    prof = profile(name, **{k: v for k, v in spec.vllm_kwargs.items() if k in ("kv_cache_dtype", "runner")})
    return plan_deployment(spec, devices, prof, budget_is_applied=budget_is_applied)


def check_invariants(p, devices, prof) -> None:
    """What every plan must satisfy, whatever the device."""
    by_id = {dc.device.id: dc for dc in devices}
    for r in p.replicas:
        s, m = r.settings, r.memory
        assert r.reservation_bytes == m.total
        assert s.max_num_seqs <= s.max_num_batched_tokens
        assert s.kv_cache_memory_bytes > 0
        for dev_id in r.devices:
            dc = by_id[dev_id]
            assert m.total <= dc.available_bytes and m.total <= dc.free_bytes
            if r.device_kind is not DeviceKind.CPU:
                total = dc.device.total_bytes
                assert s.gpu_memory_utilization * total + CUDA_CONTEXT_BYTES <= dc.free_bytes  # vLLM start check
                assert s.gpu_memory_utilization * total >= m.total - CUDA_CONTEXT_BYTES  # covers the footprint
                assert s.gpu_memory_utilization == round(s.gpu_memory_utilization, 3)
        # KV holds max_num_seqs full-length requests, block-rounded, plus the null block
        on_cpu = r.device_kind is DeviceKind.CPU
        per_seq, block = kv_need(prof, s.max_model_len, s.tensor_parallel_size, prof.block_size(on_cpu),
                                 s.max_num_batched_tokens)
        if per_seq:
            assert s.kv_cache_memory_bytes >= s.max_num_seqs * per_seq + block
        for key, value in s.model_dump().items():
            assert r.engine_kwargs[key] == value
        assert not any(k.startswith("hive_") for k in r.engine_kwargs)


# ---- golden plans on five GPU types --------------------------------------------------------

# Exact EngineSettings for 1024 input / 1024 output tokens on one empty card (registry budget 0.90).
# A change here is a change of the planner's policy or memory model: update deliberately. (Issue #24's
# measured CUDA 13 context, cuBLAS and FlashInfer workspace added 558 MiB of overhead: two fewer
# 288 MiB sequences on the A100, L40S and L4.)
GOLDEN = {
    (QWEN8, "H100-80GB"): dict(max_num_seqs=179, max_num_batched_tokens=4096, gpu_memory_utilization=0.844,
                               kv_cache_memory_bytes=54058549248),
    (QWEN8, "A100-40GB"): dict(max_num_seqs=64, max_num_batched_tokens=1024, gpu_memory_utilization=0.863,
                               kv_cache_memory_bytes=19329712128),
    (QWEN8, "L40S"): dict(max_num_seqs=88, max_num_batched_tokens=1024, gpu_memory_utilization=0.861,
                          kv_cache_memory_bytes=26577469440),
    (QWEN8, "L4"): dict(max_num_seqs=16, max_num_batched_tokens=256, gpu_memory_utilization=0.866,
                        kv_cache_memory_bytes=4834197504),
    ("Qwen__Qwen3-0.6B", "T4"): dict(max_num_seqs=46, max_num_batched_tokens=2048, gpu_memory_utilization=0.768,
                                     kv_cache_memory_bytes=10806362112),
}


@pytest.mark.parametrize("name,card", sorted(GOLDEN))
def test_golden_plan(name, card):
    devices = [gpu(card, "a", 0)]
    p = plan(name, devices, max_input_prompt_length=1024, max_output_prompt_length=1024)
    check_invariants(p, devices, profile(name))
    r = p.replicas[0]
    expected = EngineSettings(tensor_parallel_size=1, max_model_len=2048, enforce_eager=False, **GOLDEN[name, card])
    assert r.settings == expected
    assert r.memory.weights == profile(name).weight_bytes_per_rank(1)
    # KV = max_num_seqs x 2048 tokens (128 blocks of 16) x KV/token + one null block
    per_token = profile(name).kv_bytes_per_token(1)
    assert r.settings.kv_cache_memory_bytes == (r.settings.max_num_seqs * 2048 + 16) * per_token
    assert r.expected_tokens_per_s > 0


def test_golden_default_demand_on_an_h100():
    """With HIVE_DEFAULT_DEMAND_SEQS=16 and no max_concurrency the same card gets 16 sequences, a
    quarter of it, not 0.838."""
    spec = ModelSpec(model_id="m", model=fixture_path(QWEN8), max_input_prompt_length=1024, max_output_prompt_length=1024)
    r = plan_deployment(spec, [gpu("H100-80GB", "a", 0)], profile(QWEN8), demand_seqs=DEFAULT_SEQS).replicas[0]
    assert r.settings == EngineSettings(tensor_parallel_size=1, max_model_len=2048, max_num_seqs=DEFAULT_SEQS,
                                        max_num_batched_tokens=256, gpu_memory_utilization=0.26,
                                        kv_cache_memory_bytes=4834197504, enforce_eager=False)


def test_golden_qwen3_8b_does_not_fit_a_t4():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("T4")], max_input_prompt_length=1024, max_output_prompt_length=1024)
    msg = err.value.message
    assert err.value.status_code == 422 and "needs 17.12 GiB, can give 14.40 GiB: short by 2.72 GiB" in msg


def test_bigger_faster_cards_get_more_sequences():
    seqs, tps = {}, {}
    for card in ("H100-80GB", "A100-40GB", "L4"):
        r = plan(QWEN8, [gpu(card)]).replicas[0]
        seqs[card], tps[card] = r.settings.max_num_seqs, r.expected_tokens_per_s
    assert seqs["H100-80GB"] > seqs["A100-40GB"] > seqs["L4"] >= 8
    assert tps["H100-80GB"] > tps["A100-40GB"] > tps["L4"]


def test_t4_takes_a_small_model_but_not_qwen3_8b():
    devices = [gpu("T4")]
    p = plan("meta-llama__Llama-3.2-1B-Instruct", devices)
    check_invariants(p, devices, profile("meta-llama__Llama-3.2-1B-Instruct"))
    assert any("float16" in n for n in p.replicas[0].notes)  # bf16 on compute capability 7.5
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, devices)
    assert "short by" in err.value.message


def test_plans_differ_by_card_and_fit_co_located_budgets():
    busy = gpu("H100-80GB", used_gib=40, hive_replicas=["x/r0"])
    p = plan(QWEN8, [busy])
    check_invariants(p, [busy], profile(QWEN8))
    assert p.replicas[0].settings.max_num_seqs < plan(QWEN8, [gpu("H100-80GB")]).replicas[0].settings.max_num_seqs


def test_budget_not_applied_keeps_a_margin():
    raw = gpu("L4", available=int(24 * GIB), free=int(24 * GIB))
    applied = plan(QWEN8, [raw]).replicas[0].memory.total
    guarded = plan(QWEN8, [raw], budget_is_applied=False).replicas[0].memory.total
    assert guarded <= 0.9 * raw.device.total_bytes < applied


def test_tensor_parallel_plan_for_llama_70b():
    devices = [gpu("H100-80GB", "a", 0), gpu("H100-80GB", "a", 1)]
    p = plan("meta-llama__Llama-3.1-70B", devices)
    check_invariants(p, devices, profile("meta-llama__Llama-3.1-70B"))
    r = p.replicas[0]
    assert r.memory.weights == profile("meta-llama__Llama-3.1-70B").weight_bytes_per_rank(2)
    assert r.memory.weights < profile("meta-llama__Llama-3.1-70B").weight_bytes / 2 * 1.01


# ---- CPU and the models the CPU tests run --------------------------------------------------


def test_tiny_model_on_cpu_is_modest_and_exact():
    devices = [cpu("c", total_gib=23, cores=2)]
    p = plan("tiny-qwen2", devices, max_input_prompt_length=1024, max_output_prompt_length=256)
    check_invariants(p, devices, profile("tiny-qwen2"))
    r = p.replicas[0]
    s = r.settings
    assert r.device_kind is DeviceKind.CPU and s.enforce_eager is True and s.gpu_memory_utilization == 0.9
    assert 1 * MIB < r.memory.weights < 2 * MIB
    assert 2 * MIB < s.kv_cache_memory_bytes < 64 * MIB
    assert 8 <= s.max_num_seqs <= 64 and s.max_num_batched_tokens == 2048
    # snapshot: KV = seqs x cdiv(1280, 128) blocks x 128 tokens x 512 B + one null block
    assert (s.max_num_seqs, s.kv_cache_memory_bytes) == (62, 62 * 10 * 128 * 512 + 128 * 512)
    assert r.engine_kwargs["kv_cache_memory_bytes"] == s.kv_cache_memory_bytes


def test_minilm_plan_on_cpu_reads_the_input_only():
    devices = [cpu("c", total_gib=23, cores=2)]
    p = plan("sentence-transformers__all-MiniLM-L6-v2", devices, max_input_prompt_length=256,
             max_output_prompt_length=0)
    check_invariants(p, devices, profile("sentence-transformers__all-MiniLM-L6-v2"))
    s = p.replicas[0].settings
    assert s.max_model_len == 256 and s.kv_cache_memory_bytes == KV_FLOOR_BYTES
    assert s.max_num_batched_tokens >= s.max_model_len
    assert p.profile.runner == "pooling" and p.profile.kv_bytes_per_token == 0


def test_pooling_length_beyond_positions_names_the_field():
    with pytest.raises(PlanningError) as err:
        plan("sentence-transformers__all-MiniLM-L6-v2", [cpu()], max_input_prompt_length=1024)
    assert "max_input_prompt_length" in err.value.message and "512" in err.value.message


def test_generate_length_beyond_positions_names_both_fields():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("H100-80GB")], max_input_prompt_length=40000, max_output_prompt_length=2000)
    assert err.value.status_code == 422
    assert "max_input_prompt_length" in err.value.message and "max_output_prompt_length" in err.value.message


# ---- overrides ---------------------------------------------------------------------------


def test_overrides_are_honoured_exactly():
    kw = {"max_num_seqs": 7, "max_num_batched_tokens": 3000, "max_model_len": 2000, "enforce_eager": True,
          "kv_cache_memory_bytes": 2 * GIB, "trust_remote_code": False}
    devices = [gpu("L4")]
    p = plan(QWEN8, devices, vllm_kwargs=kw)
    check_invariants(p, devices, profile(QWEN8))
    r = p.replicas[0]
    s = r.settings
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.enforce_eager, s.kv_cache_memory_bytes) == \
        (7, 3000, 2000, True, 2 * GIB)
    assert r.engine_kwargs["trust_remote_code"] is False
    assert r.memory.kv_cache == 2 * GIB


def test_user_utilization_is_kept_and_kv_fills_it():
    devices = [gpu("H100-80GB")]
    p = plan(QWEN8, devices, vllm_kwargs={"gpu_memory_utilization": 0.5})
    r = p.replicas[0]
    assert r.settings.gpu_memory_utilization == 0.5
    assert abs(r.memory.total - CUDA_CONTEXT_BYTES - 0.5 * devices[0].device.total_bytes) < 1 * MIB
    check_invariants(p, devices, profile(QWEN8))


def test_kv_only_override_derives_the_sequences():
    p = plan(QWEN8, [gpu("H100-80GB")], vllm_kwargs={"kv_cache_memory_bytes": 4 * GIB})
    s = p.replicas[0].settings
    per_seq, block = kv_need(profile(QWEN8), s.max_model_len, 1, 16, s.max_num_batched_tokens)
    assert s.kv_cache_memory_bytes == 4 * GIB and s.max_num_seqs == (4 * GIB - block) // per_seq


def test_too_big_override_reports_the_shortfall():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("L4")], vllm_kwargs={"max_num_seqs": 5000})
    msg = err.value.message
    assert err.value.status_code == 422 and "max_num_seqs=5000" in msg and "short by" in msg
    shortfall = int(msg.rsplit("(", 1)[1].split(" bytes")[0])
    assert shortfall > 100 * GIB  # 5000 x 1280 tokens x 144 KiB is ~880 GiB


def test_kv_override_too_small_for_one_request():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("L4")], vllm_kwargs={"kv_cache_memory_bytes": 1 * MIB})
    assert "kv_cache_memory_bytes" in err.value.message and "short by" in err.value.message


def test_utilization_above_free_memory_is_refused():
    busy = gpu("L4", used_gib=12)
    with pytest.raises(PlanningError) as err:
        plan("tiny-qwen2", [busy], vllm_kwargs={"gpu_memory_utilization": 0.9})
    assert "refuse to start" in err.value.message or "short by" in err.value.message


def test_invalid_override_types_are_422():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("L4")], vllm_kwargs={"max_num_seqs": 0})
    assert "max_num_seqs" in err.value.message
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("L4")], vllm_kwargs={"max_num_seqs": 4096, "max_num_batched_tokens": 2048})
    assert "max_num_seqs <= max_num_batched_tokens" in err.value.message


def test_chunked_prefill_off_keeps_batched_tokens_at_least_max_model_len():
    devices = [gpu("H100-80GB")]
    kw = {"enable_chunked_prefill": False}
    p = plan(QWEN8, devices, max_input_prompt_length=6000, max_output_prompt_length=2000, vllm_kwargs=kw)
    check_invariants(p, devices, profile(QWEN8))
    s = p.replicas[0].settings
    assert s.max_model_len == 8000 and s.max_num_batched_tokens >= 8000
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, devices, max_input_prompt_length=6000, max_output_prompt_length=2000,
             vllm_kwargs={**kw, "max_num_batched_tokens": 4096})
    assert err.value.status_code == 422 and "below max_model_len=8000" in err.value.message
    assert "by 3904 tokens" in err.value.message


def test_batched_tokens_never_below_max_num_seqs():
    p = plan(QWEN8, [gpu("H100-80GB")], max_input_prompt_length=128, max_output_prompt_length=128,
             vllm_kwargs={"max_num_seqs": 600})
    s = p.replicas[0].settings
    assert s.max_num_seqs == 600 and s.max_num_batched_tokens >= 600


def test_kv_cache_dtype_fp8_buys_more_sequences_on_ada():
    plain = plan(QWEN8, [gpu("L40S")]).replicas[0]
    fp8 = plan(QWEN8, [gpu("L40S")], vllm_kwargs={"kv_cache_dtype": "fp8"}).replicas[0]
    assert fp8.engine_kwargs["kv_cache_dtype"] == "fp8"
    assert fp8.settings.max_num_seqs > plain.settings.max_num_seqs


def test_bitsandbytes_is_refused_for_vllm_0_32_but_planned_for_sim():
    name = "community__Llama-3.1-8B-Instruct-bnb-int8"
    with pytest.raises(PlanningError) as err:
        plan(name, [gpu("L4")])
    assert err.value.status_code == 422 and "'bitsandbytes'" in err.value.message and "vLLM 0.32" in err.value.message
    sim = plan(name, [gpu("L4", kind=DeviceKind.SIM_GPU)], engine="sim").replicas[0]
    assert sim.memory.weights == profile(name).weight_bytes_per_rank(1)


def test_sim_engine_plans_with_the_same_math():
    real = plan(QWEN8, [gpu("L4")]).replicas[0]
    sim = plan(QWEN8, [gpu("L4", kind=DeviceKind.SIM_GPU)], engine="sim").replicas[0]
    assert sim.settings == real.settings and sim.memory == real.memory


def test_report_lists_replicas_and_rejections():
    p = plan(QWEN8, [gpu("L4", "a", 0), gpu("T4", "b", 0)], replicas=-1)
    text = render_plan_table(p)
    assert "a:gpu0" in text and "kv_cache_memory_bytes" in text and "GiB" in text
    assert "rejected devices" in text and "b:gpu0" in text and "short by" in text
    assert math.isfinite(p.replicas[0].expected_tokens_per_s)


def test_a_model_that_can_sleep_starts_with_vllm_sleep_mode_on_real_gpus_only():
    """Sleep in place needs vLLM's sleep mode from the start; on CPUs and simulated GPUs it parks."""
    assert plan(QWEN8, [gpu("H100-80GB")], sleep_timeout=60).replicas[0].engine_kwargs["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in plan(QWEN8, [gpu("H100-80GB")]).replicas[0].engine_kwargs
    assert "enable_sleep_mode" not in plan(QWEN8, [cpu()], sleep_timeout=60).replicas[0].engine_kwargs
    sim = gpu("H100-80GB", kind=DeviceKind.SIM_GPU)
    assert "enable_sleep_mode" not in plan(QWEN8, [sim], sleep_timeout=60, engine="sim").replicas[0].engine_kwargs
