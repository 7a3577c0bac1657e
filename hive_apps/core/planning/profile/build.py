"""Building a ``ModelProfile``: support check, dtype, quantization, then the family reads the layers.

Every config the planner cannot model exactly ends here as a 422 that says what is unknown and
how to supply it, never as a 500 and never as a smaller reservation than vLLM's.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from hive_apps.core.planning.profile import quant, towers
from hive_apps.core.planning.profile import vllm_registry as registry
from hive_apps.core.planning.profile.config import checkpoint_bytes
from hive_apps.core.planning.profile.families import Ctx, Family, family_class, overrides, with_user_family
from hive_apps.core.planning.profile.fields import DTYPE_BYTES, Unmodelled, dtype_name, get
from hive_apps.core.planning.profile.model import ModelProfile, weights_by_role
from hive_apps.core.planning.types import PlanningError

_POOLING_SUFFIXES = (
    "Model", "ForSequenceClassification", "ForTokenClassification", "ForMaskedLM",
    "ForRewardModel", "ForEmbedding",
)
_GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def build_or_422(cfg: Any, raw: dict[str, Any], *, model: str, path: str,
                 vllm_kwargs: dict[str, Any]) -> ModelProfile:
    """A config shape the planner does not model is a 422 naming what is unknown, never a 500 or a guess."""
    where = (f"model {model!r} (architecture {(raw.get('architectures') or ['?'])[0]}, model_type "
             f"{raw.get('model_type')!r})")
    try:
        return build_profile(cfg, raw, model=model, path=path, vllm_kwargs=vllm_kwargs)
    except Unmodelled as exc:
        how = exc.how or ("fix the config, or supply the layout with vllm_kwargs['hive_attention_cls'] "
                          "(README 'Planning hooks')")
        raise PlanningError(f"{where}: the planner cannot model this config exactly: {exc.what}. It does not "
                            f"guess a smaller reservation; {how}", 422) from exc
    except RuntimeError as exc:
        if type(exc).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        raise PlanningError(f"{where}: the planner cannot model this config exactly: a per-layer attribute "
                            f"(per_layer_config) read as one number: {exc}. It does not guess a smaller "
                            "reservation; report the config, or supply the layout with "
                            "vllm_kwargs['hive_attention_cls']", 422) from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
        raise PlanningError(
            f"{where}: the planner cannot model this config.json: {type(exc).__name__}: {exc}. A field of a "
            "shape it does not read is the usual cause; it does not guess a smaller reservation. Report the "
            "config, or supply the layout with vllm_kwargs['hive_attention_cls']", 422) from exc


def check_supported(architecture: str, model_type: str, vllm_kwargs: dict[str, Any], raw: dict[str, Any]) -> None:
    """Refuse an architecture vLLM 0.32 does not run, naming it (vLLM would fail only at engine start)."""
    if architecture in registry.PREVIOUSLY_SUPPORTED:
        raise PlanningError(
            f"architecture {architecture} is not supported by vLLM {registry.VLLM_VERSION}: vLLM ran it until "
            f"v{registry.PREVIOUSLY_SUPPORTED[architecture]} and has removed it, so an engine would fail at "
            "start. Deploy a model vLLM still supports", 422)
    if architecture in registry.OUT_OF_TREE and not vllm_kwargs.get("hive_attention_cls"):
        raise PlanningError(
            f"architecture {architecture} runs only with the out-of-tree vLLM plugin "
            f"{registry.OUT_OF_TREE[architecture]}, which the planner does not model; install the plugin in the "
            "engine image and supply the layout with vllm_kwargs['hive_attention_cls']", 422)
    if not architecture or architecture in registry.SUPPORTED_ARCHITECTURES:
        return
    if vllm_kwargs.get("hive_attention_cls"):
        return  # the user's family says how an out-of-tree model lays out its caches
    if str(vllm_kwargs.get("model_impl") or "auto") in ("auto", "transformers") and _transformers_knows(
            architecture, raw):
        return  # vLLM runs it through its Transformers backend; the generic family applies
    raise PlanningError(
        f"architecture {architecture} (model_type {model_type!r}) is not supported by vLLM "
        f"{registry.VLLM_VERSION}: it has no implementation of it and transformers has none for its Transformers "
        "backend, so an engine would fail at start. If an out-of-tree vLLM plugin runs it, supply its layout with "
        "vllm_kwargs['hive_attention_cls']", 422)


def _transformers_knows(architecture: str, raw: dict[str, Any]) -> bool:
    if raw.get("auto_map"):
        return True  # remote code: vLLM's Transformers backend loads it with trust_remote_code
    try:
        from transformers.models.auto import modeling_auto

        return any(architecture in getattr(modeling_auto, name).values() for name in dir(modeling_auto)
                   if name.endswith("_MAPPING_NAMES") and isinstance(getattr(modeling_auto, name), dict))
    except Exception:
        return False


def _runner(architecture: str, vllm_kwargs: dict[str, Any]) -> Literal["generate", "pooling"]:
    """vLLM's runner="auto" resolution, abridged: *ForCausalLM generates, *Model pools."""
    requested = vllm_kwargs.get("runner")
    if requested in ("generate", "pooling"):
        return cast(Literal["generate", "pooling"], requested)
    if vllm_kwargs.get("task") in ("embed", "embedding"):  # vLLM's old name (vllm_args.legacy_task)
        return "pooling"
    if vllm_kwargs.get("convert") in ("embed", "classify", "reward"):
        return "pooling"
    if architecture.endswith(_GENERATE_SUFFIXES):
        return "generate"
    if architecture.endswith(_POOLING_SUFFIXES):
        return "pooling"
    return "generate"


def _checkpoint_dtype(cfg: Any, text: Any) -> str | None:
    for c in (cfg, text, get(cfg, "vision_config")):
        if c is None:
            continue
        name = dtype_name(get(c, "dtype", "torch_dtype"))
        if name:
            return name
    return None


def _runtime_dtype(checkpoint: str | None, requested: Any, runner: str, notes: list[str]) -> str:
    """vLLM ``dtype="auto"``: keep bf16/fp16; fp32 (or unknown) becomes fp16 for pooling models, else bf16."""
    req = dtype_name(requested)
    if req and req != "auto":
        return req
    if checkpoint in ("bfloat16", "float16"):
        return checkpoint
    target = "float16" if runner == "pooling" else "bfloat16"
    notes.append(f"checkpoint dtype {checkpoint or 'unset (fp32)'} runs as {target} (vLLM dtype=auto downcast)")
    return target


def build_profile(cfg: Any, raw: dict[str, Any], *, model: str, path: str,
                  vllm_kwargs: dict[str, Any]) -> ModelProfile:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    architecture = (get(cfg, "architectures") or [""])[0] or ""
    model_type = str(get(cfg, "model_type", default="") or "")
    text_type = str(get(text, "model_type", default=model_type) or model_type)
    check_supported(architecture, model_type, vllm_kwargs, raw)

    notes: list[str] = []
    runner = _runner(architecture, vllm_kwargs)
    checkpoint_dtype = _checkpoint_dtype(cfg, text)
    dtype = _runtime_dtype(checkpoint_dtype, vllm_kwargs.get("dtype"), runner, notes)
    dtype_bytes = DTYPE_BYTES.get(dtype, 2)
    quant_cfg = quant.quantization_config(cfg, text, raw, path, vllm_kwargs, notes)
    scheme = quant.quant_scheme(quant_cfg, vllm_kwargs.get("quantization"))
    cache_dtype = quant.kv_cache_dtype(vllm_kwargs.get("kv_cache_dtype"), quant_cfg, notes)

    cls = family_class(text_type, model_type, architecture)
    hook = vllm_kwargs.get("hive_attention_cls")
    if hook:
        cls = with_user_family(cls, str(hook))
    ctx = Ctx(model=model, path=path, architecture=architecture, model_type=model_type, text_type=text_type,
              vllm_kwargs=vllm_kwargs, runner=runner, dtype_bytes=dtype_bytes, kv_cache_dtype=cache_dtype,
              kv_elem_bytes=float(dtype_bytes), notes=notes)
    try:
        family: Family = cls(cfg, text, ctx)
    except TypeError as exc:
        if not hook:
            raise
        raise PlanningError(f"hive_attention_cls {hook!r} cannot be built: {exc}. The class is mixed in front of "
                            "the planner's family class and built like it, Class(cfg, text, ctx); define no "
                            "__init__ (or pass those on to super()); the old Class(profile) form is gone", 422) from exc
    family.check()
    dims = family.dims
    is_mla = family.uses_mla()
    ctx.kv_elem_bytes = quant.kv_elem_bytes(cache_dtype, dtype_bytes, is_mla)
    encoder_only = family.encoder_only()

    counts, moe = family.count_params()
    mm_override = _user_mm_figures(family, vllm_kwargs, str(hook or ""))
    tower_list, mm_items = towers.towers_and_items(cfg, text, model_type, dims.hidden, path, vllm_kwargs, notes,
                                                   override=mm_override, override_from=str(hook or ""))
    counts.towers = sum(t.params for t in tower_list if t.loaded)
    attention_groups = family.attention_groups()
    state_groups = [] if encoder_only else family.state_groups()

    top_k = get(text, "num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts", default=0)
    top_k = int(max(top_k) if isinstance(top_k, list) else top_k or 0)
    active = counts.total - counts.towers
    if moe.experts and counts.experts:
        active -= counts.experts - counts.experts * min(top_k or 1, moe.experts) // moe.experts
    q_width, v_width = family.mla_widths()
    custom = family if (hook and (overrides(family, "kv_bytes_per_token")
                                  or overrides(family, "kv_bytes_per_sequence"))) else None
    # the widest attention layer stands for all in the activation estimate (memory.py)
    first = max((layer for layer in family.layers if layer.kv_heads and layer.head_size),
                key=lambda layer: layer.kv_heads * layer.head_size, default=None)
    return ModelProfile.assemble(
        custom_kv=custom,
        model=model, path=path, architecture=architecture, model_type=model_type, runner=runner,
        dtype=dtype, dtype_bytes=dtype_bytes, checkpoint_dtype=checkpoint_dtype, quant=scheme,
        kv_cache_dtype=cache_dtype, kv_elem_bytes=ctx.kv_elem_bytes, fp8_kv="fp8" in cache_dtype,
        hidden_size=dims.hidden, intermediate_size=dims.intermediate, num_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_kv_heads=family.kv_heads() if is_mla or not first else first.kv_heads,
        head_dim=first.head_size if first and first.head_size else family.head_dim(),
        vocab_size=dims.vocab, max_position_embeddings=family.max_position(), tie_word_embeddings=family.tied(),
        num_experts=moe.experts, experts_per_token=top_k, moe_intermediate_size=moe.expert_size,
        num_moe_layers=moe.layers, expert_matrices=moe.matrices, is_mla=is_mla, encoder_only=encoder_only,
        mla_q_width=q_width, mla_v_head_dim=v_width,
        params=counts, num_params=counts.total,
        weight_bytes=int(sum(weights_by_role(counts, scheme, dtype_bytes).values())),
        active_params=max(1, active), attention_groups=attention_groups, state_groups=state_groups,
        towers=tower_list, mm_items=mm_items, checkpoint_bytes=checkpoint_bytes(path),
        family=type(family).__name__, attention_cls=str(hook) if hook else None, notes=notes,
    )


def _user_mm_figures(family: Family, vllm_kwargs: dict[str, Any], hook: str) -> dict[str, int] | None:
    """A user family's ``mm_max_tokens_per_item(mm_processor_kwargs)``, checked."""
    if not hook or not overrides(family, "mm_max_tokens_per_item"):
        return None
    try:
        figures = family.mm_max_tokens_per_item(dict(vllm_kwargs.get("mm_processor_kwargs") or {}))
        return None if figures is None else {str(k): int(v) for k, v in dict(figures).items()}
    except Exception as exc:
        raise PlanningError(f"hive_attention_cls {hook!r}: mm_max_tokens_per_item failed: "
                            f"{type(exc).__name__}: {exc}", 422) from exc
