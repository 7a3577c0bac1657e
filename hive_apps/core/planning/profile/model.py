"""The planner's data model of one model: cache layout, parameters by role, quantization, and the
figures derived from them (KV bytes per token, weights per rank, vLLM's block pool per request)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from hive_apps.core.planning import multimodal as mm
from hive_apps.core.planning.multimodal import MmItem, TowerInfo
from hive_apps.core.planning.types import ProfileSummary


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


class AttentionGroup(BaseModel):
    """Identical attention caches: each stores K and V (or one MLA latent, or an indexer key) per token."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["full", "sliding", "chunked"]
    num_layers: int
    num_kv_heads: int  # total over all ranks (MLA / indexer: 1)
    head_size: int  # K width per head (MLA: kv_lora_rank + qk_rope_head_dim)
    head_size_v: int  # V width per head (MLA / indexer: 0, one vector per token)
    replicated: bool = False  # every TP rank holds the whole cache (MLA latent, sparse-MLA indexer)
    sliding_window: int | None = None
    attention_chunk_size: int | None = None  # chunked local attention (Llama 4's RoPE layers)
    fixed_bytes_per_token: int | None = None  # packed formats (fp8_ds_mla: 656 B; indexer: fp8 key + scales)
    role: Literal["kv", "mla", "indexer"] = "kv"

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
    attention_rep: int = 0  # attention projections every TP rank holds whole (MLA's low-rank down-projections)
    kv_proj: dict[int, int] = Field(default_factory=dict)  # of ``attention``: K/V projections by KV head count
    mlp: int = 0  # dense MLPs and shared experts
    experts: int = 0  # routed experts (all of them)
    mixer: int = 0  # Mamba-2 / gated-delta-net projections
    small: int = 0  # norms, biases, routers, positions: kept in 16 bits and replicated
    towers: int = 0  # vision/audio encoders and projectors

    @property
    def total(self) -> int:
        return (self.embed + self.lm_head + self.attention + self.attention_rep + self.mlp + self.experts
                + self.mixer + self.small + self.towers)


# vllm/model_executor/layers/quantization/__init__.py::QuantizationMethods in vLLM 0.32 (no bitsandbytes:
# ModelConfig answers "Unknown quantization method: bitsandbytes").
VLLM_QUANTIZATION_METHODS = frozenset({
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
    "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only",
    "nvfp4_per_token", "mxfp8",
})

ROLES = ("embed", "lm_head", "attention", "attention_rep", "mlp", "experts", "mixer", "small", "towers")


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


def weights_by_role(counts: ParamCounts, quant: QuantScheme | None, dtype_bytes: int) -> dict[str, float]:
    """Bytes per role: quantized roles at the scheme's size, everything else in the compute dtype."""
    out: dict[str, float] = {}
    for role in ROLES:
        quantized = quant is not None and (role.removesuffix("_rep") in quant.quantized_roles)
        per = quant.bytes_per_param if quant is not None and quantized else dtype_bytes
        out[role] = getattr(counts, role) * per
    return out


class ModelProfile(BaseModel):
    """The planner's view of one model under the given vLLM kwargs (built once, by ``build.py``)."""

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
    family: str = "Family"  # the architecture family class that read the config (families/)
    attention_cls: str | None = None  # a user family (vllm_kwargs["hive_attention_cls"]) mixed into it
    notes: list[str] = Field(default_factory=list)

    _weights_by_role: dict[str, float] = PrivateAttr(default_factory=dict)
    _per_rank_cache: dict[tuple[str, int], int] = PrivateAttr(default_factory=dict)
    _custom_kv: Any = PrivateAttr(default=None)  # a user family that gives its own KV figures

    def model_post_init(self, context: Any) -> None:
        self._weights_by_role = weights_by_role(self.params, self.quant, self.dtype_bytes)

    @classmethod
    def assemble(cls, *, custom_kv: Any = None, **fields: Any) -> ModelProfile:
        """Build a profile whose KV figures come from a user family (``custom_kv``) when it gives them."""
        profile = cls(**fields)
        profile._custom_kv = custom_kv
        return profile

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
        """KV bytes one token costs on one rank, summed over all attention caches.

        GQA/MHA: 2 x max(1, kv_heads // tp) x head_dim x bytes per layer; MLA: one latent of
        (kv_lora_rank + qk_rope_head_dim) x bytes, not divided by TP (a sparse-MLA indexer
        adds its own replicated key per layer); sliding-window layers cost the same per token
        (their per-request total is what is bounded); layers that reuse another layer's
        cache, encoder-only models and recurrent state layers: 0 (the state is per request,
        see ``kv_pool_need``).
        """
        key = ("kv", tp)
        if key not in self._per_rank_cache:
            if self._custom_kv is not None:
                value = int(self._custom_kv.kv_bytes_per_token(tp))
            else:
                value = sum(g.num_layers * g.bytes_per_token_per_layer(tp, self.kv_elem_bytes)
                            for g in self.attention_groups)
            self._per_rank_cache[key] = value
        return self._per_rank_cache[key]

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
            w = self._weights_by_role
            vocab_rows = cdiv(round_up(self.vocab_size, 64), tp)
            embed_frac = vocab_rows / max(1, self.vocab_size)
            sharded = (w.get("mlp", 0) + w.get("experts", 0) + w.get("mixer", 0)) / tp
            sharded += w.get("attention", 0) * self._attention_share(tp)
            sharded += (w.get("embed", 0) + w.get("lm_head", 0)) * embed_frac
            towers = w.get("towers", 0)
            if not any(t.replicated for t in self.towers):
                towers /= tp
            self._per_rank_cache[key] = int(sharded + towers + w.get("small", 0) + w.get("attention_rep", 0))
        return self._per_rank_cache[key]

    def _attention_share(self, tp: int) -> float:
        """The share of the attention projections one rank holds: q/o split tp ways, K/V split over the
        KV heads, which vLLM replicates when there are fewer than ranks (QKVParallelLinear)."""
        total = self.params.attention
        if not total or tp <= 1:
            return 1.0 if tp <= 1 else 1.0 / tp
        kv = sum(self.params.kv_proj.values())
        per_rank = (total - kv) / tp + sum(n / min(tp, heads) for heads, n in self.params.kv_proj.items() if heads)
        return per_rank / total

    def tp_problem(self, tp: int) -> str | None:
        """Why vLLM cannot shard this model over ``tp`` ranks, or None when it can."""
        if tp <= 1:
            return None
        if self.num_attention_heads % tp:
            return (f"tensor_parallel_size={tp} does not divide the {self.num_attention_heads} "
                    "attention heads")
        for kv in sorted({g.num_kv_heads for g in self.attention_groups if not g.replicated} or
                         ({self.num_kv_heads} if not self.is_mla else set())):
            if kv and kv % tp and tp % kv:
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
        if self.state_groups and self.attention_groups and self._custom_kv is None:
            per_token = self.attention_groups[0].bytes_per_token_per_layer(tp, self.kv_elem_bytes)
            state = max(g.bytes_per_layer(tp) for g in self.state_groups)
            align = max(base, 128) if self.is_mla else base
            if per_token:
                base = max(base, align * cdiv(state, align * per_token))
        return base

    def kv_pool_need(self, max_model_len: int, tp: int, block_size: int, in_flight_tokens: int,
                     hybrid_manager: bool = True, prefix_caching: bool = True) -> tuple[int, int]:
        """(bytes one request of ``max_model_len`` tokens holds, bytes of one pool block).

        Mirrors vLLM 0.32's pool: layers of one kind form a bucket; buckets split into
        groups of equal layer count (the smallest bucket's, or the largest's when the
        counts are within 1.5x; padding layers are added); every group page is
        ``group_size x per-layer page``. A request holds, per group: full attention
        ``cdiv(L, block)`` blocks, sliding window ``cdiv(min(window-1+in_flight, L), block)+1``,
        chunked local attention ``cdiv(min(chunk+in_flight, L), block)`` (without the hybrid
        manager both hold every token, as vLLM promotes them to full attention),
        a recurrent state one block, or with prefix caching (on by default for generative
        hybrids: mamba_cache_mode "align") ``2 + checkpoint`` blocks, where Mamba-2 mixers
        keep one prefill checkpoint block (MambaSpec.max_memory_usage_bytes,
        MambaMixer2.get_kv_cache_spec). The pool keeps one extra (null) block back.

        Attention caches of different page sizes (per-layer head sizes, a sparse-MLA indexer)
        are counted the way ``unify_kv_cache_spec_page_size`` makes them fit one page: a
        smaller page whose size divides the largest takes ``ratio x block`` tokens per block,
        any other is padded to the largest page, so a request never holds less than vLLM's.
        """
        if self._custom_kv is not None:
            hook = self._custom_kv
            per_seq = hook.kv_bytes_per_sequence(max_model_len, tp, block_size)
            if per_seq is None:
                per_seq = cdiv(max_model_len, block_size) * block_size * self.kv_bytes_per_token(tp)
            return int(per_seq), block_size * self.kv_bytes_per_token(tp)

        buckets: list[tuple[int, int, int]] = []  # (layers, page bytes per layer, blocks per request)
        pages = [block_size * g.bytes_per_token_per_layer(tp, self.kv_elem_bytes) for g in self.attention_groups]
        uniform_type = all(g.kind == "full" for g in self.attention_groups)
        max_page = max(pages, default=0)
        for g, page in zip(self.attention_groups, pages):
            block = block_size
            if page and page != max_page and not uniform_type:
                if max_page % page == 0:
                    block, page = block_size * (max_page // page), max_page
                else:
                    page = max_page
            full_blocks = cdiv(max_model_len, block)
            if g.kind == "sliding" and g.sliding_window and hybrid_manager:
                tokens = min(g.sliding_window - 1 + in_flight_tokens, max_model_len)
                blocks = min(cdiv(tokens, block) + 1, full_blocks + 1)
            elif g.kind == "chunked" and g.attention_chunk_size and hybrid_manager:
                # ChunkedLocalAttentionSpec.max_admission_blocks_per_request: one chunk plus the
                # in-flight tokens, no extra block (a chunk starts on a chunk boundary)
                blocks = cdiv(min(g.attention_chunk_size + in_flight_tokens, max_model_len), block)
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
        if uniform_type and not self.state_groups:  # one group, every layer with its own page (UniformType)
            return sum(layers * page * blocks for layers, page, blocks in buckets), \
                sum(layers * page for layers, page, _ in buckets)
        counts = [b[0] for b in buckets]
        group_size = min(counts)
        if max(counts) < 1.5 * min(counts):
            group_size = max(counts)
        per_request = 0
        block_bytes = 0
        for layers, page, blocks in buckets:
            n_groups = cdiv(layers, group_size)
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
