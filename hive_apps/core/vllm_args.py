"""Which ``vllm_kwargs`` a deploy may pass, and of what type. Pure: no Ray, no vLLM.

The admin token must not be remote code execution on every node: an open pass-through of
vLLM arguments lets a deploy run a hub's code (``trust_remote_code``), read local files
(``chat_template`` paths, ``allowed_local_media_path``), import plugins, or break the hive's
own accounting (pipeline or data parallel, CPU offload). So the hive takes only the arguments
it understands (sizing, parsers, structured outputs, sampling defaults), checks their types
at plan time, and refuses the rest with a reason. Operators widen the list with
``HIVE_VLLM_KWARGS_ALLOW``, allow remote code with ``HIVE_TRUST_REMOTE_CODE`` and name the
packages code hooks may come from with ``HIVE_HOOK_PACKAGES``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hive_apps.core.settings import HiveSettings

MAX_INT = 2**53
MAX_STR = 4096
MAX_JSON_BYTES = 64 * 1024

ALLOWED: dict[str, type] = {
    # sizing and the engine's shape (the planner reads or overrides these)
    "max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int, "gpu_memory_utilization": float,
    "kv_cache_memory_bytes": int, "kv_cache_dtype": str, "block_size": int, "tensor_parallel_size": int,
    "enable_prefix_caching": bool, "enable_chunked_prefill": bool, "enforce_eager": bool, "dtype": str,
    "quantization": str, "max_logprobs": int, "limit_mm_per_prompt": dict, "mm_processor_kwargs": dict,
    "mm_encoder_tp_mode": str, "language_model_only": bool, "mamba_ssm_cache_dtype": str, "runner": str,
    "convert": str, "pooler_config": dict, "hf_overrides": dict, "revision": str, "tokenizer_mode": str,
    "seed": int, "max_num_partial_prefills": int, "long_prefill_token_threshold": int,
    "disable_sliding_window": bool,
    # parsers
    "tool_call_parser": str, "reasoning_parser": str, "enable_auto_tool_choice": bool, "chat_template": str,
    "chat_template_content_format": str,
    # structured outputs and sampling defaults
    "structured_outputs_config": dict, "generation_config": str, "override_generation_config": dict,
    "response_role": str, "return_tokens_as_token_ids": bool, "enable_force_include_usage": bool,
}
NULLABLE = {"tool_call_parser", "reasoning_parser"}  # null turns off the parser the hive would pick
HOOKS = {"hive_placement_policy", "hive_attention_cls"}  # class paths the planner imports
SIM: dict[str, type] = {"sim_tokens_per_s": float, "sim_start_delay_s": float, "sim_fail_start": bool,
                        "sim_memory_factor": float, "sim_cold_start": bool, "sim_corrupt_wake": bool,
                        "sim_sleep_mode": bool}

# Never, whatever the operator widens: these break what the hive accounts for or guards.
REFUSED: dict[str, str] = {
    "distributed_executor_backend": "the hive runs tensor parallel on one node with vLLM's mp backend",
    "pipeline_parallel_size": "the planner sizes one node's tensor-parallel group; pipeline stages are not planned",
    "data_parallel_size": "replicas are the hive's data parallelism: use 'replicas'",
    "cpu_offload_gb": "offloaded weights are memory the planner does not account for",
    "kv_offloading_size": "offloaded KV is memory the planner does not account for",
    "api_key": "the hive's API keys guard every route; engines are reached only through it",
    "root_path": "the hive routes each model at /<model_id>",
    "otlp_traces_endpoint": "it sends request data off the cluster; configure tracing on the cluster instead",
    "host": "the engine serves on the hive's own engine port", "port": "the engine serves on the hive's own engine port",
    "model": "set by the hive from 'model'", "served_model_name": "set by the hive from 'model_id'",
    "device": "set by the hive from the placement",
    **{k: "set by the hive from the deploy's 'lora' field ({max_loras, max_lora_rank, max_cpu_loras}), whose memory "
          "the planner books" for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules",
                                        "fully_sharded_loras", "lora_dtype", "max_lora_cls_labels")},
}
IMPORTS_A_MODULE = "it imports any Python module or .py file"
# Allowed only when the operator says so: they run or read code and files the deploy names.
RISKY: dict[str, str] = {
    "trust_remote_code": "it runs the model repository's own Python code on the node (HIVE_TRUST_REMOTE_CODE=1 allows it)",
    "tokenizer": "it loads a tokenizer from another path or repository",
    "hf_config_path": "it loads a config from another path or repository",
    "speculative_config": "it loads a second model",
    "tool_parser_plugin": "it imports a Python file",
    "allowed_local_media_path": "it lets requests read local files",
    "download_dir": "it writes to a path of the deploy's choosing",
    "reasoning_parser_plugin": IMPORTS_A_MODULE,
}
# Keys at any depth of the dict-valued arguments above that make vLLM 0.32, or the transformers
# loaders it hands them to, import code or open paths: ``structured_outputs_config.
# reasoning_parser_plugin`` imports any module or .py file; ``mm_processor_kwargs`` go on to
# ``AutoProcessor.from_pretrained`` (``cache_dir``, ``tokenizer_file``, ``code_revision``...);
# ``hf_overrides`` can point ``auto_map`` at other code. Allowed only where the operator lists the
# dotted name (``structured_outputs_config.reasoning_parser_plugin``) in HIVE_VLLM_KWARGS_ALLOW.
NESTED_RISKY: dict[str, str] = {
    "auto_map": "it points the model's config at other Python code",
    "code_revision": "it picks which revision of a repository's Python code runs",
    "trust_remote_code": "it runs a repository's own Python code on the node",
}
OPENS_A_PATH = "it reads or writes a path of the deploy's choosing"
NESTED_RISKY_SUFFIXES: dict[str, str] = {
    "_plugin": IMPORTS_A_MODULE,
    "_path": OPENS_A_PATH, "_file": OPENS_A_PATH, "_files": OPENS_A_PATH, "_dir": OPENS_A_PATH,
}


def _type_problem(key: str, value: Any, kind: type) -> str | None:
    if kind is bool:
        return None if isinstance(value, bool) else f"{key} must be true or false"
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be an integer"
        return None if abs(value) < MAX_INT else f"{key} is out of range"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} must be a number"
        return None if math.isfinite(value) and abs(value) < MAX_INT else f"{key} must be a finite number in range"
    if kind is str:
        if not isinstance(value, str):
            return f"{key} must be a string"
        return None if len(value) <= MAX_STR else f"{key} is longer than {MAX_STR} characters"
    if kind is dict:
        if not isinstance(value, dict):
            return f"{key} must be a JSON object"
        try:
            size = len(json.dumps(value))
        except (ValueError, RecursionError):
            return f"{key} is not plain JSON"
        return None if size <= MAX_JSON_BYTES else f"{key} is larger than {MAX_JSON_BYTES // 1024} KiB"
    return None


def _hook_problem(key: str, value: Any, settings: HiveSettings | None) -> str | None:
    if not isinstance(value, str):
        return f"{key} must be a class path 'package.module.Class'"
    if "." not in value or settings is None:
        return None  # imports nothing (the planner refuses it as no class path), or no policy to check
    if not settings.hook_packages:
        return f"{key}: code hooks are off; an operator turns them on with HIVE_HOOK_PACKAGES=<package prefixes>"
    if not any(value == p or value.startswith(p + ".") for p in settings.hook_packages):
        return f"{key}: {value!r} is not under the packages the operator allows ({', '.join(settings.hook_packages)})"
    return None


def _needs_operator(name: str, reason: str) -> str:
    return f"{name} is refused: {reason}; an operator may allow it with HIVE_VLLM_KWARGS_ALLOW={name}"


def _nested_risk(key: str) -> str | None:
    return NESTED_RISKY.get(key) or next((why for end, why in NESTED_RISKY_SUFFIXES.items() if key.endswith(end)), None)


def _nested_problems(key: str, value: Any, widened: set[str]) -> list[str]:
    """A dict-valued argument is passed on whole: the code- and path-loading keys inside it, at
    any depth, need the operator as much as the top-level ones do."""
    problems, todo = [], [(key, value)]
    while todo:
        path, node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, inner in items:
            dotted = f"{path}.{name}"
            reason = _nested_risk(name) if isinstance(name, str) else None
            if reason and dotted not in widened:
                problems.append(_needs_operator(dotted, reason))
            todo.append((dotted, inner))
    return sorted(problems)


LEGACY_TASK = "task"
LEGACY_POOLING_TASKS = ("embed", "embedding")


def legacy_task(kwargs: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """vLLM's old ``task="embed"``: the kwargs with ``runner="pooling"`` instead, and the
    deprecation note the model's status shows."""
    if LEGACY_TASK not in kwargs:
        return kwargs, None
    kept = {k: v for k, v in kwargs.items() if k != LEGACY_TASK}
    kept["runner"] = "pooling"
    return kept, (f"vllm_kwargs.task={kwargs[LEGACY_TASK]!r} is deprecated (vLLM removed it); it was mapped to "
                  "runner='pooling': deploy with that instead")


def vllm_kwargs_problems(kwargs: dict[str, Any], engine: str, settings: HiveSettings | None) -> list[str]:
    """Every reason to refuse these ``vllm_kwargs`` (empty: they may be used). ``settings`` None: no
    operator policy (``core/spec.py``): only what no setting changes is checked (types, the keys
    never taken, sim keys, ``task``); the keys an operator must allow, and unknown ones, pass."""
    problems: list[str | None] = []  # None: a check that found nothing (dropped at the end)
    widened = set(settings.vllm_kwargs_allow) if settings is not None else set()
    for key, value in kwargs.items():
        if key in REFUSED:
            problems.append(f"{key} is refused: {REFUSED[key]}")
        elif key in RISKY:
            if settings is None:
                continue  # the operator's to allow or refuse
            if key == "trust_remote_code":
                allowed = value is False or (value is True and settings.trust_remote_code)
            else:
                allowed = key in widened
            if not allowed:
                problems.append(f"{key} is refused: {RISKY[key]}" if key == "trust_remote_code"
                                else _needs_operator(key, RISKY[key]))
        elif key in HOOKS:
            problem = _hook_problem(key, value, settings)
            if problem:
                problems.append(problem)
        elif key == LEGACY_TASK:
            if value not in LEGACY_POOLING_TASKS:
                problems.append(f"task={value!r} is vLLM's old way to pick a runner and only 'embed' is still mapped "
                                "(to runner='pooling'); use runner and convert instead")
            elif kwargs.get("runner") not in (None, "pooling"):
                problems.append(f"task={value!r} means runner='pooling' but runner={kwargs['runner']!r}; keep one")
        elif key in SIM:
            if engine != "sim":
                problems.append(f"{key} is a setting of the sim engine; this deploy uses {engine!r}")
            else:
                problems.append(_type_problem(key, value, SIM[key]))
        elif key in ALLOWED:
            if value is None and key in NULLABLE:
                continue  # null: the hive picks no such parser (core/planning/parsers.py)
            problem = _type_problem(key, value, ALLOWED[key])
            problems.append(problem)
            if problem is None and ALLOWED[key] is dict and settings is not None:
                problems.extend(_nested_problems(key, value, widened))
            if key == "chat_template" and isinstance(value, str) and "{{" not in value and "{%" not in value:
                problems.append("chat_template must be the template itself (Jinja text); a path would read a local file")
        elif settings is not None and key not in widened:  # without a policy, the operator's to allow
            problems.append(f"{key} is not among the vLLM arguments the hive takes (sizing, parsers, structured "
                            "outputs, sampling defaults); an operator may allow it with HIVE_VLLM_KWARGS_ALLOW")
    return [p for p in problems if p]
