"""DeepSeek-style low-rank attention: MLA as vLLM runs it (with the sparse indexer), and the MLA-shaped
configs vLLM runs as plain attention."""

from __future__ import annotations

from typing import Any

from hive_apps.core.planning.profile.families.base import VLLM_MLA_MODEL_TYPES, Family, Layer, MoeInfo
from hive_apps.core.planning.profile.fields import Unmodelled
from hive_apps.core.planning.profile.model import ParamCounts
from hive_apps.core.planning.profile.quant import MLA_PACKED_BYTES


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

    def cache_keys(self, layer: Layer) -> list[tuple[Any, ...]]:
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
