"""The generic decoder family and the shapes every family shares (``Layer``, ``Ctx``).

``Family`` is vLLM's ``ModelArchConfigConvertorBase`` plus Llama-like model code; it refuses, with
``Unmodelled``, every config feature that would change the KV cache in a way it does not model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from hive_apps.core.planning.profile import fields
from hive_apps.core.planning.profile.fields import Unmodelled
from hive_apps.core.planning.profile.model import AttentionGroup, ParamCounts, StateGroup
from hive_apps.core.planning.profile.quant import ssm_bytes
from hive_apps.core.planning.types import PlanningError

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

    mixer: str  # "attn" | "sliding" | "chunked" | "mla" | "mamba2" | "gdn" | "none"
    ffn: str  # "dense" | "moe" | "none"
    kv_heads: int = 0  # total KV heads of this layer's cache
    head_size: int = 0
    head_size_v: int = 0
    window: int | None = None  # sliding window, or the chunk of chunked local attention
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
        assert hidden and layers and heads and vocab and intermediate  # none is missing (checked above)
        return Dims(int(hidden), int(layers), int(heads), int(vocab), int(intermediate))

    def intermediate_size(self) -> int | None:
        size: int | None = self.num("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "moe_intermediate_size")
        return size

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

    def attention_chunk_size(self) -> int | None:
        """The chunk of chunked local attention layers (vLLM's ``ModelConfig.attention_chunk_size``)."""
        v = self.num("attention_chunk_size")
        return int(v) if v else None

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
        if mixer in ("attn", "sliding", "chunked"):
            hd = self.head_dim(lc)
            window = self.sliding_window(lc) if mixer == "sliding" else \
                self.attention_chunk_size() if mixer == "chunked" else None
            return Layer(mixer=mixer, ffn=ffn, kv_heads=self.kv_heads(lc), head_size=hd, head_size_v=hd,
                         window=window, intermediate=self.layer_intermediate(lc, i), kv_shared=self.kv_shared(i))
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
        counts: dict[tuple[Any, ...], int] = {}
        for layer in self.layers:
            if layer.kv_shared:
                continue
            for key in self.cache_keys(layer):
                counts[key] = counts.get(key, 0) + 1
        keys = sorted(counts, key=lambda k: (k[0] != "full", list(counts).index(k)))
        return [AttentionGroup(kind=k[0], num_layers=counts[k], num_kv_heads=k[1], head_size=k[2],
                               head_size_v=k[3], replicated=k[4],
                               sliding_window=k[5] if k[0] == "sliding" else None,
                               attention_chunk_size=k[5] if k[0] == "chunked" else None,
                               fixed_bytes_per_token=k[6], role=k[7]) for k in keys]

    def cache_keys(self, layer: Layer) -> list[tuple[Any, ...]]:
        """(kind, kv heads, head size, head size v, replicated, window or chunk, fixed bytes, role) per cache."""
        if layer.mixer == "attn":
            return [("full", layer.kv_heads, layer.head_size, layer.head_size_v, False, None, None, "kv")]
        if layer.mixer in ("sliding", "chunked"):
            return [(layer.mixer, layer.kv_heads, layer.head_size, layer.head_size_v, False, layer.window, None,
                     "kv")]
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
            if layer.mixer in ("attn", "sliding", "chunked", "mla"):
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
