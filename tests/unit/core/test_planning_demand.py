"""Demand-aware sizing: max_concurrency sizes max_num_seqs and KV, and the plan reports the tokens/s it plans for."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hive_apps.core.catalog import GIB
from hive_apps.core.planning.memory import kv_need
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.sizing import DEFAULT_SEQS, FLOOR_SEQS, GPU_MAX_SEQS
from hive_apps.core.spec import ModelSpec
from tests.unit.planning_fixtures import cpu, fixture_path, gpu, profile

QWEN8 = "Qwen__Qwen3-8B"


def plan(name: str, devices, demand_seqs: int | None = DEFAULT_SEQS, **spec_fields):
    """Planned as the hive plans with HIVE_DEFAULT_DEMAND_SEQS=16 (``demand_seqs=None``: the setting off)."""
    spec = ModelSpec(model_id="m", model=fixture_path(name), engine="sim", **spec_fields)
    return plan_deployment(spec, devices, profile(name), demand_seqs=demand_seqs)


def test_observed_demand_past_the_card_is_throughput_first():
    p = plan(QWEN8, [gpu("H100-80GB")], max_input_prompt_length=2048, max_output_prompt_length=512,
             demand_seqs=GPU_MAX_SEQS)
    assert p.replicas[0].settings.max_num_seqs > 64  # far more than a small demand below
    assert p.expected_tokens_per_s == p.replicas[0].expected_tokens_per_s > 0
    assert p.planned_concurrency == p.replicas[0].settings.max_num_seqs


def test_without_the_setting_a_deploy_without_a_hint_is_throughput_first():
    lengths = dict(max_input_prompt_length=2048, max_output_prompt_length=512)
    off = plan(QWEN8, [gpu("H100-80GB")], demand_seqs=None, **lengths).replicas[0]
    ceiling = plan(QWEN8, [gpu("H100-80GB")], demand_seqs=GPU_MAX_SEQS, **lengths).replicas[0]
    assert off.settings.max_num_seqs == ceiling.settings.max_num_seqs > 4 * DEFAULT_SEQS
    assert off.settings.gpu_memory_utilization > 0.8


def test_without_a_hint_sizing_is_for_the_default_demand():
    lengths = dict(max_input_prompt_length=2048, max_output_prompt_length=512)
    p = plan(QWEN8, [gpu("H100-80GB")], **lengths)
    r = p.replicas[0]
    assert r.settings.max_num_seqs == DEFAULT_SEQS and p.planned_concurrency == DEFAULT_SEQS
    ceiling = plan(QWEN8, [gpu("H100-80GB")], demand_seqs=GPU_MAX_SEQS, **lengths).replicas[0]
    assert r.reservation_bytes < ceiling.reservation_bytes - 30 * GIB  # the first deploy does not take the card
    assert any("HIVE_DEFAULT_DEMAND_SEQS) of 16" in n and "max_concurrency" in n for n in p.notes)
    forty = plan(QWEN8, [gpu("H100-80GB")], demand_seqs=40, **lengths)
    assert 36 <= forty.replicas[0].settings.max_num_seqs <= 40  # the 2 % knee may trim a demand that is not declared
    assert any("HIVE_DEFAULT_DEMAND_SEQS) of 40" in n for n in forty.notes)


def test_an_observed_demand_below_the_floor_is_raised_to_it():
    p = plan(QWEN8, [gpu("H100-80GB")], demand_seqs=1)
    assert p.replicas[0].settings.max_num_seqs == FLOOR_SEQS


def test_the_default_demand_prefers_the_floor_on_one_gpu_to_tensor_parallelism_or_the_cpu():
    # gemma-2-9b at 1536/512: an L4 holds 4 sequences, not 16; two L4s in TP or the CPU would hold 16
    devices = [gpu("L4", "a", 0), gpu("L4", "a", 1), cpu("c", total_gib=64, cores=16)]
    p = plan("google__gemma-2-9b", devices, max_input_prompt_length=1536, max_output_prompt_length=512)
    r = p.replicas[0]
    assert r.settings.tensor_parallel_size == 1 and r.devices[0].startswith("a:gpu")
    assert FLOOR_SEQS <= r.settings.max_num_seqs < DEFAULT_SEQS


def test_sequences_without_kv_are_not_bounded_by_the_default_demand():
    p = plan("sentence-transformers__all-MiniLM-L6-v2", [gpu("L4")], max_input_prompt_length=256,
             max_output_prompt_length=0)
    assert p.replicas[0].settings.max_num_seqs > DEFAULT_SEQS


def test_fixed_engine_settings_are_not_bounded_by_the_default_demand():
    lengths = dict(max_input_prompt_length=2048, max_output_prompt_length=512)
    util = plan(QWEN8, [gpu("H100-80GB")], vllm_kwargs={"gpu_memory_utilization": 0.8}, **lengths).replicas[0]
    assert util.settings.max_num_seqs > DEFAULT_SEQS
    kv = plan(QWEN8, [gpu("H100-80GB")], vllm_kwargs={"kv_cache_memory_bytes": 20 * GIB}, **lengths).replicas[0]
    assert kv.settings.max_num_seqs > DEFAULT_SEQS


def test_max_concurrency_sizes_sequences_and_kv_for_the_demand():
    devices = [gpu("H100-80GB")]
    lengths = dict(max_input_prompt_length=2048, max_output_prompt_length=512)
    free = plan(QWEN8, devices, demand_seqs=GPU_MAX_SEQS, **lengths)
    sized = plan(QWEN8, devices, max_concurrency=16, **lengths)
    r, f = sized.replicas[0], free.replicas[0]
    assert r.settings.max_num_seqs == 16 and sized.planned_concurrency == 16
    per_seq, block = kv_need(profile(QWEN8), r.settings.max_model_len, 1, profile(QWEN8).block_size(False),
                             r.settings.max_num_batched_tokens)
    assert 16 * per_seq + block <= r.settings.kv_cache_memory_bytes < 17 * per_seq + block
    assert r.reservation_bytes < f.reservation_bytes - 20 * GIB  # the rest of the card stays free
    assert 0 < sized.expected_tokens_per_s < free.expected_tokens_per_s
    assert any("max_concurrency=16" in n for n in sized.notes)


def test_max_concurrency_is_split_over_replicas_rounded_up():
    devices = [gpu("H100-80GB", index=0), gpu("H100-80GB", index=1)]
    p = plan(QWEN8, devices, replicas=2, max_concurrency=33)
    assert [r.settings.max_num_seqs for r in p.replicas] == [17, 17]
    assert p.planned_concurrency == 34


def test_every_gpu_replicas_share_the_demand():
    devices = [gpu("L4", index=i) for i in range(3)]
    p = plan("Qwen__Qwen3-0.6B", devices, replicas=-1, max_concurrency=10)
    assert [r.settings.max_num_seqs for r in p.replicas] == [4, 4, 4]


def test_a_demand_above_the_default_cap_is_honoured():
    p = plan("Qwen__Qwen3-0.6B", [gpu("H200")], max_input_prompt_length=256, max_output_prompt_length=128,
             max_concurrency=1500)
    s = p.replicas[0].settings
    assert s.max_num_seqs == 1500 and s.max_num_batched_tokens >= 1500


def test_placement_prefers_a_device_that_holds_the_demand():
    h100 = gpu("H100-80GB", index=0, available=30 * GIB)  # faster, but only 30 GiB left
    a100 = gpu("A100-80GB", index=1)
    lengths = dict(max_input_prompt_length=4096, max_output_prompt_length=1024)
    assert plan(QWEN8, [h100, a100], **lengths).replicas[0].devices == ["n1:gpu0"]
    p = plan(QWEN8, [h100, a100], max_concurrency=32, **lengths)
    assert p.replicas[0].devices == ["n1:gpu1"] and p.replicas[0].settings.max_num_seqs == 32


def test_a_demand_no_device_holds_gets_the_most_that_fit_and_says_so():
    p = plan(QWEN8, [gpu("L4")], max_input_prompt_length=4096, max_output_prompt_length=1024, max_concurrency=100)
    r = p.replicas[0]
    assert 1 <= r.settings.max_num_seqs < 100
    assert any("max_concurrency=100" in n and "add replicas" in n for n in r.notes)


def test_pooling_model_with_a_demand():
    p = plan("sentence-transformers__all-MiniLM-L6-v2", [gpu("L4")], max_input_prompt_length=256,
             max_output_prompt_length=0, max_concurrency=8)
    assert p.replicas[0].settings.max_num_seqs == 8


def test_max_concurrency_and_max_num_seqs_conflict():
    with pytest.raises(ValidationError, match="keep one"):
        ModelSpec(model_id="m", model="/x", max_concurrency=8, vllm_kwargs={"max_num_seqs": 4})
    with pytest.raises(ValidationError):
        ModelSpec(model_id="m", model="/x", max_concurrency=0)


def test_a_pinned_deploy_is_sized_for_its_demand_too():
    p = plan(QWEN8, [gpu("H100-80GB", index=0), gpu("H100-80GB", index=1)], gpu="n1:gpu1", max_concurrency=12)
    assert p.replicas[0].devices == ["n1:gpu1"] and p.replicas[0].settings.max_num_seqs == 12
