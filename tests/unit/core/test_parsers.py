"""Tool-call and reasoning parsers picked from the model's family and chat template when a deploy
names none (issue 12, item 5): a table over the fixture configs and template snippets, the user's
overrides, the plan that carries the choice, and the names checked against vLLM 0.32's registry."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from hive_apps.control.planner import plan_or_error
from hive_apps.core.planning.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    apply_choice,
    choose_parsers,
    read_chat_template,
)
from hive_apps.core.planning.types import PlanningError
from hive_apps.core.settings import get_settings
from hive_apps.core.spec import ModelSpec
from hive_apps.core.vllm_args import vllm_kwargs_problems
from tests.unit.planning_fixtures import _cached_profile, gpu

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"


def choice_for(config: str, template: str | None, user: dict | None = None, model: str | None = None):
    profile = _cached_profile(config, ())
    text = read_chat_template(str(TEMPLATES / template)) if template else None
    if template:
        assert text, f"fixture {template} has no template"
    return choose_parsers(model_type=profile.model_type, model=model or config.replace("__", "/"), template=text, user=user or {},
                          runner=profile.runner)


# config fixture, template fixture (None: the folder has no chat template) -> (tool, reasoning, auto)
TABLE = [
    ("Qwen__Qwen3-8B", "qwen3", ("hermes", "qwen3", True)),
    ("Qwen__Qwen3-0.6B", None, (None, "qwen3", False)),
    ("Qwen__Qwen3-30B-A3B", "qwen3-coder", ("qwen3_coder", None, True)),
    ("Qwen__Qwen3-Next-80B-A3B-Thinking", "qwen3", ("hermes", "qwen3", True)),
    ("Qwen__Qwen2.5-VL-7B-Instruct", "qwen2.5", ("hermes", None, True)),
    ("tiny-qwen2", "qwen2.5", ("hermes", None, True)),
    ("meta-llama__Llama-3.2-1B-Instruct", "llama3.1", ("llama3_json", None, True)),
    ("nvidia__Llama-3.1-70B-Instruct-FP8", "llama3.1", ("llama3_json", None, True)),
    ("meta-llama__Llama-3.1-8B", None, (None, None, False)),  # a base model: no template, no tools
    ("meta-llama__Llama-3.1-8B", "hermes3", ("hermes", None, True)),  # Hermes-3 on Llama 3.1
    ("TheBloke__Llama-2-13B-chat-GPTQ", "llama2", (None, None, False)),  # template takes no tools
    ("mistralai__Mixtral-8x7B-v0.1", "mistral", ("mistral", None, True)),
    ("mistralai__Mixtral-8x7B-v0.1", "hermes3", ("hermes", None, True)),  # a ChatML fine-tune has no [TOOL_CALLS]
    ("deepseek-ai__DeepSeek-V3", "deepseek-v3", ("deepseek_v3", None, True)),
    ("deepseek-ai__DeepSeek-V3", "deepseek-r1", ("deepseek_v3", "deepseek_r1", True)),
    ("deepseek-ai__DeepSeek-V3", "deepseek-v3.1", ("deepseek_v31", "deepseek_v3", True)),
    ("openai__gpt-oss-20b", "gpt-oss", ("openai", "openai_gptoss", True)),
    ("openai__gpt-oss-20b", None, (None, "openai_gptoss", False)),
    ("google__gemma-3-1b-it", None, (None, None, False)),
    ("google__gemma-3-1b-it", "llama2", (None, None, False)),
    ("sentence-transformers__all-MiniLM-L6-v2", "qwen3", (None, None, False)),  # pooling: no parsers
    ("BAAI__bge-m3", "hermes3", (None, None, False)),
]


@pytest.mark.parametrize("config,template,expected", TABLE, ids=[f"{c}+{t}" for c, t, _ in TABLE])
def test_parser_table(config, template, expected):
    c = choice_for(config, template)
    assert (c.tool_call_parser, c.reasoning_parser, c.enable_auto_tool_choice) == expected


def test_deepseek_r1_is_known_by_name_without_a_template():
    c = choice_for("deepseek-ai__DeepSeek-V3", None, model="deepseek-ai/DeepSeek-R1")
    assert (c.tool_call_parser, c.reasoning_parser) == (None, "deepseek_r1")
    assert choice_for("deepseek-ai__DeepSeek-V3", None).reasoning_parser is None


def test_template_forms_the_reader_takes(tmp_path):
    assert "[TOOL_CALLS]" in read_chat_template(str(TEMPLATES / "mistral"))  # the named list: all joined
    assert read_chat_template(str(tmp_path)) is None
    assert read_chat_template("") is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ tools }}"}')
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # the .jinja file wins, as in transformers
    assert read_chat_template(str(tmp_path)) == "{{ messages }}"
    (tmp_path / "tokenizer_config.json").write_text("not json")
    (tmp_path / "chat_template.jinja").unlink()
    assert read_chat_template(str(tmp_path)) is None


def test_a_user_value_wins_key_by_key():
    named = choice_for("Qwen__Qwen3-8B", "qwen3", {"tool_call_parser": "qwen3_xml"})
    assert (named.tool_call_parser, named.reasoning_parser, named.enable_auto_tool_choice) == ("qwen3_xml", "qwen3", True)
    off = choice_for("Qwen__Qwen3-8B", "qwen3", {"tool_call_parser": None})
    assert (off.tool_call_parser, off.reasoning_parser, off.enable_auto_tool_choice) == (None, "qwen3", False)
    no_think = choice_for("Qwen__Qwen3-8B", "qwen3", {"reasoning_parser": None})
    assert (no_think.tool_call_parser, no_think.reasoning_parser) == ("hermes", None)
    other = choice_for("Qwen__Qwen3-8B", "qwen3", {"reasoning_parser": "deepseek_r1"})
    assert other.reasoning_parser == "deepseek_r1"
    no_auto = choice_for("Qwen__Qwen3-8B", "qwen3", {"enable_auto_tool_choice": False})
    assert (no_auto.tool_call_parser, no_auto.enable_auto_tool_choice) == (None, False)
    kept = choice_for("Qwen__Qwen3-8B", "qwen3", {"enable_auto_tool_choice": False, "tool_call_parser": "hermes"})
    assert (kept.tool_call_parser, kept.enable_auto_tool_choice) == ("hermes", False)
    forced = choice_for("meta-llama__Llama-3.1-8B", None, {"tool_call_parser": "llama3_json",
                                                           "enable_auto_tool_choice": True})
    assert (forced.tool_call_parser, forced.enable_auto_tool_choice) == ("llama3_json", True)


def test_auto_tool_choice_without_any_parser_is_a_422():
    with pytest.raises(PlanningError) as err:
        choice_for("google__gemma-3-1b-it", None, {"enable_auto_tool_choice": True})
    assert err.value.status_code == 422 and "tool_call_parser" in err.value.message
    # ... but where the hive finds one, asking for auto tool choice is enough
    assert choice_for("Qwen__Qwen3-8B", "qwen3", {"enable_auto_tool_choice": True}).tool_call_parser == "hermes"


def test_apply_drops_nulls_and_sets_the_choice():
    c = choice_for("Qwen__Qwen3-8B", "qwen3", {"tool_call_parser": None})
    out = apply_choice({"tool_call_parser": None, "max_num_seqs": 4}, c)
    assert out == {"max_num_seqs": 4, "reasoning_parser": "qwen3"}


def test_null_parsers_pass_the_allow_list_and_other_nulls_do_not():
    settings = get_settings()
    assert vllm_kwargs_problems({"tool_call_parser": None, "reasoning_parser": None}, "vllm", settings) == []
    assert vllm_kwargs_problems({"tool_call_parser": "hermes", "reasoning_parser": "qwen3",
                                 "enable_auto_tool_choice": True}, "vllm", settings) == []
    assert vllm_kwargs_problems({"enable_auto_tool_choice": None}, "vllm", settings)
    assert vllm_kwargs_problems({"tool_call_parser": 3}, "vllm", settings)


def _model_folder(tmp_path: Path, config: str, template: str | None) -> str:
    folder = tmp_path / config
    shutil.copytree(FIXTURES / "model_configs" / config, folder)
    if template:
        for f in (TEMPLATES / template).iterdir():
            shutil.copy(f, folder / f.name)
    return str(folder)


def test_the_plan_carries_the_choice_in_engine_kwargs_and_notes(tmp_path):
    model = _model_folder(tmp_path, "Qwen__Qwen3-0.6B", "qwen3")
    out = plan_or_error(ModelSpec(model_id="q", model=model, engine="sim", max_input_prompt_length=256,
                                  max_output_prompt_length=64), [gpu("L4", "a", 0)])
    assert out.plan is not None, out.error
    kwargs = out.plan.replicas[0].engine_kwargs
    assert (kwargs["tool_call_parser"], kwargs["reasoning_parser"], kwargs["enable_auto_tool_choice"]) == \
        ("hermes", "qwen3", True)
    assert any("tool_call_parser='hermes' chosen" in n for n in out.plan.notes)
    assert any("reasoning_parser='qwen3' chosen" in n for n in out.plan.notes)

    off = plan_or_error(ModelSpec(model_id="q", model=model, engine="sim", max_input_prompt_length=256,
                                  max_output_prompt_length=64,
                                  vllm_kwargs={"tool_call_parser": None, "reasoning_parser": None}),
                        [gpu("L4", "a", 0)])
    kwargs = off.plan.replicas[0].engine_kwargs
    assert not {"tool_call_parser", "reasoning_parser", "enable_auto_tool_choice"} & set(kwargs)
    assert not any("chosen" in n for n in off.plan.notes)


def test_a_chat_template_in_vllm_kwargs_is_the_one_judged(tmp_path):
    model = _model_folder(tmp_path, "Qwen__Qwen2.5-VL-7B-Instruct", None)  # the folder has no template
    spec = dict(model_id="q", model=model, engine="sim", max_input_prompt_length=256, max_output_prompt_length=64)
    bare = plan_or_error(ModelSpec(**spec), [gpu("H100-80GB", "a", 0)])
    assert "tool_call_parser" not in bare.plan.replicas[0].engine_kwargs
    assert any("no chat template found" in n for n in bare.plan.notes)
    template = read_chat_template(str(TEMPLATES / "qwen2.5"))
    given = plan_or_error(ModelSpec(**spec, vllm_kwargs={"chat_template": template}), [gpu("H100-80GB", "a", 0)])
    kwargs = given.plan.replicas[0].engine_kwargs
    assert kwargs["tool_call_parser"] == "hermes" and kwargs["enable_auto_tool_choice"] is True


def _registered(relative: str) -> set[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    text = (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()
    return set(re.findall(r'^\s+"([\w.-]+)": \(', text, re.M))


def test_every_name_the_hive_picks_is_registered_in_vllm():
    assert TOOL_PARSERS <= _registered("tool_parsers/__init__.py")
    assert REASONING_PARSERS <= _registered("reasoning/__init__.py")
    picked = {(c.tool_call_parser, c.reasoning_parser) for c in (choice_for(cfg, t) for cfg, t, _ in TABLE)}
    assert {t for t, _ in picked if t} <= TOOL_PARSERS and {r for _, r in picked if r} <= REASONING_PARSERS
