"""Decoder families that differ from the generic one only in small ways (biases, norms, MLP shape)."""

from __future__ import annotations

from typing import Any, ClassVar

from hive_apps.core.planning.profile.families.base import Family, Layer, MoeInfo
from hive_apps.core.planning.profile.model import ParamCounts


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

    model_types: ClassVar[tuple[str, ...]] = ("gpt2", "gpt_neox", "gptj", "opt", "phi", "starcoder2", "gpt_bigcode", "bloom", "nemotron")
    gated_mlp = False


class FalconFamily(UngatedFamily):
    """Falcon: one KV head under the old ``multi_query`` flag (FalconModelArchConfigConvertor)."""

    model_types = ("falcon", "RefinedWeb", "RefinedWebModel")

    def kv_heads(self, lc: Any = None) -> int:
        if not self.get("new_decoder_architecture", default=False) and self.get("multi_query", default=False):
            return 1
        return super().kv_heads(lc)
