"""Pooling deploys: vLLM's old ``task="embed"`` maps to ``runner="pooling"`` with a note, and an
output length asked for a model that generates nothing is refused (issue 12, item 2)."""

from pathlib import Path

from hive_apps.control.planner import plan_or_error
from hive_apps.core.settings import get_settings
from hive_apps.core.spec import ModelSpec
from hive_apps.core.vllm_args import vllm_kwargs_problems
from tests.unit.planning_fixtures import gpu

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs"
MINILM = str(FIXTURES / "sentence-transformers__all-MiniLM-L6-v2")
QWEN = str(FIXTURES / "Qwen__Qwen3-0.6B")


def test_legacy_task_embed_plans_a_pooling_runner_and_says_so():
    spec = ModelSpec(model_id="e", model=QWEN, engine="sim", max_input_prompt_length=256, vllm_kwargs={"task": "embed"})
    out = plan_or_error(spec, [gpu("L4", "a", 0)])
    assert out.plan is not None, out.error
    assert out.plan.profile.runner == "pooling"
    kwargs = out.plan.replicas[0].engine_kwargs
    assert kwargs["runner"] == "pooling" and "task" not in kwargs  # vLLM 0.32 has no --task
    assert any("task='embed' is deprecated" in n for n in out.plan.notes)


def test_other_legacy_tasks_and_conflicts_are_refused():
    settings = get_settings()
    assert "only 'embed' is still mapped" in vllm_kwargs_problems({"task": "generate"}, "vllm", settings)[0]
    assert "keep one" in vllm_kwargs_problems({"task": "embed", "runner": "generate"}, "vllm", settings)[0]
    assert vllm_kwargs_problems({"task": "embed", "runner": "pooling"}, "vllm", settings) == []


def test_an_output_length_asked_of_a_pooling_model_is_refused_only_when_asked():
    devices = [gpu("L4", "a", 0)]
    asked = ModelSpec(model_id="e", model=MINILM, engine="sim", max_input_prompt_length=256, max_output_prompt_length=64)
    refused = plan_or_error(asked, devices, as_asked=True)
    assert refused.plan is None and refused.status_code == 422 and "max_output_prompt_length=64" in refused.error
    default = ModelSpec(model_id="e", model=MINILM, engine="sim", max_input_prompt_length=256)  # 256 by default
    assert plan_or_error(default, devices, as_asked=True).plan is not None
    stored = ModelSpec.model_validate_json(asked.model_dump_json())  # a record's spec: every field set
    assert plan_or_error(stored, devices).plan is not None  # re-plans (wake, heal) are not refused
