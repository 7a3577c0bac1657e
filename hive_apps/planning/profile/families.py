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
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from hive_apps.planning.profile import fields
from hive_apps.planning.profile.fields import Unmodelled
from hive_apps.planning.profile.model import AttentionGroup, ParamCounts, StateGroup
from hive_apps.planning.profile.quant import MLA_PACKED_BYTES, ssm_bytes
from hive_apps.planning.types import PlanningError

# Model types vLLM 0.32 runs with MLA when ``kv_lora_rank`` is set
# (model_arch_config_convertor.py::is_deepseek_mla, the full list).
VLLM_MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note",
    "deepseek_mtp", "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite",
    "glm4_moe_lite_mtp", "kimi_k2", "kimi_linear", "longcat_flash", "pangu_ultra_moe", "pangu_ultra_moe_mtp",
    "bailing_hybrid", "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp",
})

# Config keys that change the KV cache in ways the generic family does not model. Each family
# that models one removes it from ``handles``; any other present key is refused.
KV_SHAPING_KEYS = {
    "kv_lora_rank": "an MLA-shaped attention (kv_lora_rank)",
    "index_topk": "a sparse-attention indexer (index_topk), which keeps a second per-layer cache",
    "block_configs": "per-block configs (block_configs)",
    "hybrid_override_pattern": "a hybrid layer pattern (hybrid_override_pattern)",
    "layers_block_type": "a hybrid layer list (layers_block_type)",
    "attn_layer_indices": "a hybrid layer list (attn_layer_indices)",
    "attn_type_list": "a hybrid layer list (attn_type_list)",
    "num_kv_shared_layers": "layers that share another layer's KV cache (num_kv_shared_layers)",
    "cross_attention_layers": "cross-attention layers (cross_attention_layers)",
    "compress_ratios": "compressed sparse attention (compress_ratios)",
    "global_head_dim": "a second head size for global layers (global_head_dim)",
    "num_global_key_value_heads": "a second KV head count for global layers (num_global_key_value_heads)",
    "v_head_dim": "a V head size of its own (v_head_dim)",
}


@dataclass
class Ctx:
    """What the builder resolved before the family reads the layers."""

    model: str
    path: str
    architecture: str
    model_type: str
    text_type: str
    vllm_kwargs: dict[str, Any]
    runner: str
    dtype_bytes: int
    kv_cache_dtype: str
    kv_elem_bytes: float
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Layer:
    """One decoder layer as vLLM builds it."""

    mixer: str  # "attn" | "sliding" | "mla" | "mamba2" | "gdn" | "none"
    ffn: str  # "dense" | "moe" | "none"
    kv_heads: int = 0  # total KV heads of this layer's cache
    head_size: int = 0
    head_size_v: int = 0
    window: int | None = None
    intermediate: int = 0  # width of this layer's dense MLP
    kv_shared: bool = False  # reads another layer's cache and keeps none of its own
    indexer_bytes: int = 0  # a sparse-MLA indexer cache on this layer: bytes per token


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    vocab: int
    intermediate: int


@dataclass
class MoeInfo:
    experts: int = 0
    expert_size: int = 0
    layers: int = 0
    matrices: int = 3


class Family:
    """The generic decoder (vLLM's ``ModelArchConfigConvertorBase`` + Llama-like model code)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()  # matched when the model type is not listed anywhere
    handles: ClassVar[frozenset[str]] = frozenset()  # KV_SHAPING_KEYS this family models
    per_layer_fields: ClassVar[frozenset[str]] = frozenset()  # fields its vLLM code reads per layer
    layer_kinds: ClassVar[dict[str, str]] = {"full_attention": "attn", "attention": "attn",
                                            "sliding_attention": "sliding"}
    qkv_bias: ClassVar[bool] = False  # q/k/v biases even without attention_bias (Qwen2)
    qk_norm: ClassVar[bool] = False  # a q and a k RMSNorm of head_size per layer
    norms_per_layer: ClassVar[int] = 2
    gated_mlp: ClassVar[bool] = True
    expert_matrices: ClassVar[int] = 3

    def __init__(self, cfg: Any, text: Any, ctx: Ctx) -> None:
        self.cfg = cfg
        self.text = text
        self.ctx = ctx

    # ---- reading the config ----------------------------------------------------------

    def get(self, *names: str, default: Any = None) -> Any:
        return fields.get(self.text, *names, default=default)

    def num(self, *names: str, default: Any = None) -> Any:
        return fields.num(self.text, *names, default=default)

    def check(self) -> None:
        """Refuse config features that change the KV cache and that this family does not model."""
        for key, what in KV_SHAPING_KEYS.items():
            if key in self.handles:
                continue
            value = self._raw(key)
            if value is None or value is False or value == 0 or value == [] or value == {}:
                continue
            if key == "v_head_dim" and not isinstance(value, list) and value == self.head_dim(self.text):
                continue
            raise Unmodelled(f"{what} in a {self.ctx.architecture or self.ctx.model_type} config",
                             self._hook_hint())
        if fields.get(self.text, "is_encoder_decoder", default=False) and not self.encoder_only():
            raise Unmodelled("an encoder-decoder model (cross-attention caches)", self._hook_hint())
        if fields.is_heterogeneous(self.text):
            unread = sorted(fields.per_layer_attributes(self.text) - self.per_layer_fields)
            if unread:
                raise Unmodelled(f"per-layer values of {', '.join(unread)} (per_layer_config), which vLLM's "
                                 f"code for {self.ctx.architecture} reads as one number", self._hook_hint())

    def _raw(self, key: str) -> Any:
        try:
            return fields.get(self.text, key)
        except Unmodelled:
            return "per-layer"

    def _hook_hint(self) -> str:
        return ("if vLLM runs this model, supply its layout with vllm_kwargs['hive_attention_cls'] (a class "
                "mixed into the planner's family, see README 'Planning hooks'), or report the config")

    @cached_property
    def dims(self) -> Dims:
        hidden = self.num("hidden_size", "d_model", "n_embd", "model_dim")
        layers = self.num("num_hidden_layers", "num_layers", "n_layer", "n_layers")
        heads = self.num("num_attention_heads", "num_heads", "n_head", "n_heads")
        vocab = self.num("vocab_size", "padded_vocab_size")
        intermediate = self.intermediate_size()
        missing = [name for name, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                                        ("num_attention_heads", heads), ("vocab_size", vocab),
                                        ("intermediate_size", intermediate)) if not v]
        if missing:
            raise PlanningError(
                f"cannot plan {self.ctx.architecture or self.ctx.model_type or 'this model'}: its config lacks "
                f"{', '.join(missing)} (also looked for the usual aliases); the hive cannot size "
                "the weights and activations without them. Add them to config.json; for an attention "
                "layout the hive does not know, a vllm_kwargs['hive_attention_cls'] hook then supplies "
                "the KV bytes per token and the multimodal tokens per item", 422,
            )
        return Dims(int(hidden), int(layers), int(heads), int(vocab), int(intermediate))

    def intermediate_size(self) -> int | None:
        return self.num("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "moe_intermediate_size")

    def kv_heads(self, lc: Any = None) -> int:
        """vLLM's ``get_total_num_kv_heads``: the usual aliases, else every attention head."""
        lc = self.text if lc is None else lc
        v = fields.num(lc, "n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                       "num_attention_groups")
        return int(v) if v else self.dims.heads

    def head_dim(self, lc: Any = None) -> int:
        """vLLM's ``get_head_size``: head_dim when positive, hidden_size_per_head, else hidden / heads."""
        lc = self.text if lc is None else lc
        v = fields.num(lc, "head_dim")
        if v and v > 0:
            return int(v)
        v = fields.num(lc, "hidden_size_per_head")
        if v:
            return int(v)
        return self.dims.hidden // self.dims.heads

    def is_causal(self) -> bool:
        return self.get("is_causal", default=True) is not False

    def encoder_only(self) -> bool:
        """Bidirectional layers: vLLM gives them EncoderOnlyAttentionSpec, i.e. no KV cache."""
        return not self.is_causal()

    def uses_mla(self) -> bool:
        return False

    def sliding_window(self, lc: Any = None) -> int | None:
        v = fields.num(self.text if lc is None else lc, "sliding_window")
        return int(v) if v else None

    def tied(self) -> bool:
        for c in (self.cfg, self.text):
            v = getattr(c, "tie_word_embeddings", None)
            if v is not None:
                return bool(v)
        return False

    def max_position(self) -> int | None:
        """vLLM's derived max_model_len: the smallest of the usual length keys."""
        keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")
        values = [int(v) for k in keys if isinstance(v := getattr(self.text, k, None), (int, float)) and v > 0]
        return min(values) if values else None

    # ---- the layers ------------------------------------------------------------------

    def layer_types(self, n: int) -> list[str]:
        types = self.get("layer_types")
        if isinstance(types, list) and len(types) == n:
            return [str(t) for t in types]
        return ["full_attention"] * n

    def mixer_of(self, layer_type: str, i: int) -> str:
        kind = self.layer_kinds.get(layer_type)
        if kind is None:
            raise Unmodelled(f"layer type {layer_type!r} (layer {i})", self._hook_hint())
        if kind == "sliding" and not self.sliding_window(self.layer_config(i)):
            return "attn"
        return kind

    def layer_config(self, i: int) -> Any:
        return fields.layer_config(self.text, i)

    def is_moe_layer(self, i: int) -> bool:
        if self.num_experts() <= 0:
            return False
        if self.get("n_routed_experts") is not None:  # DeepSeek family
            first_dense = int(self.num("first_k_dense_replace", default=0))
            freq = int(self.num("moe_layer_freq", default=1) or 1)
            return i >= first_dense and i % freq == 0
        if self.get("decoder_sparse_step") is not None:  # Qwen MoE family
            step = int(self.num("decoder_sparse_step") or 1)
            return i not in (self.get("mlp_only_layers") or []) and (i + 1) % step == 0
        return True  # Mixtral, PhiMoE, gpt-oss: every layer

    def num_experts(self) -> int:
        v = self.get("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts", default=0)
        return int(v[0] if isinstance(v, list) else v or 0)  # Ernie VL: a list of equal counts

    def layer_intermediate(self, lc: Any, i: int) -> int:
        return self.dims.intermediate

    def kv_shared(self, i: int) -> bool:
        return False

    def build_layer(self, i: int, layer_type: str) -> Layer:
        mixer = self.mixer_of(layer_type, i)
        lc = self.layer_config(i)
        ffn = "moe" if self.is_moe_layer(i) else "dense"
        if mixer in ("attn", "sliding"):
            hd = self.head_dim(lc)
            return Layer(mixer=mixer, ffn=ffn, kv_heads=self.kv_heads(lc), head_size=hd, head_size_v=hd,
                         window=self.sliding_window(lc) if mixer == "sliding" else None,
                         intermediate=self.layer_intermediate(lc, i), kv_shared=self.kv_shared(i))
        return Layer(mixer=mixer, ffn=ffn, intermediate=self.layer_intermediate(lc, i))

    @cached_property
    def layers(self) -> list[Layer]:
        n = self.dims.layers
        return [self.build_layer(i, t) for i, t in enumerate(self.layer_types(n))]

    # ---- caches ----------------------------------------------------------------------

    def attention_groups(self) -> list[AttentionGroup]:
        """Identical attention caches, full-attention groups first (the order vLLM's hybrid rules read)."""
        if self.encoder_only():
            return []
        counts: dict[tuple, int] = {}
        for layer in self.layers:
            if layer.kv_shared:
                continue
            for key in self.cache_keys(layer):
                counts[key] = counts.get(key, 0) + 1
        keys = sorted(counts, key=lambda k: (k[0] != "full", list(counts).index(k)))
        return [AttentionGroup(kind=k[0], num_layers=counts[k], num_kv_heads=k[1], head_size=k[2],
                               head_size_v=k[3], replicated=k[4], sliding_window=k[5],
                               fixed_bytes_per_token=k[6], role=k[7]) for k in keys]

    def cache_keys(self, layer: Layer) -> list[tuple]:
        """(kind, kv heads, head size, head size v, replicated, window, fixed bytes, role) per cache of a layer."""
        if layer.mixer == "attn":
            return [("full", layer.kv_heads, layer.head_size, layer.head_size_v, False, None, None, "kv")]
        if layer.mixer == "sliding":
            return [("sliding", layer.kv_heads, layer.head_size, layer.head_size_v, False, layer.window, None, "kv")]
        return []

    def state_groups(self) -> list[StateGroup]:
        states: list[StateGroup] = []
        n_mamba = sum(1 for layer in self.layers if layer.mixer == "mamba2")
        n_gdn = sum(1 for layer in self.layers if layer.mixer == "gdn")
        conv_bytes = self.ctx.dtype_bytes
        ssm = ssm_bytes(self.ssm_cache_dtype(), conv_bytes)
        if n_mamba:
            nheads = int(self.num("mamba_num_heads", default=0))
            hd = int(self.num("mamba_head_dim", default=0))
            state = int(self.num("ssm_state_size", "state_size", default=128))
            states.append(StateGroup(kind="mamba2", num_layers=n_mamba, conv_channels=nheads * hd,
                                     conv_len=int(self.num("conv_kernel", default=4)) - 1,
                                     n_groups=int(self.num("n_groups", default=1)), state_size=state,
                                     heads=nheads, head_dim=hd, state_dim=state,
                                     conv_bytes=conv_bytes, ssm_bytes=ssm))
        if n_gdn:
            nk, nv = int(self.num("linear_num_key_heads")), int(self.num("linear_num_value_heads"))
            dk, dv = int(self.num("linear_key_head_dim")), int(self.num("linear_value_head_dim"))
            states.append(StateGroup(kind="gdn", num_layers=n_gdn, conv_channels=2 * nk * dk + nv * dv,
                                     conv_len=int(self.num("linear_conv_kernel_dim", default=4)) - 1,
                                     heads=nv, head_dim=dv, state_dim=dk,
                                     conv_bytes=conv_bytes, ssm_bytes=ssm))
        return states

    def ssm_cache_dtype(self) -> Any:
        return self.ctx.vllm_kwargs.get("mamba_ssm_cache_dtype") or "auto"

    # ---- figures a user family may override (hive_attention_cls) -----------------------

    def kv_bytes_per_token(self, tensor_parallel_size: int) -> int:
        """KV bytes per token on one rank, all caches (the default: from ``attention_groups``)."""
        return sum(g.num_layers * g.bytes_per_token_per_layer(tensor_parallel_size, self.ctx.kv_elem_bytes)
                   for g in self.attention_groups())

    def kv_bytes_per_sequence(self, max_model_len: int, tensor_parallel_size: int, block_size: int) -> int | None:
        """Bytes one request of ``max_model_len`` tokens holds, or None for the block-pool model."""
        return None

    def mm_max_tokens_per_item(self, mm_processor_kwargs: dict[str, Any]) -> dict[str, int] | None:
        """Worst-case placeholder tokens of one item per modality, or None for the built-in math."""
        return None

    # ---- parameters ------------------------------------------------------------------

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        h, heads = self.dims.hidden, self.dims.heads
        hd, kvh = layer.head_size, layer.kv_heads
        bias = bool(self.get("attention_bias", default=False))
        q = heads * hd * self.q_multiplier()
        kv = 0 if layer.kv_shared and self.shared_layers_drop_kv() else 2 * h * kvh * hd
        c.attention += h * q + kv + heads * hd * h
        if kv:
            c.kv_proj[kvh] = c.kv_proj.get(kvh, 0) + kv
        if bias or self.qkv_bias:
            c.small += (heads + 2 * kvh) * hd
        if bias:
            c.small += h
        if self.qk_norm:
            c.small += 2 * hd

    def q_multiplier(self) -> int:
        return 1

    def shared_layers_drop_kv(self) -> bool:
        return False

    def dense_mlp_params(self, layer: Layer, c: ParamCounts) -> None:
        h, inter = self.dims.hidden, layer.intermediate
        c.mlp += (3 if self.gated_mlp else 2) * h * inter
        if self.get("mlp_bias", default=False):
            c.small += (2 if self.gated_mlp else 1) * inter + h

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        h, n_exp, size = self.dims.hidden, moe.experts, moe.expert_size
        c.experts += n_exp * moe.matrices * h * size
        c.small += h * n_exp  # router
        if self.get("topk_method") == "noaux_tc":
            c.small += n_exp  # e_score_correction_bias
        shared = int(self.num("n_shared_experts", default=0) or 0)
        shared_size = int(self.num("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                                   default=0) or 0)
        if shared_size:
            c.mlp += moe.matrices * h * shared_size
        elif shared:
            c.mlp += shared * moe.matrices * h * size

    def mixer_params(self, layer: Layer, c: ParamCounts) -> None:
        pass

    def count_params(self) -> tuple[ParamCounts, MoeInfo]:
        c = ParamCounts()
        d = self.dims
        h = d.hidden
        c.embed = d.vocab * h
        if self.ctx.runner == "generate" and not self.tied():  # a pooling run leaves lm_head on "meta"
            c.lm_head = d.vocab * h
        c.small += h  # final norm
        n_exp = self.num_experts()
        moe = MoeInfo(experts=n_exp, expert_size=int(self.num("moe_intermediate_size", default=0) or d.intermediate),
                      matrices=self.expert_matrices)
        for layer in self.layers:
            c.small += self.norms_per_layer * h
            if layer.mixer in ("attn", "sliding", "mla"):
                self.attention_params(layer, c)
            else:
                self.mixer_params(layer, c)
            if layer.ffn == "dense":
                self.dense_mlp_params(layer, c)
            elif layer.ffn == "moe":
                moe.layers += 1
                self.moe_params(c, moe)
        self.extra_params(c)
        if not moe.layers:
            moe = MoeInfo(matrices=moe.matrices)
        return c, moe

    def extra_params(self, c: ParamCounts) -> None:
        """Model-level parameters beyond embeddings, layers and the final norm."""

    # ---- summary figures for the profile ---------------------------------------------

    def mla_widths(self) -> tuple[int, int]:
        """(q width per head at prefill, V head size) for MLA activations; (0, 0) otherwise."""
        return 0, 0


# ---------------------------------------------------------------------------------------
# families


class EncoderFamily(Family):
    """BERT-style bidirectional encoders: no KV cache; embeddings, biased linears, pooler."""

    model_types = ("bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert", "distilbert", "electra",
                   "new", "gte", "deberta", "deberta-v2", "camembert")

    def encoder_only(self) -> bool:
        return True

    def max_position(self) -> int | None:
        best = super().max_position()
        if best is not None and self.ctx.text_type in ("roberta", "xlm-roberta", "camembert"):
            best -= int(self.num("pad_token_id", default=1)) + 1  # positions start after padding_idx
        return best

    def count_params(self) -> tuple[ParamCounts, MoeInfo]:
        d = self.dims
        h, inter, layers = d.hidden, d.intermediate, d.layers
        positions = int(self.num("max_position_embeddings", default=512))
        types = int(self.num("type_vocab_size", default=2))
        c = ParamCounts()
        c.embed = d.vocab * h
        c.small = positions * h + types * h + 2 * h + (h * h + h)  # positions, token types, LN, pooler
        c.attention = layers * 4 * h * h
        c.mlp = layers * 2 * h * inter
        c.small += layers * (4 * h + inter + h + 4 * h)  # linear biases and two LayerNorms per layer
        return c, MoeInfo(matrices=2)


class Qwen2Family(Family):
    """Qwen2: q/k/v projections carry a bias although the config has no attention_bias."""

    model_types = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text")
    qkv_bias = True

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        super().moe_params(c, moe)
        if self.num("shared_expert_intermediate_size", default=0):
            c.small += self.dims.hidden  # shared_expert_gate


class QkNormFamily(Family):
    """Per-head q/k RMSNorm (Qwen3, OLMo 2)."""

    model_types = ("qwen3", "qwen3_moe", "olmo2", "olmoe")
    qk_norm = True


class Qwen3NextFamily(Family):
    """Qwen3-Next: gated delta net layers between full-attention layers, gated attention output."""

    model_types = ("qwen3_next",)
    qk_norm = True
    layer_kinds = {**Family.layer_kinds, "linear_attention": "gdn"}

    def q_multiplier(self) -> int:
        return 2  # the output gate comes out of q_proj

    def mixer_params(self, layer: Layer, c: ParamCounts) -> None:
        if layer.mixer != "gdn":
            return
        h = self.dims.hidden
        nk, nv = int(self.num("linear_num_key_heads")), int(self.num("linear_num_value_heads"))
        dk, dv = int(self.num("linear_key_head_dim")), int(self.num("linear_value_head_dim"))
        kernel = int(self.num("linear_conv_kernel_dim", default=4))
        key_dim, value_dim = nk * dk, nv * dv
        c.mixer += h * (2 * key_dim + 2 * value_dim) + h * 2 * nv + value_dim * h
        c.small += (2 * key_dim + value_dim) * kernel + 2 * nv + dv

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        super().moe_params(c, moe)
        if self.num("shared_expert_intermediate_size", default=0):
            c.small += self.dims.hidden  # shared_expert_gate


class Gemma2Family(Family):
    """Gemma 2: four norms per layer, alternating sliding and global layers."""

    model_types = ("gemma2",)
    norms_per_layer = 4


class Gemma3Family(Gemma2Family):
    """Gemma 3: Gemma 2 plus per-head q/k norms."""

    model_types = ("gemma3", "gemma3_text")
    qk_norm = True


class GptOssFamily(Family):
    """gpt-oss: attention sinks, biased experts and router."""

    model_types = ("gpt_oss",)

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        super().attention_params(layer, c)
        c.small += self.dims.heads  # attention sinks

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        super().moe_params(c, moe)
        c.small += moe.experts * (2 * moe.expert_size + self.dims.hidden) + moe.experts  # expert, router biases


class UngatedFamily(Family):
    """Decoders whose MLP has two matrices, not three."""

    model_types = ("gpt2", "gpt_neox", "gptj", "opt", "phi", "starcoder2", "gpt_bigcode", "bloom", "nemotron")
    gated_mlp = False


class FalconFamily(UngatedFamily):
    """Falcon: one KV head under the old ``multi_query`` flag (FalconModelArchConfigConvertor)."""

    model_types = ("falcon", "RefinedWeb", "RefinedWebModel")

    def kv_heads(self, lc: Any = None) -> int:
        if not self.get("new_decoder_architecture", default=False) and self.get("multi_query", default=False):
            return 1
        return super().kv_heads(lc)


class NemotronHFamily(Family):
    """Nemotron-H: ``hybrid_override_pattern`` of Mamba-2 (M), MLP (-), attention (*) and MoE (E) layers."""

    model_types = ("nemotron_h",)
    handles = frozenset({"hybrid_override_pattern", "layers_block_type"})
    gated_mlp = False
    expert_matrices = 2
    norms_per_layer = 1
    _KINDS = {"M": ("mamba2", "none"), "-": ("none", "dense"), "*": ("attn", "none"), "E": ("none", "moe")}
    _NAMES = {"linear_attention": "M", "mamba": "M", "mlp": "-", "full_attention": "*", "attention": "*",
              "moe": "E"}

    def intermediate_size(self) -> int | None:
        v = self.get("intermediate_size", "moe_intermediate_size")
        return max(v) if isinstance(v, list) and v else v

    def pattern(self) -> str:
        n = self.dims.layers
        pattern = self.get("hybrid_override_pattern")
        if isinstance(pattern, str) and len(pattern) == n:
            return pattern
        types = self.get("layer_types") or []
        if len(types) != n:
            raise Unmodelled("a Nemotron-H config without a hybrid_override_pattern (or layer_types) of one "
                             "entry per layer", "add the pattern to config.json")
        return "".join(self._NAMES.get(t, "?") for t in types)

    def build_layer(self, i: int, layer_type: str) -> Layer:
        c = self.pattern()[i]
        if c not in self._KINDS:
            raise Unmodelled(f"hybrid pattern entry {c!r} (layer {i})", self._hook_hint())
        mixer, ffn = self._KINDS[c]
        inter = self.get("intermediate_size")
        if isinstance(inter, list):  # one entry per MLP layer (nemotron_h.py NemotronHMLPDecoderLayer)
            inter = inter[0] if len(inter) == 1 else inter[self.pattern()[: i + 1].count("-") - 1]
        if mixer == "attn":
            hd = self.head_dim()
            return Layer(mixer="attn", ffn=ffn, kv_heads=self.kv_heads(), head_size=hd, head_size_v=hd,
                         intermediate=int(inter or 0))
        return Layer(mixer=mixer, ffn=ffn, intermediate=int(inter or 0))

    @cached_property
    def layers(self) -> list[Layer]:
        return [self.build_layer(i, "") for i in range(self.dims.layers)]

    def ssm_cache_dtype(self) -> Any:
        chosen = self.ctx.vllm_kwargs.get("mamba_ssm_cache_dtype") or "auto"
        if chosen == "auto":  # NemotronHForCausalLMConfig: the checkpoint's mamba_ssm_cache_dtype (fp32)
            return self.get("mamba_ssm_cache_dtype", default="float32")
        return chosen

    def mixer_params(self, layer: Layer, c: ParamCounts) -> None:
        if layer.mixer != "mamba2":
            return
        h = self.dims.hidden
        nheads = int(self.num("mamba_num_heads", default=0))
        d_inner = nheads * int(self.num("mamba_head_dim", default=0)) or int(self.num("expand", default=2)) * h
        groups = int(self.num("n_groups", default=1))
        state = int(self.num("ssm_state_size", "state_size", default=128))
        kernel = int(self.num("conv_kernel", default=4))
        conv_dim = d_inner + 2 * groups * state
        in_proj = h * (d_inner + conv_dim + nheads)
        c.mixer += in_proj + conv_dim * (kernel + 1) + 3 * nheads + d_inner + d_inner * h

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        h = self.dims.hidden
        c.experts += moe.experts * moe.matrices * h * moe.expert_size
        c.small += h * moe.experts
        if self.get("topk_method") == "noaux_tc":
            c.small += moe.experts
        shared = int(self.num("n_shared_experts", default=0) or 0)
        shared_size = int(self.num("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                                   default=0) or 0)
        if shared_size:
            c.mlp += moe.matrices * h * shared_size * max(1, shared)
        elif shared:
            c.mlp += shared * moe.matrices * h * moe.expert_size


class _MlaShaped(Family):
    """Configs with DeepSeek's low-rank attention projections (q_lora_rank, kv_lora_rank, qk_*_head_dim)."""

    handles = frozenset({"kv_lora_rank", "v_head_dim"})

    def mla_dims(self) -> tuple[int, int | None, int, int, int]:
        """(kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
        return (int(self.num("kv_lora_rank")), self.num("q_lora_rank"), int(self.num("qk_nope_head_dim")),
                int(self.num("qk_rope_head_dim")), int(self.num("v_head_dim")))

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        if self.get("kv_lora_rank") is None:
            return super().attention_params(layer, c)
        h, heads = self.dims.hidden, self.dims.heads
        kv_rank, q_rank, nope, rope, v = self.mla_dims()
        # the down-projections (q_a_proj, kv_a_proj_with_mqa) are ReplicatedLinear in vLLM: whole on every rank
        c.attention_rep += h * (kv_rank + rope) + (h * q_rank if q_rank else 0)
        c.attention += (q_rank if q_rank else h) * heads * (nope + rope) + kv_rank * heads * (nope + v) + heads * v * h
        c.small += kv_rank + int(q_rank or 0)  # kv_a / q_a layernorms


class MlaFamily(_MlaShaped):
    """DeepSeek-V2/V3-style MLA as vLLM 0.32 runs it (``deepseek_v2.py``): one replicated latent of
    ``kv_lora_rank + qk_rope_head_dim`` per layer; with ``index_topk`` (DeepSeek-V3.2, GLM-5) a
    sparse-attention indexer keeps a second per-layer cache of ``index_head_dim`` fp8 bytes plus
    one fp32 scale per 128 (``Indexer.k_cache``), on the layers the index-topk pattern keeps."""

    model_types = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite", "glm_moe_dsa")
    handles = frozenset({"kv_lora_rank", "v_head_dim", "index_topk"})

    def uses_mla(self) -> bool:
        # ModelConfig.use_mla: a vLLM MLA model type with kv_lora_rank, causal (bidirectional variants are not)
        return (self.ctx.text_type in VLLM_MLA_MODEL_TYPES and self.get("kv_lora_rank") is not None
                and self.is_causal())

    def check(self) -> None:
        super().check()
        if self.get("index_topk") is not None and not self.uses_mla():
            raise Unmodelled("a sparse-attention indexer (index_topk) without MLA", self._hook_hint())

    def build_layer(self, i: int, layer_type: str) -> Layer:
        if not self.uses_mla():
            return _full_kv_layer(self, super().build_layer(i, layer_type))
        ffn = "moe" if self.is_moe_layer(i) else "dense"
        return Layer(mixer="mla", ffn=ffn, kv_heads=1, intermediate=self.dims.intermediate,
                     indexer_bytes=self.indexer_bytes(i))

    def indexer_bytes(self, i: int) -> int:
        if self.get("index_topk") is None:
            return 0
        freq = int(self.num("index_topk_freq", default=1) or 1)
        pattern = self.get("index_topk_pattern")
        offset = int(self.num("index_skip_topk_offset", default=2))
        if pattern is None:
            skip = max(i - offset + 1, 0) % freq != 0
        else:
            skip = 0 <= i < len(pattern) and pattern[i] == "S"
        if skip:
            return 0
        head = int(self.num("index_head_dim"))
        return head + head // 128 * 4  # fp8 key + one fp32 scale per 128 elements (uint8 cache)

    def cache_keys(self, layer: Layer) -> list[tuple]:
        if layer.mixer != "mla":
            return super().cache_keys(layer)
        kv_rank, _, _, rope, _ = self.mla_dims()
        fixed = MLA_PACKED_BYTES.get(self.ctx.kv_cache_dtype)
        if fixed is None and layer.indexer_bytes and "fp8" in self.ctx.kv_cache_dtype:
            fixed = MLA_PACKED_BYTES["fp8_ds_mla"]  # FlashMLA-sparse serves any fp8 cache as fp8_ds_mla
        keys = [("full", 1, kv_rank + rope, 0, True, None, fixed, "mla")]
        if layer.indexer_bytes:
            keys.append(("full", 1, layer.indexer_bytes, 0, True, None, layer.indexer_bytes, "indexer"))
        return keys

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        super().moe_params(c, moe)
        if self.get("topk_method") != "noaux_tc" and self.ctx.text_type in ("deepseek_v3", "kimi_k2"):
            c.small += moe.experts  # e_score_correction_bias

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        super().attention_params(layer, c)
        if layer.indexer_bytes:
            h = self.dims.hidden
            n_head, head = int(self.num("index_n_heads")), int(self.num("index_head_dim"))
            _, q_rank, _, _, _ = self.mla_dims()
            c.attention_rep += int(q_rank or 0) * n_head * head  # wq_b (ReplicatedLinear)
            c.small += h * (head + n_head) + 2 * head  # wk + weights_proj (unquantized, disable_tp), k_norm

    def mla_widths(self) -> tuple[int, int]:
        if not self.uses_mla():
            return 0, 0
        _, _, nope, rope, v = self.mla_dims()
        return nope + rope, v


def _full_kv_layer(family: _MlaShaped, layer: Layer) -> Layer:
    """An MLA-shaped layer vLLM runs as plain attention (``DeepseekV2Attention``, ``MiniCPM3Attention``):
    every head stores K of ``qk_nope + qk_rope`` and V padded to the same width."""
    if layer.mixer not in ("attn", "sliding") or family.get("kv_lora_rank") is None:
        return layer
    _, _, nope, rope, _ = family.mla_dims()
    heads = family.dims.heads
    return Layer(mixer=layer.mixer, ffn=layer.ffn, kv_heads=heads, head_size=nope + rope, head_size_v=nope + rope,
                 window=layer.window, intermediate=layer.intermediate, kv_shared=layer.kv_shared)


class MlaFullKvFamily(_MlaShaped):
    """MLA-shaped configs vLLM 0.32 does not run as MLA: MiniCPM3 always, and DeepSeek-V2/V3 code under a
    model type outside vLLM's MLA list. Full per-head K and V (V padded to the q/k head size)."""

    model_types = ("minicpm3",)
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                     "Glm4MoeLiteForCausalLM", "MiniCPM3ForCausalLM")

    def build_layer(self, i: int, layer_type: str) -> Layer:
        return _full_kv_layer(self, super().build_layer(i, layer_type))


class UnverifiedMlaFamily(Family):
    """Model types vLLM runs as MLA whose layer layout the planner has not checked against vLLM."""

    model_types = tuple(sorted(VLLM_MLA_MODEL_TYPES - set(MlaFamily.model_types)))

    def check(self) -> None:
        raise Unmodelled(f"model type {self.ctx.text_type!r}: vLLM 0.32 runs it with MLA, but its layer layout "
                         "(layer count, hybrid or compressed caches, indexers) is not modelled by the planner",
                         self._hook_hint())


class NemotronNasFamily(Family):
    """Nemotron-NAS (DeciLM, ``nemotron_nas.py``): per-block attention and FFN from ``block_configs``.

    A block's attention is either absent (``no_op``: no KV cache) or has
    ``num_attention_heads // n_heads_in_group`` KV heads; its FFN is absent or a gated MLP of
    ``_find_multiple(int(2 * ffn_mult * hidden / 3), 256)`` (or an explicit intermediate_size).
    """

    model_types = ("nemotron-nas",)
    handles = frozenset({"block_configs"})

    def intermediate_size(self) -> int | None:
        sizes = [self._ffn_size(b) for b in self._blocks()]
        return max((s for s in sizes if s), default=None)

    def _blocks(self) -> list[Any]:
        blocks = self.get("block_configs")
        if not isinstance(blocks, list) or not blocks:
            raise Unmodelled("nemotron-nas config without block_configs", "add block_configs to config.json")
        return blocks

    @staticmethod
    def _part(block: Any, name: str) -> Any:
        part = fields.get(block, name)
        if part is None:
            raise Unmodelled(f"a nemotron-nas block without '{name}'")
        return part

    def _ffn_size(self, block: Any) -> int:
        ffn = self._part(block, "ffn")
        if fields.get(ffn, "no_op", default=False):
            return 0
        if fields.get(ffn, "replace_with_linear", default=False):
            raise Unmodelled("a nemotron-nas FFN replaced with a linear layer, which vLLM 0.32's DeciLM does "
                             "not build")
        mult = fields.get(ffn, "ffn_mult")
        if mult is not None:
            size = int(2 * float(mult) * int(self.num("hidden_size")) / 3)
            return size if size % 256 == 0 else size + 256 - size % 256
        return int(fields.num(ffn, "intermediate_size"))

    def build_layer(self, i: int, layer_type: str) -> Layer:
        blocks = self._blocks()
        if len(blocks) != self.dims.layers:
            raise Unmodelled(f"{len(blocks)} block_configs for {self.dims.layers} layers")
        block = blocks[i]
        attn = self._part(block, "attention")
        inter = self._ffn_size(block)
        ffn = "dense" if inter else "none"
        if fields.get(attn, "no_op", default=False):
            return Layer(mixer="none", ffn=ffn, intermediate=inter)
        if fields.get(attn, "replace_with_linear", default=False):
            raise Unmodelled("a nemotron-nas attention replaced with a linear layer, which vLLM 0.32's DeciLM "
                             "does not build")
        group = int(fields.num(attn, "n_heads_in_group"))
        hd = self.head_dim()
        window = fields.num(attn, "window_length")
        if window:
            raise Unmodelled("a nemotron-nas block with a sliding window (window_length)")
        return Layer(mixer="attn", ffn=ffn, kv_heads=self.dims.heads // group, head_size=hd, head_size_v=hd,
                     intermediate=inter)

    def count_params(self) -> tuple[ParamCounts, MoeInfo]:
        c, moe = super().count_params()
        h = self.dims.hidden
        # only built sub-blocks have their norm (input_layernorm / post_attention_layernorm)
        c.small -= sum((2 - (layer.mixer != "none") - (layer.ffn != "none")) * h for layer in self.layers)
        return c, moe


class Gemma3nFamily(Family):
    """Gemma 3n (``gemma3n.py``): per-layer MLP widths (``intermediate_size`` is a list), the last
    ``num_kv_shared_layers`` layers read the cache of the last earlier layer of the same type,
    per-layer embeddings (PLE), AltUp and LAuReL blocks."""

    model_types = ("gemma3n", "gemma3n_text")
    handles = frozenset({"num_kv_shared_layers"})
    per_layer_fields = frozenset({"intermediate_size"})
    norms_per_layer = 5  # input, post-attention, pre/post feed-forward, post per-layer input
    qk_norm = True

    def intermediate_size(self) -> int | None:
        v = self.get("intermediate_size")
        return max(v) if isinstance(v, list) and v else fields.num(self.text, "intermediate_size")

    def layer_intermediate(self, lc: Any, i: int) -> int:
        v = self.get("intermediate_size")
        if isinstance(v, list):
            if len(v) != self.dims.layers:
                raise Unmodelled(f"'intermediate_size' has {len(v)} entries for {self.dims.layers} layers")
            return int(v[i])
        return int(v)

    def kv_shared(self, i: int) -> bool:
        shared = int(self.num("num_kv_shared_layers", default=0) or 0)
        return shared > 0 and i >= self.dims.layers - shared

    def shared_layers_drop_kv(self) -> bool:
        return True

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        super().attention_params(layer, c)
        if layer.kv_shared:
            c.small -= layer.head_size  # no k_norm on a layer that reads another layer's cache

    def extra_params(self, c: ParamCounts) -> None:
        d = self.dims
        h, n = d.hidden, d.layers
        ple = int(self.num("hidden_size_per_layer_input", default=0) or 0)
        vocab_ple = int(self.num("vocab_size_per_layer_input", default=d.vocab) or d.vocab)
        altup = int(self.num("altup_num_inputs", default=1) or 1)
        laurel = int(self.num("laurel_rank", default=0) or 0)
        c.embed += vocab_ple * n * ple  # embed_tokens_per_layer
        c.mlp += h * n * ple  # per_layer_model_projection
        c.small += ple  # per_layer_projection_norm
        c.mlp += 2 * (altup - 1) * h * h  # altup (un)embed projections
        per_layer = 2 * h * ple  # per_layer_input_gate + per_layer_projection
        per_layer += 2 * h * laurel + h  # laurel left/right + post_laurel_norm
        per_layer += altup * altup + altup * altup * altup + h * altup + h + h  # altup coefs, router, norm, scale
        c.small += n * per_layer


class Gemma4Family(Family):
    """Gemma 4 (``gemma4.py``): transformers 5 per-layer configs give full-attention layers their own
    head size and KV head count (``per_layer_config``); the last ``num_kv_shared_layers`` layers
    read an earlier layer's cache; optional per-layer embeddings and a MoE block beside the MLP."""

    model_types = ("gemma4", "gemma4_text")
    handles = frozenset({"num_kv_shared_layers", "global_head_dim", "num_global_key_value_heads"})
    per_layer_fields = frozenset({"head_dim", "num_key_value_heads"})
    norms_per_layer = 4
    qk_norm = True

    def check(self) -> None:
        super().check()
        if not fields.is_heterogeneous(self.text) and (self._raw("global_head_dim")
                                                       or self._raw("num_global_key_value_heads")):
            raise Unmodelled("a Gemma 4 config transformers did not turn into per-layer configs "
                             "(global_head_dim without per_layer_config)",
                             "load it with transformers >= 5.19, as vLLM 0.32 does")

    def head_dim(self, lc: Any = None) -> int:
        return int(fields.num(self.text if lc is None else lc, "head_dim"))

    def kv_shared(self, i: int) -> bool:
        shared = int(self.num("num_kv_shared_layers", default=0) or 0)
        return shared > 0 and i >= self.dims.layers - shared

    def shared_layers_drop_kv(self) -> bool:
        return True

    def layer_intermediate(self, lc: Any, i: int) -> int:
        double = bool(self.get("use_double_wide_mlp", default=False)) and self.kv_shared(i)
        return self.dims.intermediate * (2 if double else 1)

    def is_moe_layer(self, i: int) -> bool:
        return False  # the MoE block sits beside the dense MLP (extra_params)

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        super().attention_params(layer, c)
        if layer.kv_shared:
            c.small -= layer.head_size  # no k_norm on a layer that reads another layer's cache

    def extra_params(self, c: ParamCounts) -> None:
        d = self.dims
        h, n = d.hidden, d.layers
        ple = int(self.num("hidden_size_per_layer_input", default=0) or 0)
        if ple:
            vocab_ple = int(self.num("vocab_size_per_layer_input", default=d.vocab) or d.vocab)
            c.embed += vocab_ple * n * ple
            c.mlp += h * n * ple
            c.small += ple + n * (2 * h * ple + h)  # projection norm; per layer: gate, projection, norm
        experts = int(self.num("num_experts", default=0) or 0)
        if experts:
            size = int(self.num("moe_intermediate_size"))
            c.experts += n * experts * 3 * h * size
            c.small += n * (h * experts + 3 * h + h + experts)  # router, three extra norms, router scales


FAMILIES: list[type[Family]] = [
    EncoderFamily, Qwen2Family, QkNormFamily, Qwen3NextFamily, Gemma2Family, Gemma3Family, GptOssFamily,
    UngatedFamily, FalconFamily, NemotronHFamily, MlaFamily, MlaFullKvFamily, UnverifiedMlaFamily,
    NemotronNasFamily, Gemma3nFamily, Gemma4Family,
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
        raise PlanningError(f"hive_attention_cls {dotted!r} overrides none of kv_bytes_per_token(tensor_parallel_size), "
                            "kv_bytes_per_sequence(...) or mm_max_tokens_per_item(mm_processor_kwargs)", 422)
    return combined


def overrides(family: Family, name: str) -> bool:
    """Whether the family's class (a user class mixed in) replaces ``Family.<name>``."""
    return getattr(type(family), name) is not getattr(Family, name)
