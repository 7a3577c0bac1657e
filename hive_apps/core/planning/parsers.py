"""Tool-call and reasoning parsers for a deploy that names none (issue 12, item 5). Pure: no Ray, no vLLM.

vLLM parses tool calls and reasoning only when it is told which parser fits the model
(``tool_call_parser``, ``reasoning_parser``, ``enable_auto_tool_choice``). The hive picks them
from the model's family (config ``model_type``, and the name for DeepSeek-R1) and its chat template
(``tokenizer_config.json``'s ``chat_template``, or ``chat_template.jinja``/``.json`` in the folder):

* a tool parser only when the template mentions ``tools`` (a base model without a tool template
  gets none), and then ``enable_auto_tool_choice=True`` too;
* a reasoning parser from the family (Qwen3 only when its template, if found, knows ``<think>``).

A user value always wins, key by key: a named parser is used as is; ``tool_call_parser: null`` /
``reasoning_parser: null`` turn that parser off (the key is dropped from the engine kwargs);
``enable_auto_tool_choice: false`` keeps auto tool choice off, and then the hive picks no tool
parser either (one the user names is kept). Only names vLLM 0.32 registers are used
(``TOOL_PARSERS``/``REASONING_PARSERS``; tests/unit/core/test_parsers.py checks them against vLLM).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from pydantic import BaseModel

from hive_apps.core.planning.types import PlanningError

TOOL_KEY, REASONING_KEY, AUTO_KEY = "tool_call_parser", "reasoning_parser", "enable_auto_tool_choice"

# The names this module may pick; each is registered in vLLM 0.32 (vllm/tool_parsers, vllm/reasoning).
TOOL_PARSERS = frozenset({"hermes", "qwen3_coder", "llama3_json", "llama4_pythonic", "mistral", "deepseek_v3",
                          "deepseek_v31", "deepseek_v32", "openai", "gemma4"})
REASONING_PARSERS = frozenset({"qwen3", "deepseek_r1", "deepseek_v3", "openai_gptoss", "gemma4"})

_QWEN2 = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_audio"}
_QWEN3 = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"}
_MISTRAL = {"mistral", "mixtral", "mistral3", "pixtral", "ministral", "ministral3"}
_LLAMA3 = {"llama", "mllama"}

_TOOLS_RE = re.compile(r"\btools\b")


class ParserChoice(BaseModel):
    """What the hive decided, and why (the plan's notes)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    notes: list[str] = []


def read_chat_template(folder: str) -> str | None:
    """The model folder's chat template text (all named templates joined), or None when it has none."""
    if not folder or not os.path.isdir(folder):
        return None
    for name in ("chat_template.jinja",):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    return f.read()
            except OSError:
                return None
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
        if isinstance(template, str) and template:
            return template
    return None


def _family_parsers(model_type: str, model: str, template: str | None) -> tuple[str | None, str | None, str]:
    """(tool parser, reasoning parser, family name) from the family, refined by template markers."""
    t = template or ""
    think = template is None or "<think>" in t
    name = model.lower()
    if model_type in _QWEN3:
        tool = "qwen3_coder" if "<function=" in t else "hermes"
        return tool, ("qwen3" if think else None), "Qwen3"
    if model_type in _QWEN2:
        return "hermes", None, "Qwen2/2.5"
    if model_type == "gpt_oss":
        return "openai", "openai_gptoss", "gpt-oss"
    if model_type == "deepseek_v32":
        return "deepseek_v32", "deepseek_v3", "DeepSeek-V3.2"
    if model_type == "deepseek_v3":
        if re.search(r"\bthinking\b", t) and "</think>" in t:
            return "deepseek_v31", "deepseek_v3", "DeepSeek-V3.1"
        if "<think>" in t or re.search(r"(^|[-_/])r1([-_/]|$)", name):
            return "deepseek_v3", "deepseek_r1", "DeepSeek-R1"
        return "deepseek_v3", None, "DeepSeek-V3"
    if "[TOOL_CALLS]" in t or (model_type in _MISTRAL and template is None):
        return "mistral", None, "Mistral"  # the parser needs the [TOOL_CALLS] token; a ChatML fine-tune is Hermes
    if model_type == "llama4":
        return "llama4_pythonic", None, "Llama 4"
    if model_type in _LLAMA3 and ("<|python_tag|>" in t or "<|eot_id|>" in t or "ipython" in t):
        return "llama3_json", None, "Llama 3.1+"
    if model_type == "gemma4":
        return "gemma4", "gemma4", "Gemma 4"
    if "<tool_call>" in t:
        return "hermes", None, "a Hermes-style template (<tool_call>)"
    return None, None, ""


def choose_parsers(*, model_type: str, model: str, template: str | None,
                   user: dict[str, Any], runner: str = "generate") -> ParserChoice:
    """The parsers and auto tool choice for one deploy; ``user`` is its vllm_kwargs (user keys win)."""
    if runner != "generate":
        return ParserChoice()
    tool, reasoning, family = _family_parsers(model_type, model, template)
    supports_tools = template is not None and bool(_TOOLS_RE.search(template))
    notes: list[str] = []
    why = f"model family {family}" if family else ""

    if TOOL_KEY in user:
        tool_choice = user[TOOL_KEY]  # None: off
    elif user.get(AUTO_KEY) is False:
        tool_choice = None
    elif tool and supports_tools:
        tool_choice = tool
        notes.append(f"tool_call_parser={tool!r} chosen from the {why} and its chat template, which takes tools "
                     "(set vllm_kwargs.tool_call_parser to choose another, or null for none)")
    else:
        tool_choice = None
        if tool and template is None:
            notes.append(f"no tool parser: no chat template found in the model folder (the {why} would use {tool!r}; "
                         "name it in vllm_kwargs.tool_call_parser)")

    if AUTO_KEY in user:
        auto = bool(user[AUTO_KEY])
    else:
        auto = bool(tool_choice) and supports_tools
        if auto and TOOL_KEY in user:
            notes.append("enable_auto_tool_choice=True: the chat template takes tools and a tool parser is set")

    if REASONING_KEY in user:
        reasoning_choice = user[REASONING_KEY]
    elif reasoning:
        reasoning_choice = reasoning
        notes.append(f"reasoning_parser={reasoning!r} chosen from the {why} (set vllm_kwargs.reasoning_parser to "
                     "choose another, or null for none)")
    else:
        reasoning_choice = None
    if auto and not tool_choice:
        raise PlanningError("vllm_kwargs.enable_auto_tool_choice=true needs a tool parser, and the hive knows none "
                            f"for {model!r} (model_type {model_type!r}, or its chat template takes no tools): name "
                            "one in vllm_kwargs.tool_call_parser", 422)
    return ParserChoice(tool_call_parser=tool_choice, reasoning_parser=reasoning_choice,
                        enable_auto_tool_choice=auto, notes=notes)


def apply_choice(engine_kwargs: dict[str, Any], choice: ParserChoice) -> dict[str, Any]:
    """The engine kwargs with the choice in: set parsers named, null ones dropped (vLLM's default: none)."""
    out = {k: v for k, v in engine_kwargs.items() if k not in (TOOL_KEY, REASONING_KEY, AUTO_KEY)}
    if choice.tool_call_parser:
        out[TOOL_KEY] = choice.tool_call_parser
    if choice.reasoning_parser:
        out[REASONING_KEY] = choice.reasoning_parser
    if choice.enable_auto_tool_choice:
        out[AUTO_KEY] = True
    return out
