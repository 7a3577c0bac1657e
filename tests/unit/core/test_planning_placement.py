"""Placement: pins, automatic choice by policy, co-location, tensor-parallel groups, CPU fallback, taints."""

from __future__ import annotations

import pytest

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.sizing import DEFAULT_SEQS
from hive_apps.core.planning.types import PlanningError
from hive_apps.core.spec import ModelSpec
from tests.unit.planning_fixtures import cpu, fixture_path, gpu, profile

QWEN8 = "Qwen__Qwen3-8B"
SMALL = "Qwen__Qwen3-0.6B"


def plan(name: str, devices, **spec_fields):
    spec = ModelSpec(model_id="m", model=fixture_path(name), **spec_fields)
    return plan_deployment(spec, devices, profile(name, **{k: v for k, v in spec.vllm_kwargs.items()}))


def replica_devices(p) -> list[list[str]]:
    return [r.devices for r in p.replicas]


# ---- pins --------------------------------------------------------------------------------


def test_unknown_pin_is_404_listing_known_devices():
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [gpu("L4", "a", 0), gpu("L4", "a", 1)], gpu="b:gpu7")
    assert err.value.status_code == 404
    assert "b:gpu7" in err.value.message and "a:gpu0" in err.value.message and "a:gpu1" in err.value.message


def test_single_pin_places_there_even_if_a_better_device_exists():
    p = plan(SMALL, [gpu("H100-80GB", "a", 0), gpu("L4", "a", 1)], gpu="a:gpu1")
    assert replica_devices(p) == [["a:gpu1"]]
    assert p.replicas[0].device_indices == [1]


def test_pin_list_with_as_many_replicas_gives_one_replica_each():
    p = plan(SMALL, [gpu("L4", "a", 0), gpu("A10", "b", 0)], gpu=["a:gpu0", "b:gpu0"], replicas=2)
    assert replica_devices(p) == [["a:gpu0"], ["b:gpu0"]]
    assert all(r.settings.tensor_parallel_size == 1 for r in p.replicas)


def test_pin_list_with_one_replica_is_a_tensor_parallel_group():
    devices = [gpu("H100-80GB", "a", i) for i in range(2)]
    p = plan("meta-llama__Llama-3.1-70B", devices, gpu=["a:gpu0", "a:gpu1"], replicas=1)
    (r,) = p.replicas
    assert r.devices == ["a:gpu0", "a:gpu1"] and r.device_indices == [0, 1]
    assert r.settings.tensor_parallel_size == 2
    assert r.engine_kwargs["distributed_executor_backend"] == "mp"


def test_tensor_parallel_pins_must_share_a_node_and_divide_heads():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("L4", "a", 0), gpu("L4", "b", 0)], gpu=["a:gpu0", "b:gpu0"], replicas=1)
    assert err.value.status_code == 422 and "one node" in err.value.message
    with pytest.raises(PlanningError) as err:  # 32 heads over 3 ranks
        plan(QWEN8, [gpu("L4", "a", i) for i in range(3)], gpu=["a:gpu0", "a:gpu1", "a:gpu2"], replicas=1)
    assert "attention heads" in err.value.message


def test_pinned_device_too_small_says_by_how_much():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("T4", "a", 0)], gpu="a:gpu0")
    assert err.value.status_code == 422
    assert "short by" in err.value.message and "GiB" in err.value.message


def test_simulated_gpu_cannot_run_real_vllm_but_runs_sim():
    sim = gpu("L4", "a", 0, kind=DeviceKind.SIM_GPU)
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [sim], gpu="a:gpu0")
    assert err.value.status_code == 422 and "simulated" in err.value.message
    p = plan(SMALL, [sim], gpu="a:gpu0", engine="sim")
    assert p.replicas[0].device_kind is DeviceKind.SIM_GPU


def test_fp8_pin_below_7_5_is_refused_and_ampere_falls_back_to_marlin():
    with pytest.raises(PlanningError) as err:
        plan("Qwen__Qwen3-8B-FP8", [gpu("V100-32GB", "a", 0)], gpu="a:gpu0")
    assert "7.5" in err.value.message and err.value.rejected[0].device == "a:gpu0"
    p = plan("Qwen__Qwen3-8B-FP8", [gpu("A100-80GB", "a", 0)], gpu="a:gpu0")  # vLLM: FP8 Marlin, W8A16
    (r,) = p.replicas
    assert any("Marlin" in n and "8.9" in n for n in r.notes)
    assert r.memory.weights == profile("Qwen__Qwen3-8B-FP8").weight_bytes_per_rank(1)  # still 1 byte/param


def test_fp8_kv_cache_is_tainted_below_8_9():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("A100-80GB", "a", 0)], gpu="a:gpu0", vllm_kwargs={"kv_cache_dtype": "fp8"})
    assert "fp8 KV cache" in err.value.message and "8.9" in err.value.message


# ---- automatic ---------------------------------------------------------------------------


def test_performance_policy_picks_the_fastest_card():
    devices = [gpu("L4", "a", 0), gpu("A100-80GB", "a", 1), gpu("H100-80GB", "b", 0), gpu("L40S", "b", 1)]
    assert replica_devices(plan(SMALL, devices)) == [["b:gpu0"]]
    assert replica_devices(plan(SMALL, devices, replicas=4)) == [["b:gpu0"], ["a:gpu1"], ["b:gpu1"], ["a:gpu0"]]


@pytest.mark.parametrize("name", [SMALL, QWEN8])
def test_decode_heavy_ranking_follows_expected_tokens_per_s_not_tflops(name):
    """L40S has more fp16 TFLOPS than an A100-80GB (362 vs 312) but 864 vs 2039 GB/s: decode is bandwidth-bound."""
    devices = [gpu("L40S", "a", 0), gpu("A100-80GB", "a", 1), gpu("H100-80GB", "a", 2)]
    p = plan(name, devices, replicas=3, max_input_prompt_length=256, max_output_prompt_length=4096)
    assert replica_devices(p) == [["a:gpu2"], ["a:gpu1"], ["a:gpu0"]]  # H100 > A100-80GB > L40S
    tps = [r.expected_tokens_per_s for r in p.replicas]
    assert tps[0] > tps[1] > tps[2]


def test_conserve_tdp_policy_picks_the_frugal_card():
    devices = [gpu("H100-80GB", "a", 0), gpu("L4", "a", 1), gpu("T4", "a", 2), gpu("A10", "a", 3)]
    assert replica_devices(plan(SMALL, devices, allocation="conserve_tdp")) == [["a:gpu2"]]  # T4, 70 W
    assert replica_devices(plan(QWEN8, devices, allocation="conserve_tdp")) == [["a:gpu1"]]  # T4 too small: L4


def test_devices_without_hive_replicas_come_first():
    devices = [gpu("H100-80GB", "a", 0, hive_replicas=["other/r0"]), gpu("L4", "a", 1)]
    assert replica_devices(plan(SMALL, devices)) == [["a:gpu1"]]


def test_demand_sized_deploys_pack_onto_the_fastest_card_that_holds_them():
    def packed(devices, **spec_fields):  # as with HIVE_DEFAULT_DEMAND_SEQS=16
        spec = ModelSpec(model_id="m", model=fixture_path(SMALL), **spec_fields)
        return replica_devices(plan_deployment(spec, devices, profile(SMALL), demand_seqs=DEFAULT_SEQS))

    devices = [gpu("H100-80GB", "a", 0, hive_replicas=["other/r0"]), gpu("L4", "a", 1)]
    assert packed(devices) == [["a:gpu0"]]  # other models' replicas do not push it off
    assert replica_devices(plan(SMALL, devices)) == [["a:gpu1"]]  # throughput-first (the default): unshared first
    # among equal cards the one with the least room that holds it, so the emptier one stays whole
    h100s = [gpu("H100-80GB", "a", 0), gpu("H100-80GB", "a", 1, used_gib=30, hive_replicas=["other/r0"])]
    assert packed(h100s) == [["a:gpu1"]]
    # replicas of one deploy still spread before they co-locate
    assert packed(h100s, replicas=2) == [["a:gpu1"], ["a:gpu0"]]


def test_more_replicas_than_devices_co_locate_and_split_capacity():
    devices = [gpu("H100-80GB", "a", 0)]
    p = plan(SMALL, devices, replicas=2)
    assert replica_devices(p) == [["a:gpu0"], ["a:gpu0"]]
    assert sum(r.reservation_bytes for r in p.replicas) <= devices[0].available_bytes


def test_replicas_minus_one_takes_every_eligible_device():
    devices = [gpu("L4", "a", 0), gpu("T4", "a", 1), gpu("L4", "b", 0, kind=DeviceKind.SIM_GPU), cpu("c")]
    p = plan(QWEN8, devices, replicas=-1)
    assert replica_devices(p) == [["a:gpu0"]]  # T4 too small, sim GPU not real, CPU only as fallback
    reasons = {r.device: r.reason for r in p.rejected}
    assert "short by" in reasons["a:gpu1"] and "simulated" in reasons["b:gpu0"]


def test_fp8_model_skips_cards_below_7_5():
    devices = [gpu("V100-32GB", "a", 0), gpu("L40S", "a", 1)]
    p = plan("Qwen__Qwen3-8B-FP8", devices)
    assert replica_devices(p) == [["a:gpu1"]]
    assert "7.5" in {r.device: r.reason for r in p.rejected}["a:gpu0"]
    assert not p.replicas[0].notes  # L40S (8.9) runs fp8 natively


def test_tensor_parallel_group_when_no_single_gpu_fits():
    devices = [gpu("H100-80GB", "a", 0), gpu("H100-80GB", "a", 1), gpu("A100-40GB", "b", 0)]
    p = plan("meta-llama__Llama-3.1-70B", devices)
    (r,) = p.replicas
    assert r.devices == ["a:gpu0", "a:gpu1"] and r.settings.tensor_parallel_size == 2
    assert r.memory.total <= devices[0].available_bytes
    assert [x.device for x in p.rejected] == ["b:gpu0"]


def test_tensor_parallel_prefers_identical_cards():
    devices = [gpu("A100-80GB", "a", 0), gpu("H100-80GB", "a", 1), gpu("H100-80GB", "a", 2)]
    p = plan("meta-llama__Llama-3.1-70B", devices)
    assert replica_devices(p) == [["a:gpu1", "a:gpu2"]]


def test_cpu_is_the_fallback_of_automatic_placement():
    p = plan("tiny-qwen2", [gpu("T4", "a", 0), cpu("c")])
    assert replica_devices(p) == [["a:gpu0"]]
    p = plan(QWEN8, [gpu("T4", "a", 0), cpu("c", total_gib=64)])
    assert replica_devices(p) == [["c:cpu"]]
    assert p.replicas[0].device_kind is DeviceKind.CPU and p.replicas[0].device_indices == []
    assert any("CPU" in n for n in p.replicas[0].notes)


def test_nothing_fits_lists_every_reason():
    with pytest.raises(PlanningError) as err:
        plan("meta-llama__Llama-3.1-70B", [gpu("L4", "a", 0), gpu("T4", "b", 0)])
    assert err.value.status_code == 422
    assert {r.device for r in err.value.rejected} == {"a:gpu0", "b:gpu0"}
    assert "short by" in err.value.message


def test_not_enough_devices_for_the_replica_count():
    with pytest.raises(PlanningError) as err:
        plan(QWEN8, [gpu("L4", "a", 0)], replicas=3)  # one L4 holds one 8B replica, not three
    assert "replicas=3" in err.value.message


def test_empty_registry():
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [])
    assert "no devices" in err.value.message


# ---- user placement policy (vllm_kwargs["hive_placement_policy"]) -------------------------

POLICIES = "tests.unit.planning_fixtures."


def test_user_policy_changes_the_chosen_device():
    devices = [gpu("H100-80GB", "a", 0, used_gib=40), gpu("L40S", "a", 1)]  # L40S has more room left
    assert replica_devices(plan(SMALL, devices)) == [["a:gpu0"]]  # performance: the H100
    p = plan(SMALL, devices, vllm_kwargs={"hive_placement_policy": POLICIES + "MostFreeMemory"})
    assert replica_devices(p) == [["a:gpu1"]]
    assert "hive_placement_policy" not in p.replicas[0].engine_kwargs  # stripped before vLLM
    assert any("MostFreeMemory" in n for n in p.notes)


def test_user_policy_replaces_allocation_and_orders_replicas():
    devices = [gpu("H100-80GB", "a", 0), gpu("L4", "b", 0), gpu("A10", "b", 1)]
    assert replica_devices(plan(SMALL, devices, allocation="conserve_tdp")) == [["b:gpu0"]]
    kw = {"hive_placement_policy": POLICIES + "PreferNodeB"}
    assert replica_devices(plan(SMALL, devices, vllm_kwargs=kw)) == [["b:gpu0"]]
    p = plan(SMALL, devices, replicas=3, vllm_kwargs=kw)
    assert replica_devices(p) == [["b:gpu0"], ["b:gpu1"], ["a:gpu0"]]


def test_user_policy_orders_within_the_unshared_first_tier():
    """Node b first, but its only GPU already hosts a hive replica: the unshared H100 on a wins."""
    devices = [gpu("H100-80GB", "a", 0), gpu("L4", "b", 0, hive_replicas=["other/r0"])]
    p = plan(SMALL, devices, vllm_kwargs={"hive_placement_policy": POLICIES + "PreferNodeB"})
    assert replica_devices(p) == [["a:gpu0"]]


def test_user_policy_still_gets_fit_checks_and_may_leave_devices_out():
    devices = [gpu("T4", "b", 0), gpu("L4", "a", 0)]  # an 8B model does not fit a T4
    p = plan(QWEN8, devices, vllm_kwargs={"hive_placement_policy": POLICIES + "PreferNodeB"})
    assert replica_devices(p) == [["a:gpu0"]]
    devices = [gpu("H100-80GB", "b", 0), gpu("L4", "a", 0)]
    p = plan(SMALL, devices, vllm_kwargs={"hive_placement_policy": POLICIES + "OnlyNodeA"})
    assert replica_devices(p) == [["a:gpu0"]]
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [gpu("H100-80GB", "b", 0)], vllm_kwargs={"hive_placement_policy": POLICIES + "OnlyNodeA"})
    assert err.value.status_code == 422 and "left out by placement policy" in err.value.message


@pytest.mark.parametrize("path, says", [
    ("tests.unit.no_such_module.Policy", "cannot be imported"),
    (POLICIES + "Missing", "has no attribute 'Missing'"),
    (POLICIES + "NoRank", "has no rank(candidates, profile) method"),
    (POLICIES + "NeedsArgs", "cannot be constructed with no arguments"),
    (POLICIES + "ReturnsStrangers", "not one of the candidate devices"),
    ("NotAPath", "not a class path"),
])
def test_bad_user_policy_is_422_naming_the_path(path, says):
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [gpu("L4", "a", 0)], vllm_kwargs={"hive_placement_policy": path})
    assert err.value.status_code == 422
    assert path in err.value.message and says in err.value.message


def test_bad_user_policy_is_refused_even_when_pinned():
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [gpu("L4", "a", 0)], gpu="a:gpu0", vllm_kwargs={"hive_placement_policy": POLICIES + "NoRank"})
    assert err.value.status_code == 422
