"""Families whose layers attend locally in ways beyond Gemma-style sliding windows: Llama 4's chunked
local attention, MiMo-V2's sliding layers with their own heads and a V head size of their own."""

from __future__ import annotations

from typing import Any

from hive_apps.core.planning.profile import fields
from hive_apps.core.planning.profile.families.base import Family, Layer, MoeInfo
from hive_apps.core.planning.profile.fields import Unmodelled
from hive_apps.core.planning.profile.model import ParamCounts


class Llama4Family(Family):
    """Llama 4 (``llama4.py``): a RoPE layer (``no_rope_layers[i] != 0``) attends within its
    ``attention_chunk_size`` chunk (``ChunkedLocalAttention``: ``ChunkedLocalAttentionSpec``), a NoPE
    layer globally; every ``interleave_moe_layer_step``-th layer is MoE with one shared expert of
    ``intermediate_size``, the others a dense MLP of ``intermediate_size_mlp``. vLLM reads
    ``no_rope_layers`` and ``interleave_moe_layer_step``, not ``layer_types`` / ``moe_layers``."""

    model_types = ("llama4", "llama4_text")
    layer_kinds = {**Family.layer_kinds, "chunked_attention": "chunked"}

    def no_rope_layers(self, n: int) -> list[int]:
        """transformers ``Llama4TextConfig.__post_init__``: an empty list becomes a NoPE layer every
        ``no_rope_layer_interval`` (4) layers; vLLM indexes it by layer."""
        given = self.get("no_rope_layers")
        if isinstance(given, list) and given:
            if len(given) < n:
                raise Unmodelled(f"'no_rope_layers' has {len(given)} entries for {n} layers")
            return [int(v) for v in given[:n]]
        interval = int(self.num("no_rope_layer_interval", default=4) or 4)
        return [int((i + 1) % interval != 0) for i in range(n)]

    def layer_types(self, n: int) -> list[str]:
        chunk = self.attention_chunk_size()  # Llama4Attention: use_chunked_local_attn = not nope and chunk
        return ["chunked_attention" if rope and chunk else "full_attention" for rope in self.no_rope_layers(n)]

    def is_moe_layer(self, i: int) -> bool:
        step = int(self.num("interleave_moe_layer_step", default=1) or 0)  # Llama4DecoderLayer.is_moe_layer
        return self.num_experts() > 0 and step > 0 and (i + 1) % step == 0

    def layer_intermediate(self, lc: Any, i: int) -> int:
        return int(self.num("intermediate_size_mlp", default=0) or self.dims.intermediate)

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        super().moe_params(c, moe)
        c.mlp += moe.matrices * self.dims.hidden * moe.expert_size  # Llama4MoE.shared_expert


class MiMoV2Family(Family):
    """MiMo-V2-Flash (``mimo_v2.py``): ``hybrid_layer_pattern[i] == 1`` is a sliding-window layer of
    ``sliding_window_size`` with its own heads (``swa_num_attention_heads``, ``swa_num_key_value_heads``,
    ``swa_head_dim``, ``swa_v_head_dim``), 0 a global layer; both keep V at a head size of its own
    (``FullAttentionSpec`` / ``SlidingWindowSpec`` with ``head_size_v``). ``moe_layer_freq[i]`` marks
    the MoE layers. vLLM drops the config's ``attention_chunk_size``
    (``_strip_mimo_v2_attention_chunk_size``: the model does not use it)."""

    model_types = ("mimo_v2", "mimo_v2_flash")
    handles = frozenset({"v_head_dim"})

    def check(self) -> None:
        super().check()
        if fields.get(self.cfg, "vision_config") is not None:
            raise Unmodelled("MiMo-V2-Omni (a mimo_v2 config with a vision_config): its towers are not modelled",
                             self._hook_hint())

    def pattern(self) -> list[int]:
        n = self.dims.layers
        pattern = self.get("hybrid_layer_pattern")
        if not isinstance(pattern, list) or len(pattern) < n:
            raise Unmodelled("a MiMo-V2 config without a hybrid_layer_pattern of one entry per layer (vLLM 0.32's "
                             "mimo_v2.py reads it for every layer)", "add hybrid_layer_pattern to config.json")
        return [int(v) for v in pattern[:n]]

    def layer_types(self, n: int) -> list[str]:
        return ["sliding_attention" if p == 1 else "full_attention" for p in self.pattern()]

    def sliding_window(self, lc: Any = None) -> int | None:
        v = self.num("sliding_window_size")  # MiMoV2Attention: sliding_window_size > -1, else none
        return int(v) if v is not None and v > -1 else None

    def attention_chunk_size(self) -> int | None:
        return None

    def is_moe_layer(self, i: int) -> bool:
        freq = self.get("moe_layer_freq")  # MiMoV2FlashDecoderLayer.is_moe_layer: a list, never an int
        return isinstance(freq, list) and i < len(freq) and bool(freq[i])

    def num_experts(self) -> int:
        return int(self.num("n_routed_experts", default=0) or 0)

    def _swa(self, layer_type: str) -> bool:
        return layer_type == "sliding_attention"

    def build_layer(self, i: int, layer_type: str) -> Layer:
        swa = self._swa(layer_type)
        pre = "swa_" if swa else ""
        hd = int(self.num(f"{pre}head_dim"))
        hv = int(self.num(f"{pre}v_head_dim", default=0) or hd)
        kv = int(self.num(f"{pre}num_key_value_heads"))
        window = self.sliding_window() if swa else None
        return Layer(mixer="sliding" if window else "attn", ffn="moe" if self.is_moe_layer(i) else "dense",
                     kv_heads=kv, head_size=hd, head_size_v=hv, window=window, intermediate=self.dims.intermediate)

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        h, hd, hv, kvh = self.dims.hidden, layer.head_size, layer.head_size_v, layer.kv_heads
        heads = int(self.num("swa_num_attention_heads")) if layer.mixer == "sliding" else self.dims.heads
        kv = h * kvh * (hd + hv)  # QKVParallelLinear with v_head_size
        c.attention += h * heads * hd + kv + heads * hv * h
        c.kv_proj[kvh] = c.kv_proj.get(kvh, 0) + kv
        if self.get("attention_bias", default=False):
            c.small += heads * hd + kvh * (hd + hv)
        if layer.mixer == "sliding" and self.get("add_swa_attention_sink_bias", default=False):
            c.small += heads  # attention_sink_bias: MiMoV2FlashDecoderLayer passes it to sliding layers only

    def moe_params(self, c: ParamCounts, moe: MoeInfo) -> None:
        h = self.dims.hidden
        c.experts += moe.experts * moe.matrices * h * moe.expert_size
        # MiMoV2MoE: the router (GateLinear) and its e_score_correction_bias are kept in moe_router_dtype
        # (float32 unless the config says otherwise); a float32 one counts twice at the role's 16-bit size
        wide = str(self.get("moe_router_dtype", default="float32")) in ("float32", "fp32")
        c.small += (2 if wide and self.ctx.dtype_bytes == 2 else 1) * (h * moe.experts + moe.experts)
