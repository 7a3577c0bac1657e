"""Architecture families: how vLLM 0.32's model code for one kind of model lays out its layers.

One small class per family, keyed by ``model_type`` (the way vLLM's
``transformers_utils/model_arch_config_convertor.py`` keys its convertors), answers the
questions the builder asks: the model's dimensions, each layer's token mixer (attention,
sliding window, MLA, Mamba-2, gated delta net) with its KV heads and head sizes, which layers
reuse another layer's cache, the recurrent states, and the parameter count by role. ``Family``
itself is the generic decoder (Llama-like) and refuses, with ``Unmodelled``, every config
feature that would change the KV cache in a way it does not model, so nothing is ever sized
smaller than vLLM sizes it.

A user's ``vllm_kwargs["hive_attention_cls"] = "pkg.module.Class"`` is one more such class: it
is mixed in front of the family of the model (``Class`` first in the MRO), so it can override
any question and call ``super()`` for the default. Besides the layout methods, a user class
may define ``kv_bytes_per_token(tensor_parallel_size)`` (and ``kv_bytes_per_sequence(
max_model_len, tensor_parallel_size, block_size)`` for layouts not linear in the length), and
``mm_max_tokens_per_item(mm_processor_kwargs) -> {modality: tokens}``, like vLLM's
``ProcessingInfo.get_mm_max_tokens_per_item``.
"""

from __future__ import annotations

import importlib

from hive_apps.core.planning.profile.families.base import (
    KV_SHAPING_KEYS,
    VLLM_MLA_MODEL_TYPES,
    Ctx,
    Dims,
    Family,
    Layer,
    MoeInfo,
)
from hive_apps.core.planning.profile.families.common import (
    EncoderFamily,
    FalconFamily,
    GptOssFamily,
    QkNormFamily,
    Qwen2Family,
    UngatedFamily,
)
from hive_apps.core.planning.profile.families.gemma import Gemma2Family, Gemma3Family, Gemma3nFamily, Gemma4Family
from hive_apps.core.planning.profile.families.hybrid import NemotronHFamily, NemotronNasFamily, Qwen3NextFamily
from hive_apps.core.planning.profile.families.local import Llama4Family, MiMoV2Family
from hive_apps.core.planning.profile.families.mla import MlaFamily, MlaFullKvFamily, UnverifiedMlaFamily
from hive_apps.core.planning.types import PlanningError

FAMILIES: list[type[Family]] = [
    EncoderFamily, Qwen2Family, QkNormFamily, Qwen3NextFamily, Gemma2Family, Gemma3Family, GptOssFamily,
    UngatedFamily, FalconFamily, NemotronHFamily, MlaFamily, MlaFullKvFamily, UnverifiedMlaFamily,
    NemotronNasFamily, Gemma3nFamily, Gemma4Family, Llama4Family, MiMoV2Family,
]
_BY_TYPE = {t: fam for fam in FAMILIES for t in fam.model_types}
_BY_ARCH = {a: fam for fam in FAMILIES for a in fam.architectures}


def family_class(text_type: str, model_type: str, architecture: str) -> type[Family]:
    """The family of the language model: by its model type, then the outer one, then the architecture."""
    return _BY_TYPE.get(text_type) or _BY_TYPE.get(model_type) or _BY_ARCH.get(architecture) or Family


_HOOK_METHODS = ("kv_bytes_per_token", "kv_bytes_per_sequence", "mm_max_tokens_per_item", "build_layer",
                 "attention_groups", "cache_keys", "count_params")


def with_user_family(base: type[Family], dotted: str) -> type[Family]:
    """``vllm_kwargs["hive_attention_cls"]``: the user's class mixed in front of the model's family."""
    module_name, _, cls_name = dotted.rpartition(".")
    try:
        user = getattr(importlib.import_module(module_name), cls_name)
        if not isinstance(user, type):
            raise TypeError(f"{dotted} is a {type(user).__name__}, not a class")
        combined = type(f"{user.__name__}+{base.__name__}", (user, base), {"__module__": __name__})
    except Exception as exc:
        raise PlanningError(
            f"hive_attention_cls {dotted!r} cannot be loaded: {type(exc).__name__}: {exc}; give an importable "
            "'package.module.Class' that overrides one of kv_bytes_per_token(tensor_parallel_size), "
            "kv_bytes_per_sequence(max_model_len, tensor_parallel_size, block_size) or "
            "mm_max_tokens_per_item(mm_processor_kwargs) (it is mixed into the planner's family class for the "
            "model, so super() gives the default)", 422,
        ) from exc
    if not any(getattr(user, name, None) not in (None, getattr(Family, name, None)) for name in _HOOK_METHODS):
        raise PlanningError(f"hive_attention_cls {dotted!r} overrides none of "
                            "kv_bytes_per_token(tensor_parallel_size), "
                            "kv_bytes_per_sequence(...) or mm_max_tokens_per_item(mm_processor_kwargs)", 422)
    return combined


def overrides(family: Family, name: str) -> bool:
    """Whether the family's class (a user class mixed in) replaces ``Family.<name>``."""
    return getattr(type(family), name) is not getattr(Family, name)


__all__ = ["KV_SHAPING_KEYS", "VLLM_MLA_MODEL_TYPES", "Ctx", "Dims", "Family", "Layer", "MoeInfo", "FAMILIES",
           "family_class", "with_user_family", "overrides"]
