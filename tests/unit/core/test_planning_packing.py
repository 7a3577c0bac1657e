"""Planning with pending deploys: a deploy leaves the room a pending one needs (core/planning/packing.py)."""

from __future__ import annotations

from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.types import DeviceCapacity, PlanningError
from hive_apps.core.spec import ModelSpec
from tests.unit.planning_fixtures import fixture_path, gpu, profile

QWEN8, MOE, SMALL = "Qwen__Qwen3-8B", "Qwen__Qwen3-30B-A3B", "Qwen__Qwen3-0.6B"


def spec(model_id: str, name: str, **kw) -> ModelSpec:
    return ModelSpec(model_id=model_id, model=fixture_path(name), engine="sim", max_input_prompt_length=2048,
                     max_output_prompt_length=512, **kw)


def cluster() -> list[DeviceCapacity]:
    return [gpu("H100-80GB", "a", 0), gpu("L4", "b", 0), gpu("L4", "b", 1)]


def deploy_all(batch: list[tuple[str, str]], *, pending: bool) -> tuple[list, list[str]]:
    """Plan each in turn, booking its reservation; returns the plans and the models that did not fit."""
    devices = cluster()
    specs = [(spec(m, n), profile(n)) for m, n in batch]
    plans, failed = [], []
    for k, (s, prof) in enumerate(specs):
        try:
            p = plan_deployment(s, devices, prof, pending=specs[k + 1:] if pending else ())
        except PlanningError:
            failed.append(s.model_id)
            continue
        plans.append(p)
        for r in p.replicas:
            for dc in devices:
                if dc.device.id in r.devices:
                    dc.available_bytes -= r.reservation_bytes
                    dc.free_bytes -= r.reservation_bytes
                    dc.hive_replicas.append(f"{s.model_id}/r0")
    return plans, failed


def test_one_at_a_time_the_first_model_takes_the_card_the_next_one_needs():
    plans, failed = deploy_all([("q8", QWEN8), ("moe", MOE)], pending=False)
    assert plans[0].replicas[0].devices == ["a:gpu0"] and failed == ["moe"]


def test_with_the_moe_pending_the_8b_leaves_the_h100_to_it():
    plans, failed = deploy_all([("q8", QWEN8), ("moe", MOE)], pending=True)
    assert failed == []
    where = {p.model_id: p.replicas[0].devices for p in plans}
    assert where == {"q8": ["b:gpu0"], "moe": ["a:gpu0"]} or where == {"q8": ["b:gpu1"], "moe": ["a:gpu0"]}
    assert any("planned jointly with 1 pending" in n for n in plans[0].notes)


def test_a_small_pending_model_does_not_push_the_8b_off_the_fast_card():
    plans, failed = deploy_all([("q8", QWEN8), ("small", SMALL)], pending=True)
    assert failed == [] and plans[0].replicas[0].devices == ["a:gpu0"]
    alone, _ = deploy_all([("q8", QWEN8)], pending=False)
    # it keeps room on the H100 for the small model and most of its own throughput (the small one, planned
    # last by the normal rules, may still choose an empty L4: then that room stays free)
    assert plans[0].replicas[0].reservation_bytes < alone[0].replicas[0].reservation_bytes
    assert plans[0].expected_tokens_per_s > 0.8 * alone[0].expected_tokens_per_s


def test_the_joint_share_is_a_ceiling_the_sizing_keeps():
    s, prof = spec("q8", QWEN8), profile(QWEN8)
    p = plan_deployment(s, cluster(), prof, pending=[(spec("moe", MOE), profile(MOE))])
    (note,) = [n for n in p.notes if "planned jointly" in n]
    budget_gib = float(note.split("with up to ")[1].split(" GiB")[0])
    assert p.replicas[0].reservation_bytes <= budget_gib * 1.001 * 2**30


def test_pending_deploys_the_joint_plan_cannot_model_change_nothing():
    s, prof = spec("q8", QWEN8), profile(QWEN8)
    pinned = spec("moe", MOE, gpu="a:gpu0")
    two = spec("moe2", MOE, replicas=2)
    base = plan_deployment(s, cluster(), prof)
    same = plan_deployment(s, cluster(), prof, pending=[(pinned, profile(MOE)), (two, profile(MOE))])
    assert same.replicas[0].settings == base.replicas[0].settings
    assert same.replicas[0].devices == base.replicas[0].devices


def test_a_demand_is_kept_in_the_joint_plan():
    s, prof = spec("q8", QWEN8, max_concurrency=6), profile(QWEN8)
    p = plan_deployment(s, cluster(), prof, pending=[(spec("moe", MOE), profile(MOE))])
    assert p.replicas[0].settings.max_num_seqs == 6
    assert p.replicas[0].devices[0].startswith("b:")  # the H100 stays with the MoE
