"""The entry points: a model's config, read (``config.py``), then built into a profile (``build.py``).

Kept apart from ``config.py`` so reading a config never imports the builder that reads it back.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hive_apps.core.planning.profile.build import build_or_422
from hive_apps.core.planning.profile.config import (
    config_from_dict,
    generic_config,
    require_object,
    resolve_local_folder,
)
from hive_apps.core.planning.profile.model import ModelProfile
from hive_apps.core.planning.types import PlanningError


def load_profile(model: str, vllm_kwargs: dict[str, Any] | None = None) -> ModelProfile:
    """Profile a local model folder, or a Hugging Face name already in the local cache (no network)."""
    vllm_kwargs = dict(vllm_kwargs or {})
    folder = resolve_local_folder(model)
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise PlanningError(f"model {model!r}: cannot read {config_path}: {exc}", 422) from exc
    require_object(raw, f"model {model!r}: {config_path}")
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    except Exception:  # custom code or a model type transformers does not know: read the raw fields
        cfg = generic_config(raw)
    return build_or_422(cfg, raw, model=model, path=folder, vllm_kwargs=vllm_kwargs)


def profile_from_config_dict(d: dict[str, Any], path: str = "",
                             vllm_kwargs: dict[str, Any] | None = None,
                             model: str | None = None) -> ModelProfile:
    """Profile a parsed ``config.json`` (side files such as hf_quant_config.json are read from ``path``)."""
    require_object(d, f"model {model or path!r}: config.json")
    return build_or_422(config_from_dict(d), d, model=model or path or d.get("_name_or_path", ""),
                        path=path, vllm_kwargs=dict(vllm_kwargs or {}))
