"""LoRA on a base model: the memory vLLM 0.32 allocates for it, and whether an adapter fits the base. Pure.

Memory (``lora_memory``), read from vLLM 0.32's ``vllm/lora/``. With ``enable_lora`` the engine wraps
every LoRA-able module of every layer (``LoRAModelManager._create_lora_modules``: all linear layers,
``target_modules`` unset) and each wrapper allocates, once and for ``max_loras`` slots
(``lora_slots``), stacked A and B matrices at ``max_lora_rank`` in the model dtype
(``LoRAConfig.lora_dtype="auto"``), whatever adapters are loaded later
(``layers/base_linear.py``, ``layers/column_parallel_linear.py``, ``layers/row_parallel_linear.py``)::

    per slot, per layer, on one TP rank (r = max_lora_rank; q, kv, i = q heads x head_dim,
    kv heads x head_dim, intermediate size, each / TP; kv at least one head per rank):
      qkv_proj      3 slices: A 3 x (r x hidden)        B (q + 2 kv) x r     MergedQKVParallelLinearWithLoRA
      o_proj        row:      A r x q                   B hidden x r         RowParallelLinearWithLoRA
      gate_up_proj  2 slices: A 2 x (r x hidden)        B 2 i x r            MergedColumnParallelLinearWithLoRA
      down_proj     row:      A r x i                   B hidden x r         RowParallelLinearWithLoRA
      = r x (7 hidden + 2 q + 2 kv + 3 i)
    models whose vLLM class lists ``embedding_modules`` (``LORA_ARCHITECTURES``) also wrap
      embed_tokens  A vocab x r, B hidden x r            VocabParallelEmbeddingWithLoRA
      lm_head       A r x hidden, B vocab x r            LogitsProcessorWithLoRA
      (tied embeddings: the lm_head path wraps the shared embedding a second time)
    slots = max_loras x dtype bytes x (num_layers x per-layer + embeddings)

Punica buffers (``punica_wrapper/punica_base.py``, ``punica_gpu.py``, ``ops/triton_ops/lora_kernel_metadata.py``),
T = max_num_batched_tokens, S = max_num_seqs: four int64 index tensors of T and three of S on every
platform; on CUDA two ``LoRAKernelMeta`` of two int32 tensors of T and three of max_loras + 2; and the
float32 shrink buffer of the widest module while it runs (3 slices x T x r, ``add_lora_linear``).

CPU cache: each TP rank's worker keeps up to ``max_cpu_loras`` adapters loaded in host memory
(``LRUCacheWorkerLoRAManager``), each at most ``max_lora_rank`` on every module, unsharded. On a CPU
device that is the engine's own memory and is booked with it; on a GPU node it is host RAM, which
the registry does not book for running engines: the plan reports it.

CUDA graphs: with LoRA vLLM captures every batch size twice, with and without adapters
(``CompilationConfig.cudagraph_specialize_lora``, on by default): ``memory.Frame`` doubles the
per-graph term.

Which bases: generating models with the Llama-style module names, no MoE, MLA or recurrent layers
(``lora_problem``): the memory above is modelled for those only, and an adapter's target modules are
checked against those names. Anything else is refused with a 422 before it is planned.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.spec import LoraSpec

# architecture -> whether its vLLM 0.32 class lists ``embedding_modules`` (embed_tokens and lm_head get
# LoRA slots too). Read from vllm/model_executor/models/{llama,phi3,qwen3,granite,mistral,qwen2,gemma,gemma2}.py.
LORA_ARCHITECTURES: Final[dict[str, bool]] = {
    "LlamaForCausalLM": True, "Phi3ForCausalLM": True, "Qwen3ForCausalLM": True, "GraniteForCausalLM": True,
    "MistralForCausalLM": False, "Qwen2ForCausalLM": False, "GemmaForCausalLM": False, "Gemma2ForCausalLM": False,
}
# the modules an adapter may target, by their names in Hugging Face checkpoints (what PEFT writes)
ATTENTION_MODULES: Final = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: Final = ("gate_proj", "up_proj", "down_proj")
PACKED_MODULES: Final = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBEDDING_MODULES: Final = ("embed_tokens", "lm_head")
MAX_VOCAB_WITH_LORA: Final = 258048  # LogitsProcessorWithLoRA.create_lora_weights refuses more
INT64, INT32, FP32 = 8, 4, 4


class LoraMemory(BaseModel):
    """What LoRA adds to one engine, in bytes (``lora_memory``)."""

    slots_per_rank: int  # the A/B stacks of every wrapped module, on one TP rank
    punica_per_rank: int  # index tensors and the largest shrink buffer, on one TP rank
    cpu_cache: int  # the adapters every rank's worker keeps loaded, in host memory (all ranks)
    adapter_bytes: int  # one adapter of max_lora_rank on every module, unsharded (what a load reads)

    def on_device(self, ranks: int, on_cpu: bool) -> int:
        """Bytes on each device of the replica: slots and buffers of the ranks there (a CPU device
        holds every rank) and, on a CPU device, the CPU cache too."""
        return (self.slots_per_rank + self.punica_per_rank) * ranks + (self.cpu_cache if on_cpu else 0)


def lora_problem(profile: ModelProfile) -> str | None:
    """Why the hive cannot serve LoRA adapters on this model (None: it can)."""
    if profile.runner != "generate":
        return (f"{profile.architecture} runs as a pooling model; lora serves adapters on generating models only: "
                "drop lora")
    if profile.num_moe_layers or profile.is_mla or profile.state_groups or profile.encoder_only:
        what = ("MoE experts" if profile.num_moe_layers else "MLA attention" if profile.is_mla
                else "recurrent layers" if profile.state_groups else "an encoder-only stack")
        return (f"the planner does not model LoRA memory for {profile.architecture}'s {what}; lora is planned for "
                f"dense attention models ({', '.join(sorted(LORA_ARCHITECTURES))}): drop lora")
    if profile.architecture not in LORA_ARCHITECTURES:
        return (f"the planner models LoRA for {', '.join(sorted(LORA_ARCHITECTURES))}, not {profile.architecture}: "
                "drop lora")
    if LORA_ARCHITECTURES[profile.architecture] and profile.vocab_size > MAX_VOCAB_WITH_LORA:
        return f"vLLM refuses LoRA on a vocabulary over {MAX_VOCAB_WITH_LORA} (this one has {profile.vocab_size})"
    return None


def _dims(profile: ModelProfile, tp: int) -> tuple[int, int, int, int]:
    """(hidden, q, kv, intermediate) on one TP rank; KV heads replicated when TP exceeds them, as vLLM does."""
    p = profile
    q = p.num_attention_heads * p.head_dim // tp
    kv = max(1, p.num_kv_heads // tp) * p.head_dim
    return p.hidden_size, q, kv, p.intermediate_size // tp


def slot_elements(profile: ModelProfile, rank: int, tp: int = 1) -> int:
    """Elements of one LoRA slot (every wrapped module, A and B at ``rank``) on one TP rank."""
    h, q, kv, i = _dims(profile, tp)
    per_layer = rank * (7 * h + 2 * q + 2 * kv + 3 * i)
    total = profile.num_layers * per_layer
    if LORA_ARCHITECTURES.get(profile.architecture, False):
        embed = rank * (profile.vocab_size + h)  # embed_tokens: A vocab x r, B hidden x r (not sharded)
        logits = rank * (h + profile.vocab_size)  # lm_head: A r x hidden, B vocab x r
        total += embed + logits + (embed if profile.tie_word_embeddings else 0)
    return total


def punica_bytes(max_loras: int, rank: int, tokens: int, seqs: int, on_cpu: bool) -> int:
    """The punica wrapper's buffers on one rank, and the largest shrink buffer while a module runs."""
    base = 4 * tokens * INT64 + 3 * seqs * INT64
    meta = 0 if on_cpu else 2 * (2 * tokens * INT32 + (2 * (max_loras + 1) + (max_loras + 2)) * INT32)
    shrink = 3 * tokens * rank * FP32
    return base + meta + shrink


def lora_memory(profile: ModelProfile, lora: LoraSpec, *, tp: int, tokens: int, seqs: int, on_cpu: bool) -> LoraMemory:
    """The memory ``lora`` adds to one engine of ``profile`` (module docstring: the formula and its source)."""
    dtype = profile.dtype_bytes
    rank = lora.max_lora_rank
    adapter = slot_elements(profile, rank, 1) * dtype
    return LoraMemory(slots_per_rank=lora.max_loras * slot_elements(profile, rank, tp) * dtype,
                      punica_per_rank=punica_bytes(lora.max_loras, rank, tokens, seqs, on_cpu),
                      cpu_cache=tp * lora.cpu_loras * adapter, adapter_bytes=adapter)


# --- adapters ----------------------------------------------------------------------------------------


class AdapterError(Exception):
    """An adapter the base cannot serve: ``status_code`` is the admin's answer (422 unless said)."""

    def __init__(self, message: str, status_code: int = 422, field: str = "source"):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.field = field  # the body field of POST /admin/adapters the problem is about


class AdapterConfig(BaseModel):
    """The fields of a PEFT ``adapter_config.json`` that vLLM 0.32 reads (``lora/peft_helper.py``)."""

    model_config = ConfigDict(extra="ignore")

    peft_type: str = "LORA"
    r: int = Field(gt=0)
    lora_alpha: float = 8
    target_modules: list[str] | str
    base_model_name_or_path: str | None = None
    bias: str = "none"
    modules_to_save: list[str] | None = None
    use_dora: bool = False
    lora_bias: bool = False
    rank_pattern: dict[str, int] = Field(default_factory=dict)

    @field_validator("rank_pattern", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return v or {}

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])


class AdapterInfo(BaseModel):
    """What the admin keeps of an adapter that fits its base."""

    rank: int
    alpha: float
    target_modules: list[str]  # module names (HF), sorted
    base_model_name: str | None = None
    bytes: int  # of its safetensors tensors


def parse_adapter_config(raw: bytes) -> AdapterConfig:
    """``adapter_config.json`` read, or an ``AdapterError`` that says what is malformed."""
    import json

    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise AdapterError(f"adapter_config.json is malformed: not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise AdapterError("adapter_config.json is malformed: not a JSON object")
    try:
        return AdapterConfig.model_validate(body)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise AdapterError(f"adapter_config.json is malformed: {problems}") from None


def base_modules(profile: ModelProfile) -> dict[str, tuple[int, int]]:
    """The modules of the base an adapter may target, by HF name: (in_features, out_features), unsharded."""
    p = profile
    h, q, kv, i = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
              "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}
    if LORA_ARCHITECTURES.get(p.architecture, False):
        shapes |= {"embed_tokens": (p.vocab_size, h), "lm_head": (h, p.vocab_size)}
    return shapes


def _full_names(profile: ModelProfile) -> Iterable[str]:
    """Every targetable module's full name, as PEFT matches a string ``target_modules`` against them."""
    for layer in range(profile.num_layers):
        for m in ATTENTION_MODULES:
            yield f"model.layers.{layer}.self_attn.{m}"
        for m in MLP_MODULES:
            yield f"model.layers.{layer}.mlp.{m}"
    if LORA_ARCHITECTURES.get(profile.architecture, False):
        yield "model.embed_tokens"
        yield "lm_head"


def targeted(config: AdapterConfig, profile: ModelProfile) -> list[str]:
    """The module names the adapter targets; ``AdapterError`` naming those the base does not have."""
    known = base_modules(profile)
    if isinstance(config.target_modules, str):
        if config.target_modules == "all-linear":
            return sorted(m for m in known if m not in EMBEDDING_MODULES and m not in PACKED_MODULES)
        try:
            pattern = re.compile(config.target_modules)
        except re.error as e:
            raise AdapterError(f"adapter_config.json is malformed: target_modules {config.target_modules!r} is "
                               f"not a regular expression ({e})") from None
        hits = sorted({n.rsplit(".", 1)[-1] for n in _full_names(profile) if pattern.fullmatch(n)})
        if not hits:
            raise AdapterError(f"target_modules {config.target_modules!r} matches no module of the base "
                               f"({profile.architecture}); it has {', '.join(_module_list(profile))}")
        return hits
    names = sorted({m.rsplit(".", 1)[-1] for m in config.target_modules})
    unknown = [m for m in names if m not in known]
    if unknown:
        raise AdapterError(f"target modules {unknown} are not modules of the base ({profile.architecture}) that "
                           f"vLLM serves LoRA on; it has {', '.join(_module_list(profile))}")
    return names


def _module_list(profile: ModelProfile) -> list[str]:
    return [m for m in base_modules(profile) if m not in PACKED_MODULES]


# "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight": the module's path, and which half;
# an embedding's halves are parameters (PEFT: "...embed_tokens.lora_embedding_A", no ".weight")
_TENSOR = re.compile(r"^(.+)\.lora_(A|B|embedding_A|embedding_B)(?:\.weight)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FAMILIES: Final = ("llama", "qwen", "mistral", "mixtral", "gemma", "phi", "granite", "falcon", "gpt", "opt",
                    "bloom", "deepseek", "olmo", "starcoder", "baichuan", "internlm", "yi", "command", "cohere")


def _family_words(text: str) -> set[str]:
    """The model families a name's words name: "Meta-Llama-3.1-8B" -> llama, "Qwen3-0.6B" -> qwen."""
    words = set(re.split(r"[^a-z0-9]+", text.lower()))
    return {f for f in _FAMILIES for w in words if re.fullmatch(rf"{f}\d*[a-z]?", w)}


def base_name_problem(adapter_base: str | None, base_names: Iterable[str]) -> str | None:
    """The adapter's ``base_model_name_or_path`` compared loosely with the base: a problem only when it
    names a model family (llama, qwen, ...) that nothing about the base names (its source, architecture,
    model type). Renamed or local bases pass; the shapes are the strict check."""
    if not adapter_base:
        return None
    theirs = _family_words(adapter_base.rsplit("/", 1)[-1]) or _family_words(adapter_base)
    ours = set().union(*(_family_words(n) for n in base_names))
    if theirs and not theirs & ours:
        return (f"the adapter was made for {adapter_base!r} ({', '.join(sorted(theirs))}), and the base is "
                f"{', '.join(n for n in base_names if n)}: deploy it on a base of that family")
    return None


def check_adapter(config: AdapterConfig, tensors: dict[str, tuple[int, ...]], profile: ModelProfile,
                  lora: LoraSpec | None, base_names: Iterable[str] = ()) -> AdapterInfo:
    """Whether the adapter (its config and its tensors' shapes) fits this base under its ``lora``; the
    adapter's figures, or an ``AdapterError`` naming the first thing that does not fit and how to fix it."""
    if lora is None:
        raise AdapterError("the base was deployed without lora; deploy it with lora: {max_loras, max_lora_rank} "
                           "(PUT /admin/models/{id}?recreate=true) to serve adapters on it", field="base")
    problem = lora_problem(profile)
    if problem:
        raise AdapterError(problem, field="base")
    if config.peft_type.upper() != "LORA":
        raise AdapterError(f"adapter_config.json: peft_type {config.peft_type!r} is not a LoRA adapter (LORA)")
    unsupported = [why for cond, why in [
        (config.use_dora, "DoRA (use_dora)"), (config.lora_bias, "LoRA bias (lora_bias)"),
        (config.bias != "none", f"bias={config.bias!r}"),
        (bool(config.modules_to_save), f"modules_to_save={config.modules_to_save}")] if cond]
    if unsupported:
        raise AdapterError(f"adapter_config.json asks for what vLLM does not serve: {', '.join(unsupported)}")
    if config.max_rank > lora.max_lora_rank:
        raise AdapterError(f"the adapter's rank {config.max_rank} is above the base's max_lora_rank="
                           f"{lora.max_lora_rank}; redeploy the base with lora.max_lora_rank >= {config.max_rank}")
    names = targeted(config, profile)
    name_problem = base_name_problem(config.base_model_name_or_path, base_names)
    if name_problem:
        raise AdapterError(name_problem)
    if not tensors:
        raise AdapterError("adapter_model.safetensors holds no tensors")
    shapes = base_modules(profile)
    seen: set[str] = set()
    for tensor, shape in sorted(tensors.items()):
        m = _TENSOR.match(tensor)
        if m is None:
            raise AdapterError(f"tensor {tensor!r} of adapter_model.safetensors is not a LoRA weight "
                               "(<module>.lora_A.weight / <module>.lora_B.weight)")
        path, half = m.group(1), m.group(2)
        module = path.rsplit(".", 1)[-1]
        layer_match = _LAYER.search(path + ".")
        layer = layer_match.group(1) if layer_match else None
        if module not in shapes:
            raise AdapterError(f"the adapter has weights for {module!r} ({tensor}), which is not a module of the base "
                               f"({profile.architecture}); it has {', '.join(_module_list(profile))}")
        if layer is not None and int(layer) >= profile.num_layers:
            raise AdapterError(f"the adapter has layer {layer} ({tensor}); the base has {profile.num_layers} layers: "
                               "it was made for another base")
        seen.add(module)
        fan_in, fan_out = shapes[module]
        rank, want = _rank_and_want(half, shape, fan_in, fan_out)
        if len(shape) != 2 or shape != want:
            raise AdapterError(
                f"{tensor} is {list(shape)}, the base ({profile.architecture}, hidden_size={profile.hidden_size}) "
                f"needs {list(want)} for {module}: the adapter was made for another base")
        if rank > lora.max_lora_rank:
            raise AdapterError(f"{tensor} has rank {rank}, above the base's max_lora_rank={lora.max_lora_rank}; "
                               f"redeploy the base with lora.max_lora_rank >= {rank}")
    size = sum(_elements(s) for s in tensors.values()) * profile.dtype_bytes
    return AdapterInfo(rank=config.max_rank, alpha=config.lora_alpha, target_modules=sorted(seen or set(names)),
                       base_model_name=config.base_model_name_or_path, bytes=size)


def _rank_and_want(half: str, shape: tuple[int, ...], fan_in: int, fan_out: int) -> tuple[int, tuple[int, ...]]:
    """The tensor's rank and the shape the base needs for it: A is [r, in], B is [out, r]; an embedding's
    lora_embedding_A is [r, vocab] and lora_embedding_B [hidden, r] (PEFT's layout)."""
    if half in ("A", "embedding_A"):
        rank = shape[0] if shape else 0
        return rank, (rank, fan_in)
    rank = shape[-1] if shape else 0
    return rank, (fan_out, rank)


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
