"""What the planner must know about a model, read from its Hugging Face config only.

No weights are read and nothing is downloaded: ``load_profile`` opens ``config.json`` of a
local folder (or of a Hugging Face name already in the local cache) with
``transformers.AutoConfig`` and derives, the way vLLM 0.32 does (see
``/work/shared/research/vllm-memory-and-api.md`` §A2/§A4):

* the dtype vLLM will run (``dtype="auto"``: bf16/fp16 stay, fp32 checkpoints are downcast
  to fp16 for pooling models and to bf16 otherwise) and the bytes per element;
* the parameter count and weight bytes from the architecture: embeddings, attention (GQA
  and MLA projections), dense MLP, every MoE expert, Mamba-2 / gated-delta-net mixers,
  vision/audio towers; tied embeddings counted once; quantized linears at their packed
  size (fp8, GPTQ/AWQ int4 + group scales, bitsandbytes, compressed-tensors, mxfp4;
  ``QuantScheme.vllm_supported`` says whether vLLM 0.32 still loads the method — it has
  no bitsandbytes);
* the KV cache layout per layer (``AttentionGroup``/``StateGroup``), from which
  ``kv_bytes_per_token`` and the exact per-request memory of vLLM's block pool follow
  (cross-checked against vLLM's own spec code by tests/engine/test_kv_crosscheck.py);
* the multimodal towers and the worst-case placeholder tokens of one item per modality,
  with ``limit_mm_per_prompt`` defaults (``multimodal.py``).

The hook for architectures the profiles do not know: ``vllm_kwargs["hive_attention_cls"] =
"pkg.module.Class"``. The class is built as ``Class(profile)`` and provides one or both of

* ``kv_bytes_per_token(tensor_parallel_size: int) -> int``: KV bytes per token on one rank,
  all layers (optionally ``kv_bytes_per_sequence(max_model_len, tensor_parallel_size,
  block_size) -> int`` for layouts that are not linear in the length);
* ``mm_max_tokens_per_item(mm_processor_kwargs: dict) -> dict[str, int]``: worst-case
  placeholder tokens of one item per modality, like vLLM's
  ``ProcessingInfo.get_mm_max_tokens_per_item``; image/audio default to one item per prompt.

An unknown architecture without a hook is planned generically when its config has the usual
fields, and refused (422, naming the missing fields) when it does not. Every ``hive_*`` key
is the hive's, never vLLM's: the planner strips them from the engine kwargs.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from fnmatch import fnmatch
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from hive_apps.planning import multimodal as mm
from hive_apps.planning.multimodal import MmItem, TowerInfo
from hive_apps.planning.types import PlanningError, ProfileSummary

# ---------------------------------------------------------------------------------------
# small helpers


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    """First non-None attribute (or dict key) among ``names``; configs name things variously."""
    for name in names:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32",
}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


# KV cache element sizes by vLLM ``kv_cache_dtype`` (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE;
# fp8 variants are stored as uint8). MLA-specific packed formats have a fixed size per token.
_KV_DTYPE_BYTES: dict[str, float] = {
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1, "uint8": 1,
    "int8_per_token_head": 1, "fp8_per_token_head": 1,
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
}
_MLA_PACKED_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}  # research note §A2

# Model types whose vLLM implementation uses MLA when ``kv_lora_rank`` is set
# (vllm/transformers_utils/model_arch_config_convertor.py::is_deepseek_mla, abridged).
_MLA_MODEL_TYPES = {
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "kimi_k2", "kimi_linear",
    "glm4_moe_lite", "longcat_flash", "pangu_ultra_moe", "bailing_hybrid",
}
# Bidirectional encoders: vLLM gives them EncoderOnlyAttentionSpec, i.e. no KV cache at all.
_ENCODER_ONLY_TYPES = {
    "bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert", "distilbert", "electra",
    "new", "gte", "deberta", "deberta-v2", "camembert",
}
# Q/K RMSNorm per head (Qwen3 family, Gemma 3, OLMo 2): two vectors of head_dim per layer.
_QK_NORM_TYPES = {"qwen3", "qwen3_moe", "qwen3_next", "gemma3", "gemma3_text", "olmo2", "olmoe"}
# Qwen2 family: q/k/v projections carry a bias even though the config has no attention_bias.
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text"}
# Four norms per layer (pre/post attention and pre/post MLP).
_FOUR_NORM_TYPES = {"gemma2", "gemma3", "gemma3_text"}
# Decoders whose MLP is not gated (two matrices, not three).
_UNGATED_MLP_TYPES = {
    "gpt2", "gpt_neox", "gptj", "opt", "falcon", "phi", "starcoder2", "gpt_bigcode",
    "bloom", "mpt", "nemotron", "nemotron_h",
}
_POOLING_SUFFIXES = (
    "Model", "ForSequenceClassification", "ForTokenClassification", "ForMaskedLM",
    "ForRewardModel", "ForEmbedding",
)
_GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


# ---------------------------------------------------------------------------------------
# public models


class AttentionGroup(BaseModel):
    """Identical attention layers: each stores K and V (or one MLA latent) per token."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["full", "sliding"]
    num_layers: int
    num_kv_heads: int  # total over all ranks (MLA: 1)
    head_size: int  # K width per head (MLA: kv_lora_rank + qk_rope_head_dim)
    head_size_v: int  # V width per head (MLA: 0, the latent is shared)
    replicated: bool = False  # MLA: every TP rank holds the whole latent (max_tp_shards=1)
    sliding_window: int | None = None
    fixed_bytes_per_token: int | None = None  # packed formats (fp8_ds_mla: 656 B)

    def heads_per_rank(self, tp: int) -> int:
        # vLLM replicates KV heads when tp > kv heads, so every rank holds at least one.
        return self.num_kv_heads if self.replicated else max(1, self.num_kv_heads // tp)

    def bytes_per_token_per_layer(self, tp: int, elem_bytes: float) -> int:
        if self.fixed_bytes_per_token is not None:
            return self.fixed_bytes_per_token
        return int(self.heads_per_rank(tp) * (self.head_size + self.head_size_v) * elem_bytes)


class StateGroup(BaseModel):
    """Identical recurrent layers (Mamba-2, gated delta net): a fixed state per request."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["mamba2", "gdn"]
    num_layers: int
    conv_channels: int  # mamba2: d_inner (without groups); gdn: 2*key_dim + value_dim
    conv_len: int  # conv kernel - 1
    n_groups: int = 0  # mamba2 B/C groups (extended when they do not divide TP)
    state_size: int = 0  # mamba2 ssm_state_size
    heads: int  # mamba2 heads / gdn value heads
    head_dim: int  # mamba2 head_dim / gdn value head dim
    state_dim: int  # mamba2 ssm_state_size / gdn key head dim
    conv_bytes: int
    ssm_bytes: int

    def bytes_per_layer(self, tp: int) -> int:
        """Bytes of one layer's state on one rank (vllm mamba_utils.MambaStateShapeCalculator)."""
        if self.kind == "mamba2":
            groups = self.n_groups if self.n_groups % tp == 0 else self.n_groups + (tp - self.n_groups)
            conv_dim = self.conv_channels + 2 * groups * self.state_size
        else:
            conv_dim = self.conv_channels
        conv = (conv_dim // tp) * self.conv_len * self.conv_bytes
        ssm = (self.heads // tp) * self.head_dim * self.state_dim * self.ssm_bytes
        return conv + ssm


class ParamCounts(BaseModel):
    """Parameters by role; roles differ in quantization and in how TP shards them."""

    embed: int = 0
    lm_head: int = 0
    attention: int = 0  # attention projections
    mlp: int = 0  # dense MLPs and shared experts
    experts: int = 0  # routed experts (all of them)
    mixer: int = 0  # Mamba-2 / gated-delta-net projections
    small: int = 0  # norms, biases, routers, positions: kept in 16 bits and replicated
    towers: int = 0  # vision/audio encoders and projectors

    @property
    def total(self) -> int:
        return (self.embed + self.lm_head + self.attention + self.mlp + self.experts
                + self.mixer + self.small + self.towers)


class QuantScheme(BaseModel):
    """How quantized linears are stored: bytes per parameter and which roles it covers."""

    method: str
    weight_format: str  # e.g. "fp8 block 128x128", "gptq int4 g128"
    bytes_per_param: float
    quantized_roles: list[str]  # subset of attention, mlp, experts, mixer
    fp8_weights: bool = False
    weight_only: bool = True  # activations stay 16-bit

    @property
    def vllm_supported(self) -> bool:
        """Whether vLLM 0.32 has this quantization method (bitsandbytes is gone from it)."""
        return self.method in VLLM_QUANTIZATION_METHODS


# vllm/model_executor/layers/quantization/__init__.py::QuantizationMethods in vLLM 0.32 (no bitsandbytes:
# ModelConfig answers "Unknown quantization method: bitsandbytes").
VLLM_QUANTIZATION_METHODS = frozenset({
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
    "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only",
    "nvfp4_per_token", "mxfp8",
})


class ModelProfile(BaseModel):
    """The planner's view of one model under the given vLLM kwargs."""

    model_config = ConfigDict(protected_namespaces=(), arbitrary_types_allowed=True)

    model: str  # what the user asked for
    path: str  # local folder the engine loads ("" for a bare config dict)
    architecture: str
    model_type: str
    runner: Literal["generate", "pooling"]
    dtype: str  # what vLLM runs: bfloat16 | float16 | float32
    dtype_bytes: int
    checkpoint_dtype: str | None = None
    quant: QuantScheme | None = None
    kv_cache_dtype: str = "auto"
    kv_elem_bytes: float = 2
    fp8_kv: bool = False

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False

    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0
    expert_matrices: int = 3
    is_mla: bool = False
    encoder_only: bool = False
    mla_q_width: int = 0  # per-head q width at prefill (qk_nope + qk_rope), MLA only
    mla_v_head_dim: int = 0

    params: ParamCounts
    num_params: int
    weight_bytes: int
    active_params: int  # parameters touched per token (MoE: top-k experts only)
    attention_groups: list[AttentionGroup] = Field(default_factory=list)
    state_groups: list[StateGroup] = Field(default_factory=list)
    towers: list[TowerInfo] = Field(default_factory=list)  # vision / audio encoders (loaded or not)
    mm_items: dict[str, MmItem] = Field(default_factory=dict)  # worst-case item per supported modality
    checkpoint_bytes: int | None = None  # sum of safetensors tensors on disk, when readable
    attention_cls: str | None = None
    notes: list[str] = Field(default_factory=list)

    _weights_by_role: dict[str, float] = PrivateAttr(default_factory=dict)
    _per_rank_cache: dict[tuple[str, int], int] = PrivateAttr(default_factory=dict)
    _attention_hook: Any = PrivateAttr(default=None)

    # ---- derived figures -------------------------------------------------------------

    @property
    def is_multimodal(self) -> bool:
        return bool(self.mm_items)

    @property
    def mm_active(self) -> dict[str, MmItem]:
        """Modalities a prompt may carry (limit > 0); their towers are loaded."""
        return {m: item for m, item in self.mm_items.items() if item.limit > 0}

    @property
    def mm_prompt_tokens(self) -> int:
        """Worst-case prompt tokens all multimodal items of one prompt add (limit x tokens per item)."""
        return sum(item.limit * item.prompt_tokens for item in self.mm_active.values())

    @property
    def mm_largest_item(self) -> MmItem | None:
        """The item vLLM profiles the encoder with (most tokens; ties broken by modality name, as vLLM)."""
        active = self.mm_active
        if not active:
            return None
        return max(active.values(), key=lambda item: (item.tokens, item.modality))

    def mm_limits(self, vllm_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """``limit_mm_per_prompt`` to pass to vLLM: the user's entries untouched, defaults for the rest."""
        return mm.engine_limits(self.mm_items, vllm_kwargs or {})

    def tower(self, kind: str) -> TowerInfo | None:
        return next((t for t in self.towers if t.kind == kind and t.loaded), None)

    @property
    def needs_fp8_hardware(self) -> bool:
        return bool(self.fp8_kv or (self.quant and self.quant.fp8_weights))

    @property
    def activation_bytes(self) -> int:
        """Activations stay in the compute dtype unless weights and activations are fp8 (W8A8)."""
        return self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token costs on one rank, summed over all attention layers.

        GQA/MHA: 2 x max(1, kv_heads // tp) x head_dim x bytes per layer; MLA: one latent of
        (kv_lora_rank + qk_rope_head_dim) x bytes, not divided by TP; sliding-window layers
        cost the same per token (their per-request total is what is bounded); encoder-only
        models and recurrent state layers: 0 (the state is per request, see
        ``kv_bytes_per_sequence``).
        """
        key = ("kv", tp)
        if key not in self._per_rank_cache:
            if self._kv_hook is not None:
                value = int(self._kv_hook.kv_bytes_per_token(tp))
            else:
                value = sum(g.num_layers * g.bytes_per_token_per_layer(tp, self.kv_elem_bytes)
                            for g in self.attention_groups)
            self._per_rank_cache[key] = value
        return self._per_rank_cache[key]

    @property
    def _kv_hook(self) -> Any:
        hook = self._attention_hook
        return hook if hook is not None and callable(getattr(hook, "kv_bytes_per_token", None)) else None

    def state_bytes_per_sequence(self, tp: int = 1) -> int:
        """Bytes of every recurrent layer's state for one request on one rank (vLLM MambaSpec pages, unpadded)."""
        return sum(g.num_layers * g.bytes_per_layer(tp) for g in self.state_groups)

    def role_bytes(self, role: str) -> float:
        """Weight bytes of one role (embed, lm_head, attention, mlp, experts, mixer, small, towers)."""
        return self._weights_by_role.get(role, 0.0)

    def weight_bytes_per_rank(self, tp: int = 1) -> int:
        """Weights one rank holds: sharded roles / tp (vocab padded to 64 per shard) + replicated ones."""
        key = ("weights", tp)
        if key not in self._per_rank_cache:
            self._per_rank_cache[key] = self._weight_bytes_per_rank(tp)
        return self._per_rank_cache[key]

    def _weight_bytes_per_rank(self, tp: int) -> int:
        w = self._weights_by_role
        vocab_rows = _cdiv(_round_up(self.vocab_size, 64), tp)
        embed_frac = vocab_rows / max(1, self.vocab_size)
        sharded = (w.get("attention", 0) + w.get("mlp", 0) + w.get("experts", 0) + w.get("mixer", 0)) / tp
        sharded += (w.get("embed", 0) + w.get("lm_head", 0)) * embed_frac
        towers = w.get("towers", 0)
        if not any(t.replicated for t in self.towers):
            towers /= tp
        return int(sharded + towers + w.get("small", 0))

    def tp_problem(self, tp: int) -> str | None:
        """Why vLLM cannot shard this model over ``tp`` ranks, or None when it can."""
        if tp <= 1:
            return None
        if self.num_attention_heads % tp:
            return (f"tensor_parallel_size={tp} does not divide the {self.num_attention_heads} "
                    "attention heads")
        kv = self.num_kv_heads
        if not self.is_mla and kv and kv % tp and tp % kv:
            return f"tensor_parallel_size={tp} and the {kv} KV heads do not divide one another"
        return None

    def block_size(self, on_cpu: bool, override: int | None = None, tp: int = 1) -> int:
        """vLLM's KV block size: CUDA 16 (FlashMLA 64), CPU 128 (CPU MLA 16), raised for mamba hybrids.

        Hybrids (Platform._align_hybrid_block_size): the attention page must hold one layer's
        recurrent state, so ``block = align x cdiv(state, align x attention bytes per token)``
        with ``align`` the block size the backend starts from (16 on CUDA, 128 on CPU; at
        least 128 for MLA hybrids), all per rank at this TP size. A user block size is raised
        the same way (vLLM overrides it too).
        """
        if self.is_mla:
            base = 16 if on_cpu else 64
        else:
            base = 128 if on_cpu else 16
        if override:
            base = override
        if self.state_groups and self.attention_groups and self._kv_hook is None:
            per_token = self.attention_groups[0].bytes_per_token_per_layer(tp, self.kv_elem_bytes)
            state = max(g.bytes_per_layer(tp) for g in self.state_groups)
            align = max(base, 128) if self.is_mla else base
            if per_token:
                base = max(base, align * _cdiv(state, align * per_token))
        return base

    def kv_pool_need(self, max_model_len: int, tp: int, block_size: int, in_flight_tokens: int,
                     hybrid_manager: bool = True, prefix_caching: bool = True) -> tuple[int, int]:
        """(bytes one request of ``max_model_len`` tokens holds, bytes of one pool block).

        Mirrors vLLM 0.32's pool: layers of one kind form a bucket; buckets split into
        groups of equal layer count (the smallest bucket's, or the largest's when the
        counts are within 1.5x; padding layers are added); every group page is
        ``group_size x per-layer page``. A request holds, per group: full attention
        ``cdiv(L, block)`` blocks, sliding window ``cdiv(min(window-1+in_flight, L), block)+1``,
        a recurrent state one block, or with prefix caching (on by default for generative
        hybrids: mamba_cache_mode "align") ``2 + checkpoint`` blocks, where Mamba-2 mixers
        keep one prefill checkpoint block (MambaSpec.max_memory_usage_bytes,
        MambaMixer2.get_kv_cache_spec). The pool keeps one extra (null) block back.
        """
        if self._kv_hook is not None:
            hook = self._kv_hook
            if hasattr(hook, "kv_bytes_per_sequence"):
                per_seq = int(hook.kv_bytes_per_sequence(max_model_len, tp, block_size))
            else:
                per_seq = _cdiv(max_model_len, block_size) * block_size * self.kv_bytes_per_token(tp)
            return per_seq, block_size * self.kv_bytes_per_token(tp)

        buckets: list[tuple[int, int, int]] = []  # (layers, page bytes per layer, blocks per request)
        full_blocks = _cdiv(max_model_len, block_size)
        for g in self.attention_groups:
            page = block_size * g.bytes_per_token_per_layer(tp, self.kv_elem_bytes)
            if g.kind == "sliding" and g.sliding_window and hybrid_manager:
                tokens = min(g.sliding_window - 1 + in_flight_tokens, max_model_len)
                blocks = min(_cdiv(tokens, block_size) + 1, full_blocks + 1)
            else:
                blocks = full_blocks
            buckets.append((g.num_layers, page, blocks))
        attn_page = buckets[0][1] if buckets else 0
        for s in self.state_groups:
            page = max(s.bytes_per_layer(tp), attn_page)  # mamba pages padded to the attention page
            blocks = (2 + (1 if s.kind == "mamba2" else 0)) if prefix_caching else 1
            buckets.append((s.num_layers, page, blocks))
        buckets = [b for b in buckets if b[0] and b[1]]
        if not buckets:
            return 0, 0
        if len(buckets) == 1:
            layers, page, blocks = buckets[0]
            return layers * page * blocks, layers * page
        counts = [b[0] for b in buckets]
        group_size = min(counts)
        if max(counts) < 1.5 * min(counts):
            group_size = max(counts)
        per_request = 0
        block_bytes = 0
        for layers, page, blocks in buckets:
            n_groups = _cdiv(layers, group_size)
            per_request += n_groups * group_size * page * blocks
            block_bytes = max(block_bytes, group_size * page)
        return per_request, block_bytes

    def summary(self) -> ProfileSummary:
        return ProfileSummary(
            architecture=self.architecture, model_type=self.model_type, path=self.path,
            runner=self.runner, dtype=self.dtype, num_params=self.num_params,
            weight_bytes=self.weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token(1),
            max_position_embeddings=self.max_position_embeddings,
            mm_tokens_per_item={m: i.tokens for m, i in self.mm_items.items()},
            limit_mm_per_prompt={m: i.limit for m, i in self.mm_items.items()},
        )


# ---------------------------------------------------------------------------------------
# loading


def load_profile(model: str, vllm_kwargs: dict[str, Any] | None = None) -> ModelProfile:
    """Profile a local model folder, or a Hugging Face name already in the local cache (no network)."""
    vllm_kwargs = dict(vllm_kwargs or {})
    folder = _resolve_local_folder(model)
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise PlanningError(f"model {model!r}: cannot read {config_path}: {exc}", 422) from exc
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    except Exception:  # custom code or a model type transformers does not know: read the raw fields
        cfg = _generic_config(raw)
    return _build_or_422(cfg, raw, model=model, path=folder, vllm_kwargs=vllm_kwargs)


def _build_or_422(cfg: Any, raw: dict[str, Any], *, model: str, path: str,
                  vllm_kwargs: dict[str, Any]) -> ModelProfile:
    """A config whose shape the planner does not read (list-valued or per-layer fields, say) is a 422
    that says so, never a 500 and never a guess."""
    try:
        return _build_profile(cfg, raw, model=model, path=path, vllm_kwargs=vllm_kwargs)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
        raise PlanningError(
            f"model {model!r}: the planner cannot model this config.json (model_type "
            f"{raw.get('model_type')!r}, architectures {raw.get('architectures')}): {type(exc).__name__}: {exc}. "
            "Fields with per-layer lists or a layout it does not know yet are the usual cause; it does not guess "
            "a smaller reservation. Deploy a config with scalar per-model fields, or report the config", 422) from exc


def profile_from_config_dict(d: dict[str, Any], path: str = "",
                             vllm_kwargs: dict[str, Any] | None = None,
                             model: str | None = None) -> ModelProfile:
    """Profile a parsed ``config.json`` (side files such as hf_quant_config.json are read from ``path``)."""
    return _build_or_422(_config_from_dict(d), d, model=model or path or d.get("_name_or_path", ""),
                         path=path, vllm_kwargs=dict(vllm_kwargs or {}))


def _resolve_local_folder(model: str) -> str:
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


def _config_from_dict(d: dict[str, Any]) -> Any:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = d.get("model_type")
        if model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type].from_dict(dict(d))
    except Exception:
        pass
    return _generic_config(d)


def _generic_config(d: dict[str, Any]) -> Any:
    """A bare PretrainedConfig holding every raw key, for types transformers cannot build."""
    from transformers import PretrainedConfig

    cfg = PretrainedConfig()
    for key, value in d.items():
        try:
            setattr(cfg, key, value)
        except Exception:
            pass
    return cfg


def _read_json(folder: str, name: str) -> dict[str, Any] | None:
    if not folder or not os.path.isdir(folder):
        return None
    p = os.path.join(folder, name)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _checkpoint_bytes(folder: str) -> int | None:
    """Bytes of all tensors in the folder's safetensors files, from headers only."""
    if not folder or not os.path.isdir(folder):
        return None
    index = _read_json(folder, "model.safetensors.index.json")
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


# ---------------------------------------------------------------------------------------
# building


def _build_profile(cfg: Any, raw: dict[str, Any], *, model: str, path: str,
                   vllm_kwargs: dict[str, Any]) -> ModelProfile:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    architecture = (_get(cfg, "architectures") or [""])[0] or ""
    model_type = str(_get(cfg, "model_type", default="") or "")
    text_type = str(_get(text, "model_type", default=model_type) or model_type)

    hidden = _get(text, "hidden_size", "d_model", "n_embd", "model_dim")
    layers = _get(text, "num_hidden_layers", "num_layers", "n_layer", "n_layers")
    heads = _get(text, "num_attention_heads", "num_heads", "n_head", "n_heads")
    vocab = _get(text, "vocab_size", "padded_vocab_size")
    intermediate = _get(text, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size",
                        "moe_intermediate_size")
    missing = [name for name, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                                    ("num_attention_heads", heads), ("vocab_size", vocab),
                                    ("intermediate_size", intermediate)) if not v]
    if missing:
        raise PlanningError(
            f"cannot plan {architecture or model_type or 'this model'}: its config lacks "
            f"{', '.join(missing)} (also looked for the usual aliases); the hive cannot size "
            "the weights and activations without them. Add them to config.json; for an attention "
            "layout the hive does not know, a vllm_kwargs['hive_attention_cls'] hook then supplies "
            "the KV bytes per token and the multimodal tokens per item", 422,
        )
    hidden, layers, heads, vocab, intermediate = (int(hidden), int(layers), int(heads), int(vocab),
                                                  int(intermediate))

    notes: list[str] = []
    runner = _runner(architecture, vllm_kwargs)
    checkpoint_dtype = _checkpoint_dtype(cfg, text)
    dtype = _runtime_dtype(checkpoint_dtype, vllm_kwargs.get("dtype"), runner, notes)
    dtype_bytes = _DTYPE_BYTES.get(dtype, 2)

    quant_cfg = _quantization_config(cfg, text, path)
    quant = _quant_scheme(quant_cfg, vllm_kwargs.get("quantization"))

    kv_heads = int(_get(text, "num_key_value_heads", "num_kv_heads", "n_head_kv",
                        "multi_query_group_num", default=heads))
    head_dim = _get(text, "head_dim")
    if not head_dim or head_dim <= 0:
        head_dim = hidden // heads
    head_dim = int(head_dim)

    kv_cache_dtype = str(vllm_kwargs.get("kv_cache_dtype") or "auto").lower()
    if kv_cache_dtype == "auto" and quant_cfg and quant_cfg.get("quant_method", "").startswith("modelopt"):
        inner = quant_cfg.get("quantization", quant_cfg)
        algo = inner.get("kv_cache_quant_algo") or quant_cfg.get("kv_cache_quant_algo")
        if isinstance(algo, str) and "fp8" in algo.lower():
            kv_cache_dtype = "fp8"
            notes.append("checkpoint asks for an fp8 KV cache (ModelOpt kv_cache_quant_algo)")
    kv_elem = float(dtype_bytes) if kv_cache_dtype == "auto" else _KV_DTYPE_BYTES.get(kv_cache_dtype, dtype_bytes)
    fp8_kv = "fp8" in kv_cache_dtype

    is_causal = _get(text, "is_causal", default=True) is not False
    encoder_only = text_type in _ENCODER_ONLY_TYPES or model_type in _ENCODER_ONLY_TYPES or not is_causal
    is_mla = (text_type in _MLA_MODEL_TYPES or model_type in _MLA_MODEL_TYPES) and \
        _get(text, "kv_lora_rank") is not None and is_causal

    layout = _layer_layout(text, text_type, layers)
    counts, moe = _count_params(cfg, text, text_type, model_type, runner, layout,
                                hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                vocab=vocab, intermediate=intermediate, is_mla=is_mla,
                                encoder_only=encoder_only)

    towers, mm_items = _multimodal(cfg, text, model_type, hidden, path, vllm_kwargs, notes)
    counts.towers = sum(t.params for t in towers if t.loaded)

    weights_by_role = _weights_by_role(counts, quant, dtype_bytes)
    weight_bytes = int(sum(weights_by_role.values()))

    attention_groups, state_groups = ([], []) if encoder_only else _cache_groups(
        text, text_type, layout, kv_heads=kv_heads, head_dim=head_dim, is_mla=is_mla,
        kv_cache_dtype=kv_cache_dtype, dtype_bytes=dtype_bytes, vllm_kwargs=vllm_kwargs)

    top_k = int(_get(text, "num_experts_per_tok", "num_experts_per_token", "moe_topk", default=0) or 0)
    active = counts.total - counts.towers
    if moe["experts"] and counts.experts:
        active -= counts.experts - counts.experts * min(top_k or 1, moe["experts"]) // moe["experts"]

    profile = ModelProfile(
        model=model, path=path, architecture=architecture, model_type=model_type, runner=runner,
        dtype=dtype, dtype_bytes=dtype_bytes, checkpoint_dtype=checkpoint_dtype, quant=quant,
        kv_cache_dtype=kv_cache_dtype, kv_elem_bytes=kv_elem, fp8_kv=fp8_kv,
        hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        max_position_embeddings=_max_position(text, text_type),
        tie_word_embeddings=_tied(cfg, text),
        num_experts=moe["experts"], experts_per_token=top_k,
        moe_intermediate_size=moe["expert_size"], num_moe_layers=moe["layers"],
        expert_matrices=moe["matrices"], is_mla=is_mla, encoder_only=encoder_only,
        mla_q_width=int(_get(text, "qk_nope_head_dim", default=0)) + int(_get(text, "qk_rope_head_dim", default=0))
        if is_mla else 0,
        mla_v_head_dim=int(_get(text, "v_head_dim", default=0)) if is_mla else 0,
        params=counts, num_params=counts.total, weight_bytes=weight_bytes, active_params=max(1, active),
        attention_groups=attention_groups, state_groups=state_groups, towers=towers, mm_items=mm_items,
        checkpoint_bytes=_checkpoint_bytes(path), notes=notes,
    )
    profile._weights_by_role = weights_by_role
    hook = vllm_kwargs.get("hive_attention_cls")
    if hook:
        profile.attention_cls = str(hook)
        profile._attention_hook = _load_attention_hook(str(hook), profile)
        profile._per_rank_cache.clear()  # figures cached while the hook was being built
        _apply_mm_hook(profile, profile._attention_hook, vllm_kwargs)
        towers_params = sum(t.params for t in profile.towers if t.loaded)
        if towers_params != profile.params.towers:  # the hook's limits loaded or dropped a tower
            profile.params.towers = towers_params
            profile._weights_by_role = _weights_by_role(profile.params, quant, dtype_bytes)
            profile.weight_bytes = int(sum(profile._weights_by_role.values()))
            profile.num_params = profile.params.total
            profile._per_rank_cache.clear()
    return profile


def _load_attention_hook(dotted: str, profile: ModelProfile) -> Any:
    module_name, _, cls_name = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
        hook = cls(profile)
    except Exception as exc:
        raise PlanningError(
            f"hive_attention_cls {dotted!r} cannot be loaded: {type(exc).__name__}: {exc}; give "
            "an importable 'package.module.Class' whose Class(profile) has "
            "kv_bytes_per_token(tensor_parallel_size) -> int and/or "
            "mm_max_tokens_per_item(mm_processor_kwargs) -> dict", 422,
        ) from exc
    if not any(callable(getattr(hook, name, None)) for name in ("kv_bytes_per_token", "mm_max_tokens_per_item")):
        raise PlanningError(f"hive_attention_cls {dotted!r} has neither kv_bytes_per_token(tensor_parallel_size) "
                            "nor mm_max_tokens_per_item(mm_processor_kwargs)", 422)
    return hook


def _runner(architecture: str, vllm_kwargs: dict[str, Any]) -> Literal["generate", "pooling"]:
    """vLLM's runner="auto" resolution, abridged: *ForCausalLM generates, *Model pools."""
    requested = vllm_kwargs.get("runner")
    if requested in ("generate", "pooling"):
        return requested
    if vllm_kwargs.get("convert") in ("embed", "classify", "reward"):
        return "pooling"
    if architecture.endswith(_GENERATE_SUFFIXES):
        return "generate"
    if architecture.endswith(_POOLING_SUFFIXES):
        return "pooling"
    return "generate"


def _checkpoint_dtype(cfg: Any, text: Any) -> str | None:
    for c in (cfg, text, _get(cfg, "vision_config")):
        if c is None:
            continue
        name = _dtype_name(_get(c, "dtype", "torch_dtype"))
        if name:
            return name
    return None


def _runtime_dtype(checkpoint: str | None, requested: Any, runner: str, notes: list[str]) -> str:
    """vLLM ``dtype="auto"``: keep bf16/fp16; fp32 (or unknown) becomes fp16 for pooling models, else bf16."""
    req = _dtype_name(requested)
    if req and req != "auto":
        return req
    if checkpoint in ("bfloat16", "float16"):
        return checkpoint
    target = "float16" if runner == "pooling" else "bfloat16"
    notes.append(f"checkpoint dtype {checkpoint or 'unset (fp32)'} runs as {target} (vLLM dtype=auto downcast)")
    return target


def _tied(cfg: Any, text: Any) -> bool:
    for c in (cfg, text):
        v = getattr(c, "tie_word_embeddings", None)
        if v is not None:
            return bool(v)
    return False


def _max_position(text: Any, text_type: str) -> int | None:
    """vLLM's derived max_model_len: the smallest of the usual length keys."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
            "model_max_length", "max_target_positions", "max_sequence_length",
            "max_seq_length", "seq_len")
    values = [int(v) for k in keys if isinstance(v := getattr(text, k, None), (int, float)) and v > 0]
    if not values:
        return None
    best = min(values)
    if text_type in ("roberta", "xlm-roberta", "camembert"):
        best -= int(_get(text, "pad_token_id", default=1)) + 1  # RoBERTa positions start after padding_idx
    return best


# ---- quantization ---------------------------------------------------------------------


def _quantization_config(cfg: Any, text: Any, folder: str) -> dict[str, Any] | None:
    for c in (cfg, text):
        q = getattr(c, "quantization_config", None) or getattr(c, "compression_config", None)
        if q is not None:
            return dict(q) if isinstance(q, dict) else q.to_dict()
    side = _read_json(folder, "hf_quant_config.json")  # ModelOpt puts it here
    if side:
        side = dict(side)
        algo = (side.get("quantization") or {}).get("quant_algo", "")
        side["quant_method"] = "modelopt_fp4" if str(algo).upper() == "NVFP4" else "modelopt"
        return side
    legacy = _read_json(folder, "quantize_config.json")  # AutoGPTQ's own file
    if legacy and legacy.get("bits"):
        legacy = dict(legacy)
        legacy.setdefault("quant_method", "gptq")
        return legacy
    return None


def _patterns(q: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("modules_to_not_convert", "ignore", "llm_int8_skip_modules", "exclude_modules"):
        v = q.get(key)
        if v:
            out.extend(str(x) for x in v)
    inner = q.get("quantization")
    if isinstance(inner, dict) and inner.get("exclude_modules"):
        out.extend(str(x) for x in inner["exclude_modules"])
    return out


def _excluded(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif any(ch in p for ch in "*?["):
            if fnmatch(name, p) or fnmatch(name, p + ".*"):
                return True
        elif name == p or name.startswith(p + ".") or f".{p}." in f".{name}.":
            return True
    return False


# Representative module names (HF layout) to test a checkpoint's ignore lists against.
_ROLE_MODULES = {
    "attention": "model.layers.{i}.self_attn.q_proj",
    "mlp": "model.layers.{i}.mlp.gate_proj",
    "experts": "model.layers.{i}.mlp.experts.0.gate_proj",
    "mixer": "model.layers.{i}.mixer.in_proj",
}


def _quant_scheme(q: dict[str, Any] | None, online: Any) -> QuantScheme | None:
    """Bytes per parameter of quantized linears (research note §A4 table)."""
    if q is None:
        if online:
            method = str(online).lower()
            if "fp8" in method:
                return QuantScheme(method=method, weight_format="fp8 (online)", bytes_per_param=1.0,
                                   quantized_roles=list(_ROLE_MODULES), fp8_weights=True)
            if method == "bitsandbytes":
                return QuantScheme(method=method, weight_format="bitsandbytes nf4 (in-flight)",
                                   bytes_per_param=0.5 + 4 / 64, quantized_roles=list(_ROLE_MODULES))
        return None
    method = str(q.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    patterns = _patterns(q)
    roles = [r for r, n in _ROLE_MODULES.items() if not _excluded(n.format(i=1), patterns)]

    if method in ("fp8", "modelopt", "fbgemm_fp8", "ptpc_fp8"):
        block = q.get("weight_block_size")
        scale = 4 / (block[0] * block[1]) if block else 0.0  # one fp32 scale per block
        fmt = f"fp8 block {block[0]}x{block[1]}" if block else "fp8"
        return QuantScheme(method=method, weight_format=fmt, bytes_per_param=1 + scale,
                           quantized_roles=roles, fp8_weights=True,
                           weight_only=q.get("activation_scheme") is None and method != "modelopt")
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "marlin"):
        bits = int(q.get("bits") or q.get("w_bit") or 4)
        group = int(q.get("group_size") or q.get("q_group_size") or 128)
        per_group = (2 + bits / 8) / group if group > 0 else 0.0  # fp16 scale + packed zero per group
        return QuantScheme(method=method, weight_format=f"{method} int{bits} g{group}",
                           bytes_per_param=bits / 8 + per_group, quantized_roles=roles)
    if method == "bitsandbytes":
        if q.get("load_in_8bit") or q.get("_load_in_8bit"):
            return QuantScheme(method=method, weight_format="bitsandbytes int8", bytes_per_param=1.0,
                               quantized_roles=roles)
        double = q.get("bnb_4bit_use_double_quant")
        return QuantScheme(method=method, weight_format="bitsandbytes 4-bit",
                           bytes_per_param=0.5 + (1.0 / 64 if double else 4.0 / 64), quantized_roles=roles)
    if method == "mxfp4":
        return QuantScheme(method=method, weight_format="mxfp4", bytes_per_param=0.5 + 1 / 32,
                           quantized_roles=roles)
    if method == "modelopt_fp4":
        return QuantScheme(method=method, weight_format="nvfp4", bytes_per_param=0.5 + 1 / 16,
                           quantized_roles=roles)
    if method == "compressed-tensors":
        worst = 0.0
        fp8 = False
        weight_only = True
        fmt = "compressed-tensors"
        for group in (q.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits = int(w.get("num_bits") or 16)
            size = int(w.get("group_size") or 0)
            b = bits / 8 + (2 / size if size and w.get("strategy") == "group" else 0.0)
            if b > worst:
                worst = b
                fmt = f"compressed-tensors {w.get('type', 'int')}{bits}" + (f" g{size}" if size else "")
            fp8 = fp8 or (bits == 8 and w.get("type") == "float")
            weight_only = weight_only and not (group or {}).get("input_activations")
        if not worst:
            return None
        return QuantScheme(method=method, weight_format=fmt, bytes_per_param=worst, quantized_roles=roles,
                           fp8_weights=fp8, weight_only=weight_only)
    bits = q.get("bits") or q.get("weight_bits") or q.get("w_bit")
    if bits:
        return QuantScheme(method=method or "unknown", weight_format=f"{method} {bits}-bit",
                           bytes_per_param=int(bits) / 8, quantized_roles=roles)
    return None


def _weights_by_role(counts: ParamCounts, quant: QuantScheme | None, dtype_bytes: int) -> dict[str, float]:
    """Bytes per role: quantized roles at the scheme's size, everything else in the compute dtype."""
    out: dict[str, float] = {}
    for role in ("embed", "lm_head", "attention", "mlp", "experts", "mixer", "small", "towers"):
        n = getattr(counts, role)
        per = dtype_bytes
        if quant is not None and role in quant.quantized_roles:
            per = quant.bytes_per_param
        out[role] = n * per
    return out


# ---- architecture: layers and parameters ---------------------------------------------


class _Layer(BaseModel):
    mixer: Literal["attn", "sliding", "mamba2", "gdn", "none"]
    ffn: Literal["dense", "moe", "none"]


def _layer_layout(text: Any, text_type: str, n: int) -> list[_Layer]:
    """Per layer: its token mixer and its feed-forward kind."""
    if text_type == "nemotron_h":
        pattern = _get(text, "hybrid_override_pattern")
        kinds = {"M": ("mamba2", "none"), "-": ("none", "dense"), "*": ("attn", "none"), "E": ("none", "moe")}
        if isinstance(pattern, str) and len(pattern) == n:
            return [_Layer(mixer=kinds[c][0], ffn=kinds[c][1]) for c in pattern]
        names = {"linear_attention": "M", "mamba": "M", "mlp": "-", "full_attention": "*", "attention": "*", "moe": "E"}
        types = _get(text, "layer_types") or []
        return [_Layer(mixer=kinds[names.get(t, "*")][0], ffn=kinds[names.get(t, "*")][1]) for t in types]

    types = _get(text, "layer_types")
    if not (isinstance(types, list) and len(types) == n):
        types = ["full_attention"] * n
    mixers = []
    for t in types:
        if t == "sliding_attention" and _get(text, "sliding_window"):
            mixers.append("sliding")
        elif t == "linear_attention":
            mixers.append("gdn")
        elif t in ("mamba", "mamba2"):
            mixers.append("mamba2")
        else:
            mixers.append("attn")
    return [_Layer(mixer=m, ffn="moe" if _is_moe_layer(text, text_type, i) else "dense")
            for i, m in enumerate(mixers)]


def _num_experts(text: Any) -> int:
    v = _get(text, "num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts", default=0)
    return int(v[0] if isinstance(v, list) else v or 0)


def _is_moe_layer(text: Any, text_type: str, i: int) -> bool:
    if _num_experts(text) <= 0:
        return False
    if _get(text, "n_routed_experts") is not None:  # DeepSeek family
        first_dense = int(_get(text, "first_k_dense_replace", default=0))
        freq = int(_get(text, "moe_layer_freq", default=1) or 1)
        return i >= first_dense and i % freq == 0
    if _get(text, "decoder_sparse_step") is not None:  # Qwen MoE family
        step = int(_get(text, "decoder_sparse_step") or 1)
        return i not in (_get(text, "mlp_only_layers") or []) and (i + 1) % step == 0
    return True  # Mixtral, PhiMoE, gpt-oss: every layer


def _count_params(cfg: Any, text: Any, text_type: str, model_type: str, runner: str, layout: list[_Layer], *,
                  hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                  intermediate: int, is_mla: bool, encoder_only: bool) -> tuple[ParamCounts, dict[str, int]]:
    c = ParamCounts()
    h = hidden
    if text_type in _ENCODER_ONLY_TYPES:
        return _count_encoder(text, h, heads, vocab, intermediate), {"experts": 0, "expert_size": 0,
                                                                    "layers": 0, "matrices": 2}
    c.embed = vocab * h
    if runner == "generate" and not _tied(cfg, text):
        c.lm_head = vocab * h
    c.small += h  # final norm

    bias = bool(_get(text, "attention_bias", default=False))
    qkv_bias = bias or text_type in _QKV_BIAS_TYPES
    norms = 4 if text_type in _FOUR_NORM_TYPES else 2
    gated = text_type not in _UNGATED_MLP_TYPES
    mlp_bias = bool(_get(text, "mlp_bias", default=False))

    n_exp = _num_experts(text)
    expert_size = int(_get(text, "moe_intermediate_size", default=0) or intermediate)
    matrices = 2 if text_type == "nemotron_h" else 3
    moe_layers = 0

    for layer in layout:
        c.small += h if text_type == "nemotron_h" else norms * h
        if layer.mixer in ("attn", "sliding"):
            if is_mla:
                c.attention += _mla_params(text, h, heads)
                c.small += int(_get(text, "kv_lora_rank")) + int(_get(text, "q_lora_rank", default=0) or 0)
            else:
                q = heads * head_dim * (2 if text_type == "qwen3_next" else 1)  # Qwen3-Next gates attention output
                c.attention += h * q + 2 * h * kv_heads * head_dim + heads * head_dim * h
                if qkv_bias:
                    c.small += (heads + 2 * kv_heads) * head_dim
                if bias:
                    c.small += h
                if text_type in _QK_NORM_TYPES:
                    c.small += 2 * head_dim
                if text_type == "gpt_oss":
                    c.small += heads  # attention sinks
        elif layer.mixer == "mamba2":
            c.mixer += _mamba2_params(text, h)
        elif layer.mixer == "gdn":
            mixer, small = _gdn_params(text, h)
            c.mixer += mixer
            c.small += small
        if layer.ffn == "dense":
            c.mlp += (3 if gated else 2) * h * intermediate
            if mlp_bias:
                c.small += (2 if gated else 1) * intermediate + h
        elif layer.ffn == "moe":
            moe_layers += 1
            c.experts += n_exp * matrices * h * expert_size
            c.small += h * n_exp  # router
            if text_type == "gpt_oss":
                c.small += n_exp * (2 * expert_size + h) + n_exp  # expert and router biases
            if _get(text, "topk_method") == "noaux_tc" or text_type in ("deepseek_v3", "kimi_k2"):
                c.small += n_exp  # e_score_correction_bias
            shared = int(_get(text, "n_shared_experts", default=0) or 0)
            shared_size = int(_get(text, "shared_expert_intermediate_size",
                                   "moe_shared_expert_intermediate_size", default=0) or 0)
            if shared_size:
                c.mlp += matrices * h * shared_size * max(1, shared if text_type == "nemotron_h" else 1)
                if text_type in ("qwen2_moe", "qwen3_next"):
                    c.small += h  # shared_expert_gate
            elif shared:
                c.mlp += shared * matrices * h * expert_size
    return c, {"experts": n_exp if moe_layers else 0, "expert_size": expert_size if moe_layers else 0,
               "layers": moe_layers, "matrices": matrices}


def _count_encoder(text: Any, h: int, heads: int, vocab: int, inter: int) -> ParamCounts:
    """BERT-style encoder: embeddings (word, position, token type, LayerNorm), biased linears, pooler."""
    layers = int(_get(text, "num_hidden_layers"))
    positions = int(_get(text, "max_position_embeddings", default=512))
    types = int(_get(text, "type_vocab_size", default=2))
    c = ParamCounts()
    c.embed = vocab * h
    c.small = positions * h + types * h + 2 * h + (h * h + h)  # positions, token types, LN, pooler
    c.attention = layers * 4 * h * h
    c.mlp = layers * 2 * h * inter
    c.small += layers * (4 * h + inter + h + 4 * h)  # linear biases and two LayerNorms per layer
    return c


def _mla_params(text: Any, h: int, heads: int) -> int:
    kv_rank = int(_get(text, "kv_lora_rank"))
    q_rank = _get(text, "q_lora_rank")
    rope = int(_get(text, "qk_rope_head_dim"))
    nope = int(_get(text, "qk_nope_head_dim"))
    v = int(_get(text, "v_head_dim"))
    q = h * heads * (nope + rope) if not q_rank else h * q_rank + q_rank * heads * (nope + rope)
    kv = h * (kv_rank + rope) + kv_rank * heads * (nope + v)
    return q + kv + heads * v * h


def _mamba2_params(text: Any, h: int) -> int:
    nheads = int(_get(text, "mamba_num_heads", default=0))
    d_inner = nheads * int(_get(text, "mamba_head_dim", default=0)) or int(_get(text, "expand", default=2)) * h
    groups = int(_get(text, "n_groups", default=1))
    state = int(_get(text, "ssm_state_size", "state_size", default=128))
    kernel = int(_get(text, "conv_kernel", default=4))
    conv_dim = d_inner + 2 * groups * state
    in_proj = h * (d_inner + conv_dim + nheads)
    return in_proj + conv_dim * (kernel + 1) + 3 * nheads + d_inner + d_inner * h


def _gdn_params(text: Any, h: int) -> tuple[int, int]:
    nk = int(_get(text, "linear_num_key_heads"))
    nv = int(_get(text, "linear_num_value_heads"))
    dk = int(_get(text, "linear_key_head_dim"))
    dv = int(_get(text, "linear_value_head_dim"))
    kernel = int(_get(text, "linear_conv_kernel_dim", default=4))
    key_dim, value_dim = nk * dk, nv * dv
    mixer = h * (2 * key_dim + 2 * value_dim) + h * 2 * nv + value_dim * h
    small = (2 * key_dim + value_dim) * kernel + 2 * nv + dv
    return mixer, small


def _cache_groups(text: Any, text_type: str, layout: list[_Layer], *, kv_heads: int, head_dim: int,
                  is_mla: bool, kv_cache_dtype: str, dtype_bytes: int,
                  vllm_kwargs: dict[str, Any]) -> tuple[list[AttentionGroup], list[StateGroup]]:
    full = sum(1 for layer in layout if layer.mixer == "attn")
    sliding = sum(1 for layer in layout if layer.mixer == "sliding")
    groups: list[AttentionGroup] = []
    if is_mla:
        latent = int(_get(text, "kv_lora_rank")) + int(_get(text, "qk_rope_head_dim"))
        groups.append(AttentionGroup(kind="full", num_layers=full + sliding, num_kv_heads=1, head_size=latent,
                                     head_size_v=0, replicated=True,
                                     fixed_bytes_per_token=_MLA_PACKED_BYTES.get(kv_cache_dtype)))
    else:
        if full:
            groups.append(AttentionGroup(kind="full", num_layers=full, num_kv_heads=kv_heads,
                                         head_size=head_dim, head_size_v=head_dim))
        if sliding:
            groups.append(AttentionGroup(kind="sliding", num_layers=sliding, num_kv_heads=kv_heads,
                                         head_size=head_dim, head_size_v=head_dim,
                                         sliding_window=int(_get(text, "sliding_window"))))
    states: list[StateGroup] = []
    n_mamba = sum(1 for layer in layout if layer.mixer == "mamba2")
    n_gdn = sum(1 for layer in layout if layer.mixer == "gdn")
    conv_bytes = dtype_bytes
    ssm_name = vllm_kwargs.get("mamba_ssm_cache_dtype") or "auto"
    if ssm_name == "auto" and text_type == "nemotron_h":
        ssm_name = _get(text, "mamba_ssm_cache_dtype", default="float32")  # NemotronHForCausalLMConfig
    ssm_bytes = conv_bytes if ssm_name == "auto" else _DTYPE_BYTES.get(_dtype_name(ssm_name) or "", 4)
    if n_mamba:
        nheads = int(_get(text, "mamba_num_heads", default=0))
        hd = int(_get(text, "mamba_head_dim", default=0))
        state = int(_get(text, "ssm_state_size", "state_size", default=128))
        states.append(StateGroup(kind="mamba2", num_layers=n_mamba, conv_channels=nheads * hd,
                                 conv_len=int(_get(text, "conv_kernel", default=4)) - 1,
                                 n_groups=int(_get(text, "n_groups", default=1)), state_size=state,
                                 heads=nheads, head_dim=hd, state_dim=state,
                                 conv_bytes=conv_bytes, ssm_bytes=ssm_bytes))
    if n_gdn:
        nk, nv = int(_get(text, "linear_num_key_heads")), int(_get(text, "linear_num_value_heads"))
        dk, dv = int(_get(text, "linear_key_head_dim")), int(_get(text, "linear_value_head_dim"))
        states.append(StateGroup(kind="gdn", num_layers=n_gdn, conv_channels=2 * nk * dk + nv * dv,
                                 conv_len=int(_get(text, "linear_conv_kernel_dim", default=4)) - 1,
                                 heads=nv, head_dim=dv, state_dim=dk,
                                 conv_bytes=conv_bytes, ssm_bytes=ssm_bytes))
    return groups, states


# ---- multimodal towers ----------------------------------------------------------------


def _vit_block(vh: int, vi: int) -> int:
    """One pre-norm ViT/Whisper encoder block: q,k,v,o with biases, two-matrix MLP, two LayerNorms."""
    return 4 * vh * vh + 4 * vh + 2 * vh * vi + vi + vh + 4 * vh


def _multimodal(cfg: Any, text: Any, model_type: str, lm_hidden: int, folder: str,
                vllm_kwargs: dict[str, Any], notes: list[str]) -> tuple[list[TowerInfo], dict[str, MmItem]]:
    """The model's towers and the worst-case item of every modality it supports (see multimodal.py)."""
    mm_kwargs = vllm_kwargs.get("mm_processor_kwargs") or {}
    if not isinstance(mm_kwargs, dict):
        mm_kwargs = {}
    replicated = vllm_kwargs.get("mm_encoder_tp_mode") == "data"
    pre = _read_json(folder, "preprocessor_config.json")
    towers: list[TowerInfo] = []
    # modality -> (tower kind, tokens, prompt tokens, tower positions, knob, how)
    raw: dict[str, tuple[str, int, int, int, str, str]] = {}
    defaults: dict[str, int] = {}

    vc = _get(cfg, "vision_config")
    if vc is not None and vc is not text:
        vtype = str(_get(vc, "model_type", default=""))
        if vtype.startswith(("qwen2_5_vl", "qwen2_vl")) or model_type in ("qwen2_vl", "qwen2_5_vl"):
            vh = int(_get(vc, "hidden_size", "embed_dim"))
            depth = int(_get(vc, "depth", "num_hidden_layers"))
            gated = model_type == "qwen2_5_vl" or vtype.startswith("qwen2_5")
            vi = int(_get(vc, "intermediate_size", default=0) or vh * int(_get(vc, "mlp_ratio", default=4)))
            patch = int(_get(vc, "patch_size", "spatial_patch_size", default=14))
            temporal = int(_get(vc, "temporal_patch_size", default=2))
            merge = int(_get(vc, "spatial_merge_size", default=2))
            out = int(_get(vc, "out_hidden_size", default=lm_hidden))
            mlp = 3 * vh * vi + 2 * vi + vh if gated else 2 * vh * vi + vi + vh
            block = 3 * vh * vh + 3 * vh + vh * vh + vh + mlp
            block += 2 * vh if gated else 4 * vh
            m = vh * merge * merge
            params = depth * block + 3 * temporal * patch * patch * vh + vh + (m * m + m + m * out + out)
            towers.append(TowerInfo(kind="vision", modalities=["image", "video"], hidden_size=vh,
                                    intermediate_size=vi, num_layers=depth, params=params, replicated=replicated))
            for modality, (tokens, positions, how) in mm.qwen_vl_items(vc, _get, pre, mm_kwargs, notes).items():
                scope = "images_kwargs" if modality == "image" else "videos_kwargs"
                raw[modality] = ("vision", tokens, tokens + mm.QWEN_VL_WRAPPER_TOKENS, positions,
                                 f"mm_processor_kwargs.max_pixels (or {scope}.max_pixels)", how)
            defaults["image"] = 1
        else:  # generic ViT (CLIP, SigLIP, ...) with a projector
            vh = int(_get(vc, "hidden_size", "vt_hidden_size", "embed_dim", "width", default=0))
            if vh:
                depth = int(_get(vc, "num_hidden_layers", "vt_num_hidden_layers", "depth", "num_layers", default=24))
                depth += int(_get(vc, "num_global_layers", default=0))
                vi = int(_get(vc, "intermediate_size", "vt_intermediate_size", default=4 * vh))
                patch = _get(vc, "patch_size", default=14)
                patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
                image = _get(vc, "image_size", default=0)
                image = int(image[0] if isinstance(image, (list, tuple)) else image or 0)
                channels = int(_get(vc, "num_channels", default=3))
                merge_kernel = _get(vc, "merge_kernel_size", default=None)
                merge = int(merge_kernel[0]) if isinstance(merge_kernel, (list, tuple)) else 1
                positions = (image // patch) ** 2 + 1 if image else 0
                embed = channels * patch * patch * vh + vh + positions * vh + 2 * vh
                if model_type in ("gemma3", "gemma3n"):
                    params = depth * _vit_block(vh, vi) + embed + vh * lm_hidden + vh  # + mm projection, norm
                    tokens, prompt, pos, how = mm.gemma3_image(cfg, vc, _get, pre, mm_kwargs)
                    knob = "mm_processor_kwargs.do_pan_and_scan / pan_and_scan_max_num_crops" if tokens > \
                        int(_get(cfg, "mm_tokens_per_image", default=256)) else "limit_mm_per_prompt"
                elif model_type.startswith("llava"):
                    feature = _get(cfg, "vision_feature_layer", default=-1)
                    layers = [feature] if isinstance(feature, int) else list(feature)
                    depth = max(depth + f + 1 if f < 0 else f for f in layers)  # llava._get_num_hidden_layers
                    params = depth * _vit_block(vh, vi) + embed
                    params += vh * lm_hidden + lm_hidden + lm_hidden * lm_hidden + lm_hidden  # 2-layer projector
                    tokens, pos, how = mm.llava_image(cfg, vc, _get)
                    prompt, knob = tokens, "limit_mm_per_prompt (a LLaVA image is always this size)"
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

    ac = _get(cfg, "audio_config")
    if ac is not None:
        ah = int(_get(ac, "d_model", "hidden_size", default=1280))
        layers = int(_get(ac, "encoder_layers", "num_hidden_layers", default=32))
        ai = int(_get(ac, "encoder_ffn_dim", "intermediate_size", default=4 * ah))
        mels = int(_get(ac, "num_mel_bins", default=128))
        source = int(_get(ac, "max_source_positions", default=1500))
        conv = mels * ah * 3 + ah + ah * ah * 3 + ah  # two 1-D convolutions (kernel 3)
        params = layers * _vit_block(ah, ai) + conv + source * ah + 2 * ah + ah * lm_hidden + lm_hidden
        towers.append(TowerInfo(kind="audio", modalities=["audio"], hidden_size=ah, intermediate_size=ai,
                                num_layers=layers, params=params, replicated=replicated))
        tokens, pos, how = mm.whisper_audio(pre)
        raw["audio"] = ("audio", tokens, tokens + mm.AUDIO_WRAPPER_TOKENS, pos,
                        "limit_mm_per_prompt (an audio item is at most one 30 s clip)", how)
        defaults["audio"] = 1

    limits = mm.resolve_limits(list(raw), defaults, vllm_kwargs)
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


def _apply_mm_hook(profile: ModelProfile, hook: Any, vllm_kwargs: dict[str, Any]) -> None:
    """A hook's ``mm_max_tokens_per_item(mm_processor_kwargs)`` replaces the per-item token math."""
    fn = getattr(hook, "mm_max_tokens_per_item", None)
    if not callable(fn):
        return
    try:
        figures = {str(k): int(v) for k, v in dict(fn(dict(vllm_kwargs.get("mm_processor_kwargs") or {}))).items()}
    except Exception as exc:
        raise PlanningError(f"hive_attention_cls {profile.attention_cls!r}: mm_max_tokens_per_item failed: "
                            f"{type(exc).__name__}: {exc}", 422) from exc
    defaults = {m: 1 for m in figures if m in ("image", "audio")}
    limits = mm.resolve_limits(sorted(set(figures) | set(profile.mm_items)), defaults, vllm_kwargs)
    items = dict(profile.mm_items)
    for modality, tokens in figures.items():
        old = items.get(modality)
        scale = old.encoder_positions / max(1, old.tokens) if old else 1.0
        items[modality] = mm.MmItem(
            modality=modality, tower=old.tower if old else "hook", tokens=tokens, prompt_tokens=tokens,
            encoder_positions=max(1, int(tokens * scale)), limit=limits[modality],
            knob=old.knob if old else "limit_mm_per_prompt", how=f"from {profile.attention_cls}")
    for modality, item in items.items():
        item.limit = limits.get(modality, item.limit)
    profile.mm_items = items
    for tower in profile.towers:
        tower.loaded = any(items[m].limit > 0 for m in tower.modalities if m in items)


__all__ = [
    "AttentionGroup", "ModelProfile", "ParamCounts", "QuantScheme", "StateGroup", "TowerInfo", "MmItem",
    "load_profile", "profile_from_config_dict",
]
