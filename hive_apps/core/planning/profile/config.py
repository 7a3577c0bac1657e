"""Config reading: a local folder, a Hugging Face name already in the local cache, or a parsed dict.

No weights are read and nothing is downloaded. ``transformers.AutoConfig`` builds the config
when it knows the model type (so its defaults apply, as they do in vLLM); otherwise every raw
key is kept on a bare ``PretrainedConfig``. ``load.py`` builds the profile from what is read here.
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

from hive_apps.core.planning.types import PlanningError


def require_object(raw: Any, what: str) -> None:
    """A config.json that is valid JSON but not an object (a list, a string) is a 422, not a crash."""
    if not isinstance(raw, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(raw), "number")
        raise PlanningError(f"{what} must hold a JSON object (the model's config), not a JSON {kind}", 422)


def resolve_local_folder(model: str) -> str:
    if os.path.isdir(model):
        return os.path.abspath(model)
    if os.path.isfile(model) and os.path.basename(model) == "config.json":
        return os.path.dirname(os.path.abspath(model))
    try:
        from transformers.utils import cached_file

        resolved = cached_file(model, "config.json", local_files_only=True)
    except Exception as exc:
        raise PlanningError(
            f"model {model!r} is neither a local folder nor a Hugging Face name in the local "
            f"cache ({type(exc).__name__}); download it first or give a folder path", 422,
        ) from exc
    if not resolved:
        raise PlanningError(f"model {model!r}: config.json not found in the local cache", 422)
    return os.path.dirname(resolved)


def config_from_dict(d: dict[str, Any]) -> Any:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = d.get("model_type")
        if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type].from_dict(dict(d))
    except Exception:
        pass
    return generic_config(d)


def generic_config(d: dict[str, Any]) -> Any:
    """A bare PretrainedConfig holding every raw key, for types transformers cannot build."""
    from transformers import PretrainedConfig

    cfg = PretrainedConfig()
    for key, value in d.items():
        try:
            setattr(cfg, key, value)
        except Exception:
            cfg.__dict__[key] = value
    return cfg


def read_json(folder: str, name: str) -> dict[str, Any] | None:
    if not folder or not os.path.isdir(folder):
        return None
    p = os.path.join(folder, name)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            return cast(dict[str, Any], json.load(f))
    except (OSError, ValueError):
        return None


def checkpoint_bytes(folder: str) -> int | None:
    """Bytes of all tensors in the folder's safetensors files, from headers only."""
    if not folder or not os.path.isdir(folder):
        return None
    index = read_json(folder, "model.safetensors.index.json")
    if index and isinstance(index.get("metadata"), dict) and index["metadata"].get("total_size"):
        return int(index["metadata"]["total_size"])
    total = 0
    found = False
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        try:
            with open(os.path.join(folder, name), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError):
            return None
        for key, meta in header.items():
            if key != "__metadata__":
                start, end = meta["data_offsets"]
                total += end - start
        found = True
    return total if found else None
