"""Gemma 2, 3, 3n and 4: sliding windows, per-layer configs and list-valued fields, shared KV layers."""

from __future__ import annotations

from typing import Any, ClassVar

from hive_apps.core.planning.profile import fields
from hive_apps.core.planning.profile.families.base import Family, Layer
from hive_apps.core.planning.profile.fields import Unmodelled
from hive_apps.core.planning.profile.model import ParamCounts


class Gemma2Family(Family):
    """Gemma 2: four norms per layer, alternating sliding and global layers."""

    model_types: ClassVar[tuple[str, ...]] = ("gemma2",)
    norms_per_layer = 4


class Gemma3Family(Gemma2Family):
    """Gemma 3: Gemma 2 plus per-head q/k norms."""

    model_types = ("gemma3", "gemma3_text")
    qk_norm = True


class _SharedKVLayers(Family):
    """Gemma 3n and 4: the last ``num_kv_shared_layers`` layers read an earlier layer's cache,
    hold none of their own, and have no k_norm."""

    def kv_shared(self, i: int) -> bool:
        shared = int(self.num("num_kv_shared_layers", default=0) or 0)
        return shared > 0 and i >= self.dims.layers - shared

    def shared_layers_drop_kv(self) -> bool:
        return True

    def attention_params(self, layer: Layer, c: ParamCounts) -> None:
        super().attention_params(layer, c)
        if layer.kv_shared:
            c.small -= layer.head_size  # no k_norm on a layer that reads another layer's cache


class Gemma3nFamily(_SharedKVLayers):
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
        size: int | None = max(v) if isinstance(v, list) and v else fields.num(self.text, "intermediate_size")
        return size

    def layer_intermediate(self, lc: Any, i: int) -> int:
        v = self.get("intermediate_size")
        if isinstance(v, list):
            if len(v) != self.dims.layers:
                raise Unmodelled(f"'intermediate_size' has {len(v)} entries for {self.dims.layers} layers")
            return int(v[i])
        return int(v)

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


class Gemma4Family(_SharedKVLayers):
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

    def layer_intermediate(self, lc: Any, i: int) -> int:
        double = bool(self.get("use_double_wide_mlp", default=False)) and self.kv_shared(i)
        return self.dims.intermediate * (2 if double else 1)

    def is_moe_layer(self, i: int) -> bool:
        return False  # the MoE block sits beside the dense MLP (extra_params)

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
