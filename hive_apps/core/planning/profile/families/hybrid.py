"""Families whose layers are not all alike: Mamba-2 and gated-delta-net hybrids, Nemotron-NAS blocks."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from hive_apps.core.planning.profile import fields
from hive_apps.core.planning.profile.families.base import Family, Layer, MoeInfo
from hive_apps.core.planning.profile.fields import Unmodelled
from hive_apps.core.planning.profile.model import ParamCounts


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
        size: int | None = max(v) if isinstance(v, list) and v else v
        return size

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
