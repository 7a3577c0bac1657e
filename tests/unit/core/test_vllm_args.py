"""vllm_kwargs: an allow-list the operator widens, typed at plan time; nothing that runs a
deploy's code or breaks the hive's accounting."""

import pytest
from pydantic import ValidationError

from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import ModelSpec
from hive_apps.core.vllm_args import vllm_kwargs_problems

DEFAULT = HiveSettings(hook_packages=[], vllm_kwargs_allow=[], trust_remote_code=False)


def problems(kwargs, engine="vllm", settings=DEFAULT):
    return " | ".join(vllm_kwargs_problems(kwargs, engine, settings))


def test_sizing_parsers_and_structured_outputs_pass():
    assert problems({"max_num_seqs": 8, "gpu_memory_utilization": 0.5, "enable_prefix_caching": True,
                     "tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "deepseek_r1",
                     "structured_outputs_config": {"backend": "xgrammar"}, "chat_template": "{{ messages }}",
                     "trust_remote_code": False}) == ""


@pytest.mark.parametrize("key, value, says", [
    ("distributed_executor_backend", "ray", "mp backend"), ("pipeline_parallel_size", 2, "pipeline"),
    ("data_parallel_size", 2, "replicas"), ("cpu_offload_gb", 4, "does not account"), ("api_key", "x", "API keys"),
    ("root_path", "/x", "routes"), ("otlp_traces_endpoint", "http://x", "off the cluster"),
    ("trust_remote_code", True, "HIVE_TRUST_REMOTE_CODE"), ("tokenizer", "evil/repo", "another path"),
    ("hf_config_path", "evil/repo", "another path"), ("speculative_config", {"model": "x"}, "second model"),
    ("tool_parser_plugin", "/tmp/p.py", "imports a Python file"), ("allowed_local_media_path", "/", "local files"),
    ("chat_template", "/etc/passwd", "would read a local file"), ("served_model_name", "x", "model_id"),
    ("no_such_arg", 1, "HIVE_VLLM_KWARGS_ALLOW"), ("sim_tokens_per_s", 5, "sim engine"),
])
def test_dangerous_or_unknown_kwargs_are_refused_with_a_reason(key, value, says):
    assert says in problems({key: value})


@pytest.mark.parametrize("key, value", [
    ("max_num_seqs", "8"), ("max_num_seqs", 10**400), ("max_num_seqs", True), ("gpu_memory_utilization", float("inf")),
    ("enforce_eager", "yes"), ("limit_mm_per_prompt", [1]), ("reasoning_parser", "x" * 5000),
])
def test_scalars_are_type_checked(key, value):
    assert key in problems({key: value})


def test_operators_widen_the_list_and_allow_remote_code_and_hooks():
    wide = HiveSettings(vllm_kwargs_allow=["tokenizer", "some_new_arg"], trust_remote_code=True, hook_packages=["acme"])
    assert problems({"tokenizer": "org/tok", "some_new_arg": 3, "trust_remote_code": True}, settings=wide) == ""
    assert problems({"cpu_offload_gb": 4}, settings=wide)  # never, whatever is widened
    assert problems({"hive_placement_policy": "acme.policies.BestFit"}, settings=wide) == ""
    assert "not under the packages" in problems({"hive_placement_policy": "os.getpid"}, settings=wide)
    assert "hooks are off" in problems({"hive_attention_cls": "acme.Kv"})


def test_the_deploy_body_is_refused_with_422_material(monkeypatch):
    with pytest.raises(ValidationError, match="refused: it runs the model repository"):
        ModelSpec.under_policy({"model_id": "m", "model": "x", "vllm_kwargs": {"trust_remote_code": True}}, DEFAULT)
    ModelSpec.under_policy({"model_id": "m", "model": "x", "engine": "sim", "vllm_kwargs": {"sim_tokens_per_s": 100}},
                           DEFAULT)


@pytest.mark.parametrize("kwargs, name", [
    ({"structured_outputs_config": {"backend": "xgrammar", "reasoning_parser_plugin": "/tmp/evil.py"}},
     "structured_outputs_config.reasoning_parser_plugin"),
    ({"reasoning_parser_plugin": "/tmp/evil.py"}, "reasoning_parser_plugin"),
    ({"mm_processor_kwargs": {"cache_dir": "/etc"}}, "mm_processor_kwargs.cache_dir"),
    ({"mm_processor_kwargs": {"images_kwargs": {"tokenizer_file": "/etc/passwd"}}},
     "mm_processor_kwargs.images_kwargs.tokenizer_file"),
    ({"hf_overrides": {"text_config": {"auto_map": {"AutoModel": "other--m.C"}}}}, "hf_overrides.text_config.auto_map"),
])
def test_code_and_path_loading_keys_inside_allowed_arguments_need_the_operator(kwargs, name):
    assert f"{name} is refused" in problems(kwargs) and f"HIVE_VLLM_KWARGS_ALLOW={name}" in problems(kwargs)
    assert problems(kwargs, settings=HiveSettings(vllm_kwargs_allow=[name])) == ""
