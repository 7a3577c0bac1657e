"""Vision and audio towers: their parameters and the worst-case item of every modality they serve.

The token math of each family lives in ``hive_apps/core/planning/multimodal.py``; here the towers are
recognised from the config (Qwen2/2.5-VL's own ViT, Gemma 4's and Llama 4's vision encoders, a
generic CLIP/SigLIP-style ViT with its projector, a Whisper-style audio encoder), the ``limit_mm_per_prompt`` defaults applied, and a
family's ``mm_max_tokens_per_item`` (a user class) laid over the built-in figures.
"""

from __future__ import annotations

from typing import Any

from hive_apps.core.planning import multimodal as mm
from hive_apps.core.planning.multimodal import MmItem, TowerInfo
from hive_apps.core.planning.profile.config import read_json
from hive_apps.core.planning.profile.fields import get
from hive_apps.core.planning.types import PlanningError


def _vit_block(vh: int, vi: int) -> int:
    """One pre-norm ViT/Whisper encoder block: q,k,v,o with biases, two-matrix MLP, two LayerNorms."""
    return 4 * vh * vh + 4 * vh + 2 * vh * vi + vi + vh + 4 * vh


# Towers whose size or tokens the generic ViT / Whisper arithmetic would get wrong and that have no
# arithmetic of their own here (Gemma 4's conformer audio encoder, Mllama's cross-attention tower):
# refused, not estimated.
_UNMODELLED_TOWERS = {"gemma4_audio", "mllama_vision_model"}

# modality -> (tower kind, tokens, prompt tokens, tower positions, knob, how)
_Raw = dict[str, tuple[str, int, int, int, str, str]]


def _qwen_vl(cfg: Any, vc: Any, model_type: str, lm_hidden: int, pre: Any, mm_kwargs: dict[str, Any],
             replicated: bool, notes: list[str], towers: list[TowerInfo], raw: _Raw, defaults: dict[str, int]) -> None:
    vtype = str(get(vc, "model_type", default=""))
    vh = int(get(vc, "hidden_size", "embed_dim"))
    depth = int(get(vc, "depth", "num_hidden_layers"))
    gated = model_type == "qwen2_5_vl" or vtype.startswith("qwen2_5")
    vi = int(get(vc, "intermediate_size", default=0) or vh * int(get(vc, "mlp_ratio", default=4)))
    patch = int(get(vc, "patch_size", "spatial_patch_size", default=14))
    temporal = int(get(vc, "temporal_patch_size", default=2))
    merge = int(get(vc, "spatial_merge_size", default=2))
    out = int(get(vc, "out_hidden_size", default=lm_hidden))
    mlp = 3 * vh * vi + 2 * vi + vh if gated else 2 * vh * vi + vi + vh
    block = 3 * vh * vh + 3 * vh + vh * vh + vh + mlp
    block += 2 * vh if gated else 4 * vh
    m = vh * merge * merge
    params = depth * block + 3 * temporal * patch * patch * vh + vh + (m * m + m + m * out + out)
    towers.append(TowerInfo(kind="vision", modalities=["image", "video"], hidden_size=vh,
                            intermediate_size=vi, num_layers=depth, params=params, replicated=replicated))
    for modality, (tokens, positions, how) in mm.qwen_vl_items(vc, get, pre, mm_kwargs, notes).items():
        scope = "images_kwargs" if modality == "image" else "videos_kwargs"
        raw[modality] = ("vision", tokens, tokens + mm.QWEN_VL_WRAPPER_TOKENS, positions,
                         f"mm_processor_kwargs.max_pixels (or {scope}.max_pixels)", how)
    defaults["image"] = 1


def _gemma4_vision(cfg: Any, vc: Any, lm_hidden: int, mm_kwargs: dict[str, Any], towers: list[TowerInfo],
                   raw: _Raw, defaults: dict[str, int]) -> None:
    """Gemma 4's vision tower: transformers' ``Gemma4VisionModel`` (``AutoModel.from_config``) with its linears
    replaced by ``ReplicatedLinear`` (``recursive_replace_linear(..., "replicate")``), so every rank holds it
    whole, plus ``embed_vision`` (``Gemma4MultimodalEmbedder``: one bias-free projection to the LM width)."""
    vh = int(get(vc, "hidden_size"))
    vi = int(get(vc, "intermediate_size"))
    depth = int(get(vc, "num_hidden_layers"))
    heads = int(get(vc, "num_attention_heads"))
    kv_heads = int(get(vc, "num_key_value_heads", default=heads))
    head = int(get(vc, "head_dim", default=vh // heads))
    patch = int(get(vc, "patch_size"))
    table = int(get(vc, "position_embedding_size"))
    # Gemma4VisionAttention: q, k, v, o without bias, q_norm and k_norm of head_dim (v_norm has no weight);
    # Gemma4VisionMLP: gate, up, down; four RMSNorms per layer (Gemma4VisionEncoderLayer)
    block = vh * heads * head + 2 * vh * kv_heads * head + heads * head * vh + 2 * head + 3 * vh * vi + 4 * vh
    # Gemma4VisionPatchEmbedder: input_proj (3 * patch^2 -> hidden, no bias), a (2, table, hidden) position table;
    # std_bias / std_scale buffers with standardize (loaded from the checkpoint)
    embed = 3 * patch * patch * vh + 2 * table * vh + (2 * vh if get(vc, "standardize", default=False) else 0)
    params = depth * block + embed + vh * lm_hidden
    towers.append(TowerInfo(kind="vision", modalities=["image", "video"], hidden_size=vh, intermediate_size=vi,
                            num_layers=depth, params=params, replicated=True))
    for modality, (tokens, prompt, positions, how) in mm.gemma4_items(vc, get, mm_kwargs).items():
        knob = ("mm_processor_kwargs.max_soft_tokens (70, 140, 280, 560 or 1120)" if modality == "image"
                else "limit_mm_per_prompt")
        raw[modality] = ("vision", tokens, prompt, positions, knob, how)
    defaults["image"] = 1


def _llama4_vision(cfg: Any, vc: Any, lm_hidden: int, pre: Any, mm_kwargs: dict[str, Any], replicated: bool,
                   towers: list[TowerInfo], raw: _Raw, defaults: dict[str, int]) -> None:
    """Llama 4's vision encoder (``mllama4.py::Llama4VisionModel``) and ``multi_modal_projector``: TP-sharded
    linears (Column/RowParallelLinear), unless ``mm_encoder_tp_mode="data"`` replicates them."""
    vh = int(get(vc, "hidden_size"))
    vi = int(get(vc, "intermediate_size"))
    depth = int(get(vc, "num_hidden_layers"))
    patch = int(get(vc, "patch_size"))
    image = int(get(vc, "image_size"))
    channels = int(get(vc, "num_channels", default=3))
    # Llama4VisionEncoderLayer: fused qkv and o with biases, a biased two-matrix MLP, two LayerNorms
    block = _vit_block(vh, vi)
    positions = (image // patch) ** 2 + 1
    # Llama4UnfoldConvolution (no bias), class embedding, positional_embedding_vlm, layernorm_pre / _post
    embed = channels * patch * patch * vh + vh + positions * vh + 4 * vh
    # vision_adapter (Llama4VisionPixelShuffleMLP): fc1 intermediate_size -> projector_input_dim, fc2 ->
    # projector_output_dim, biased with multi_modal_projector_bias; multi_modal_projector.linear_1 (no bias)
    inner, outer = int(get(vc, "projector_input_dim")), int(get(vc, "projector_output_dim"))
    bias = bool(get(vc, "multi_modal_projector_bias", default=False))
    adapter = vi * inner + inner * outer + ((inner + outer) if bias else 0)
    projector = int(get(vc, "vision_output_dim")) * lm_hidden
    params = depth * block + embed + adapter + projector
    towers.append(TowerInfo(kind="vision", modalities=["image"], hidden_size=vh, intermediate_size=vi,
                            num_layers=depth, params=params, replicated=replicated))
    tokens, prompt, pos, how = mm.llama4_image(vc, get, pre, mm_kwargs)
    raw["image"] = ("vision", tokens, prompt, pos, "mm_processor_kwargs.max_patches (tiles per image)", how)
    defaults["image"] = 1


def _vit(cfg: Any, vc: Any, model_type: str, lm_hidden: int, pre: Any, mm_kwargs: dict[str, Any],
         replicated: bool, notes: list[str], towers: list[TowerInfo], raw: _Raw, defaults: dict[str, int]) -> bool:
    """A generic ViT (CLIP, SigLIP, ...) with a projector; False when the config has no ViT width."""
    vh = int(get(vc, "hidden_size", "vt_hidden_size", "embed_dim", "width", default=0))
    if not vh:
        return False
    depth = int(get(vc, "num_hidden_layers", "vt_num_hidden_layers", "depth", "num_layers", default=24))
    depth += int(get(vc, "num_global_layers", default=0))
    vi = int(get(vc, "intermediate_size", "vt_intermediate_size", default=4 * vh))
    patch = get(vc, "patch_size", default=14)
    patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
    image = get(vc, "image_size", default=0)
    image = int(image[0] if isinstance(image, (list, tuple)) else image or 0)
    channels = int(get(vc, "num_channels", default=3))
    merge_kernel = get(vc, "merge_kernel_size", default=None)
    merge = int(merge_kernel[0]) if isinstance(merge_kernel, (list, tuple)) else 1
    positions = (image // patch) ** 2 + 1 if image else 0
    embed = channels * patch * patch * vh + vh + positions * vh + 2 * vh
    if model_type in ("gemma3", "gemma3n"):
        params = depth * _vit_block(vh, vi) + embed + vh * lm_hidden + vh  # + mm projection, norm
        tokens, prompt, pos, how = mm.gemma3_image(cfg, vc, get, pre, mm_kwargs)
        knob = "mm_processor_kwargs.do_pan_and_scan / pan_and_scan_max_num_crops" if tokens > \
            int(get(cfg, "mm_tokens_per_image", default=256)) else "limit_mm_per_prompt"
    elif model_type.startswith("llava"):
        feature = get(cfg, "vision_feature_layer", default=-1)
        layers = [feature] if isinstance(feature, int) else list(feature)
        depth = max(depth + f + 1 if f < 0 else f for f in layers)  # llava._get_num_hidden_layers
        params = depth * _vit_block(vh, vi) + embed
        params += vh * lm_hidden + lm_hidden + lm_hidden * lm_hidden + lm_hidden  # 2-layer projector
        tokens, pos, how = mm.llava_image(cfg, vc, get)
        prompt, knob = tokens, "limit_mm_per_prompt (a LLaVA image is always this size)"
    elif model_type in ("idefics3", "smolvlm"):
        scale = int(get(cfg, "scale_factor", default=2))
        m = vh * scale * scale
        params = depth * _vit_block(vh, vi) + embed - vh + m * lm_hidden  # no CLS position; bias-free connector
        tokens, prompt, pos, how = mm.idefics3_image(cfg, vc, get, pre, mm_kwargs)
        knob = "mm_processor_kwargs.do_image_splitting / size.longest_edge (or limit_mm_per_prompt)"
    else:
        m = vh * merge * merge
        params = depth * _vit_block(vh, vi) + embed + m * m + m + m * lm_hidden + lm_hidden
        tokens = max(1, (positions - 1) // (merge * merge)) if positions else 1024
        prompt, pos, knob = tokens, max(1, positions) if positions else tokens, "limit_mm_per_prompt"
        how = ("generic ViT estimate (image_size/patch)^2/merge^2; a hive_attention_cls with "
               "mm_max_tokens_per_item gives the exact figure")
        notes.append(f"vision tokens per image estimated ({tokens}): {how}")
    towers.append(TowerInfo(kind="vision", modalities=["image"], hidden_size=vh, intermediate_size=vi,
                            num_layers=depth, params=params, replicated=replicated))
    raw["image"] = ("vision", tokens, prompt, pos, knob, how)
    defaults["image"] = 1
    return True


def _audio(ac: Any, lm_hidden: int, pre: Any, replicated: bool, towers: list[TowerInfo], raw: _Raw,
           defaults: dict[str, int]) -> None:
    ah = int(get(ac, "d_model", "hidden_size", default=1280))
    layers = int(get(ac, "encoder_layers", "num_hidden_layers", default=32))
    ai = int(get(ac, "encoder_ffn_dim", "intermediate_size", default=4 * ah))
    mels = int(get(ac, "num_mel_bins", default=128))
    source = int(get(ac, "max_source_positions", default=1500))
    conv = mels * ah * 3 + ah + ah * ah * 3 + ah  # two 1-D convolutions (kernel 3)
    params = layers * _vit_block(ah, ai) + conv + source * ah + 2 * ah + ah * lm_hidden + lm_hidden
    towers.append(TowerInfo(kind="audio", modalities=["audio"], hidden_size=ah, intermediate_size=ai,
                            num_layers=layers, params=params, replicated=replicated))
    tokens, pos, how = mm.whisper_audio(pre)
    raw["audio"] = ("audio", tokens, tokens + mm.AUDIO_WRAPPER_TOKENS, pos,
                    "limit_mm_per_prompt (an audio item is at most one 30 s clip)", how)
    defaults["audio"] = 1


def towers_and_items(cfg: Any, text: Any, model_type: str, lm_hidden: int, folder: str,
                     vllm_kwargs: dict[str, Any], notes: list[str],
                     override: dict[str, int] | None = None,
                     override_from: str = "") -> tuple[list[TowerInfo], dict[str, MmItem]]:
    """The model's towers and the worst-case item of every modality it supports (see multimodal.py).

    ``override`` (a family's ``mm_max_tokens_per_item``) replaces the token figure of the
    modalities it names and adds the ones the towers do not serve.
    """
    mm_kwargs = vllm_kwargs.get("mm_processor_kwargs") or {}
    if not isinstance(mm_kwargs, dict):
        mm_kwargs = {}
    replicated = vllm_kwargs.get("mm_encoder_tp_mode") == "data"
    pre = read_json(folder, "preprocessor_config.json")
    towers: list[TowerInfo] = []
    raw: _Raw = {}
    defaults: dict[str, int] = {}

    vc = get(cfg, "vision_config")
    if vc is not None and vc is not text:
        vtype = str(get(vc, "model_type", default=""))
        if vtype in _UNMODELLED_TOWERS:
            _unknown_tower("vision", vtype, vllm_kwargs, override, "image")
        elif vtype == "gemma4_vision" and get(vc, "default_output_length") is None:
            # gemma4_mm.py reads vision_config.default_output_length for the tokens of an image
            _unknown_tower("vision", "gemma4_vision without vision_config.default_output_length", vllm_kwargs,
                           override, "image")
        elif vtype == "gemma4_vision":
            _gemma4_vision(cfg, vc, lm_hidden, mm_kwargs, towers, raw, defaults)
        elif vtype == "llama4_vision_model":
            _llama4_vision(cfg, vc, lm_hidden, pre, mm_kwargs, replicated, towers, raw, defaults)
        elif vtype.startswith(("qwen2_5_vl", "qwen2_vl")) or model_type in ("qwen2_vl", "qwen2_5_vl"):
            _qwen_vl(cfg, vc, model_type, lm_hidden, pre, mm_kwargs, replicated, notes, towers, raw, defaults)
        elif not _vit(cfg, vc, model_type, lm_hidden, pre, mm_kwargs, replicated, notes, towers, raw, defaults):
            _unknown_tower("vision", vtype, vllm_kwargs, override, "image")
    ac = get(cfg, "audio_config")
    if ac is not None:
        atype = str(get(ac, "model_type", default=""))
        if get(ac, "d_model", "hidden_size") is None or atype in _UNMODELLED_TOWERS:
            _unknown_tower("audio", atype, vllm_kwargs, override, "audio")
        else:
            _audio(ac, lm_hidden, pre, replicated, towers, raw, defaults)

    if override:
        for modality, tokens in override.items():
            old = raw.get(modality)
            scale = old[3] / max(1, old[1]) if old else 1.0
            raw[modality] = (old[0] if old else "hook", tokens, tokens, max(1, int(tokens * scale)),
                             old[4] if old else "limit_mm_per_prompt", f"from {override_from}")
            if modality in ("image", "audio"):
                defaults.setdefault(modality, 1)
    limits = mm.resolve_limits(sorted(raw), defaults, vllm_kwargs)
    for tower in towers:
        tower.loaded = any(limits.get(m, 0) > 0 for m in tower.modalities)
    items = {m: mm.MmItem(modality=m, tower=t, tokens=tok, prompt_tokens=prompt, encoder_positions=pos,
                          limit=limits[m], knob=knob, how=how)
             for m, (t, tok, prompt, pos, knob, how) in raw.items()}
    for m, item in items.items():
        if item.limit and item.tokens >= 4096:
            notes.append(f"{m}: up to {item.tokens} tokens per item ({item.how}); the encoder budget and "
                         f"max_num_batched_tokens follow it; turn {item.knob} to shrink it")
    return towers, items


def _unknown_tower(kind: str, vtype: str, vllm_kwargs: dict[str, Any], override: dict[str, int] | None,
                   modality: str) -> None:
    """A tower whose config the planner cannot size: fine when its modality is off (vLLM then does not load it)."""
    limits = vllm_kwargs.get("limit_mm_per_prompt") or {}
    if isinstance(limits, dict) and mm.limit_count(limits.get(modality, 1)) == 0:
        return
    raise PlanningError(
        f"the {kind} tower ({vtype or 'unknown type'}) of this model is not modelled by the planner: neither its "
        f"weights nor its tokens per {modality} are known. Serve text only with vllm_kwargs "
        f"limit_mm_per_prompt={{'{modality}': 0}} (vLLM then does not load the tower)"
        + ("" if override else ", or supply mm_max_tokens_per_item with vllm_kwargs['hive_attention_cls']"), 422)
