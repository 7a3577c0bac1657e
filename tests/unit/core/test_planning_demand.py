"""Demand-aware sizing: max_concurrency sizes max_num_seqs and KV, and the plan reports the tokens/s it plans for."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hive_apps.core.catalog import GIB
from hive_apps.core.planning.memory import kv_need
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.spec import ModelSpec
from tests.unit.planning_fixtures import fixture_path, gpu, profile

QWEN8 = "Qwen__Qwen3-8B"


def plan(name: str, devices, **spec_fields):
    spec = ModelSpec(model_id="m", model=fixture_path(name), engine="sim", **spec_fields)
    return plan_deployment(spec, devices, profile(name))


def test_without_a_hint_sizing_is_throughput_first():
    p = plan(QWEN8, [gpu("H100-80GB")], max_input_prompt_length=2048, max_output_prompt_length=512)
    assert p.replicas[0].settings.max_num_seqs > 64  # far more than a small demand below
    assert p.expected_tokens_per_s == p.replicas[0].expected_tokens_per_s > 0
    assert p.planned_concurrency == p.replicas[0].settings.max_num_seqs


def test_max_concurrency_sizes_sequences_and_kv_for_the_demand():
    devices = [gpu("H100-80GB")]
    lengths = dict(max_input_prompt_length=2048, max_output_prompt_length=512)
    free = plan(QWEN8, devices, **lengths)
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
