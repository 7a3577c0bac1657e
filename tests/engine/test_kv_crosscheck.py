"""The planner's KV figures against vLLM 0.32's own KV-spec code, on every fixture config.

Lives in the engine tier because importing vLLM's config layer takes ~11 s. CPU is enough:
nothing is allocated and no model is built. For every folder in tests/fixtures/model_configs
and every TP size the model can be sharded over (1, 2, 8, 16 where the heads divide), vLLM
computes:

* heads / head size / layer counts / MLA / attention type with ``vllm.config.ModelConfig``
  (``get_num_kv_heads`` replicates KV heads when TP > KV heads, ``get_head_size``,
  ``get_num_layers_by_block_type``, ``use_mla``, ``attn_type``) and the KV dtype with
  ``resolve_kv_cache_dtype_string`` / ``kv_cache_dtype_str_to_dtype`` (ModelOpt checkpoints
  ask for fp8 there);
* bytes per token and page sizes with the spec classes of ``vllm/v1/kv_cache_interface.py``:
  ``FullAttentionSpec``, ``ChunkedLocalAttentionSpec`` (Llama 4's RoPE layers), ``SlidingWindowSpec`` (page size and per-request
  ``max_memory_usage_bytes`` against a real ``VllmConfig``), ``MLAAttentionSpec``
  (replicated latent, ``fp8_ds_mla`` packed format);
* recurrent state bytes per request with the model class's own classmethods
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` and
  ``MambaSpec.page_size_bytes`` (Nemotron-H Mamba-2, Qwen3-Next gated delta net), the pages a
  request holds with prefix caching (``MambaSpec.max_memory_usage_bytes`` in "align" mode), and
  the hybrid block size with ``Platform._align_hybrid_block_size`` for the CUDA
  FlashAttention backend;
* encoder-only models (BERT, XLM-RoBERTa): ``attn_type == "encoder_only"``, no KV cache.

The project's figure must agree to the byte. ``kv_cache_dtype="fp8"`` is checked on a dense,
a sliding-window, an MLA and a hybrid model; ``fp8_ds_mla`` on DeepSeek-V3.

What vLLM cannot compute here, and how it is covered instead:

* ``ModelConfig`` of the multimodal fixtures (Qwen2.5-VL-3B/7B, gemma-3-27b-it,
  llava-1.5-7b-hf, qwen2-audio-transformers-defaults): building it inspects the model
  class, whose module imports the Hugging Face image/audio processors, which import
  torchvision — not installed in this CPU venv (research note §0). Their language model's
  KV is computed with vLLM's ``ModelArchConfigConvertor`` on the same config (what
  ``ModelConfig`` delegates to), ``ModelConfig.get_num_kv_heads`` (called on that arch
  config) and the same spec classes.
* vLLM's multimodal token counts (``Qwen2VLProcessingInfo``, ``Gemma3ProcessingInfo``,
  ``BaseLlavaProcessingInfo``, ``Gemma4ProcessingInfo``, ``Mllama4ProcessingInfo``): the same torchvision
  import blocks ``qwen2_vl.py``, ``gemma3_mm.py``, ``llava.py``, ``gemma4_mm.py`` and ``mllama4.py``; the
  planner's arithmetic is unit-tested by hand from those files instead (tests/unit/core/
  test_planning_multimodal.py). Gemma 4 and Llama 4 Scout are still built here, language model only, as
  their wrappers build it (``LANGUAGE_MODEL_ONLY``); their towers' weights are unit-tested by hand. Qwen2-Audio's ``get_mm_max_tokens_per_item`` *is*
  called below (its module imports no torchvision).
* ``ModelConfig`` of community__Llama-3.1-8B-Instruct-bnb-int8: vLLM 0.32 has no
  ``bitsandbytes`` quantization method any more ("Unknown quantization method: bitsandbytes"),
  so it refuses the config; its KV goes through the convertor path like the multimodal ones
  (and the planner refuses bitsandbytes checkpoints for the real vLLM engine).
* The block pool grouping of hybrid models (``_get_kv_cache_groups_uniform_page_size``)
  needs the per-layer specs of a built model; only its inputs (pages, blocks per request)
  are cross-checked.

Besides, vLLM's own model is built on the meta device for every fixture it can build on CPU (no
memory, no kernels; one process standing in for rank 0 of ``tp`` ranks) and compared layer by
layer: every attention layer's ``get_kv_cache_spec`` (shared-KV layers skipped, as the runner
does), the recurrent states, the parameter count, and for sliding, per-layer and shared layouts
vLLM's block pool for one request (``get_kv_cache_groups``). This is what checks the family rules
that only show in the layers: MLA-shaped configs vLLM runs as plain attention (MiniCPM3), a side
quantization file vLLM ignores, Gemma 4's per-layer configs, Gemma 3n's list-valued fields,
Nemotron-NAS block configs. Sparse MLA (no CPU backend) is checked with vLLM's own ``Indexer`` and
MLA spec; the vLLM registry snapshot the planner refuses dropped architectures with is compared to
vLLM's registry.

The oracle follows the GPU layout the planner plans for, never this host's CPU kernels: every test
runs on both of vLLM's x86 CPU paths (AMX, and AVX-512 without AMX) by patching torch's CPU feature
checks, whatever this host has (``CPU_PATHS``).

Run ``python tests/engine/test_kv_crosscheck.py`` to print the table of KV bytes per token,
project vs vLLM, for every fixture; ``--registry`` rewrites hive_apps/core/planning/profile/vllm_registry.py
from the installed vLLM.
"""

from __future__ import annotations

import os
import sys
from functools import cache

import pytest

if __name__ == "__main__":  # table mode: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.unit.planning_fixtures import FIXTURES, fixture_path, profile  # noqa: E402

pytestmark = pytest.mark.engine

ALL_NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
REFUSED = {"meta-llama__Llama-3.2-11B-Vision-Instruct"}  # vLLM 0.32 dropped the architecture: no KV to compare
# The synthetic family fixtures need the per-layer view (MiniCPM3's q/k head size, Gemma 4's per-layer
# configs, Nemotron-NAS blocks, the sparse-MLA indexer), which only vLLM's built layers give: they are
# checked below by the built-model tests, not by the ModelConfig-level ones.
# Real configs whose layers differ in heads or head sizes (Gemma 4's global layers, MiMo-V2's sliding layers and
# separate V head size): ModelConfig's one head size cannot describe them, so they too are checked by the
# built-model tests only.
PER_LAYER = {"google__gemma-4-31B-it", "XiaomiMiMo__MiMo-V2-Flash"}
NAMES = [n for n in ALL_NAMES if n not in REFUSED and not n.startswith("synthetic__") and n not in PER_LAYER]
MULTIMODAL = {"Qwen__Qwen2.5-VL-3B-Instruct", "Qwen__Qwen2.5-VL-7B-Instruct", "google__gemma-3-27b-it",
              "llava-hf__llava-1.5-7b-hf", "qwen2-audio-transformers-defaults", "google__gemma-4-31B-it",
              "meta-llama__Llama-4-Scout-17B-16E-Instruct"}
# Multimodal wrappers whose language model vLLM builds with an architecture of its own (gemma4_mm.py:
# init_vllm_registered_model(..., architectures=["Gemma4ForCausalLM"]); mllama4.py: Llama4ForCausalLM on
# config.text_config): built here from their text_config alone, as the wrapper builds it (the wrappers'
# modules import the HF image processors, which need torchvision).
LANGUAGE_MODEL_ONLY = {"google__gemma-4-31B-it": "Gemma4ForCausalLM",
                       "meta-llama__Llama-4-Scout-17B-16E-Instruct": "Llama4ForCausalLM"}
NO_MODEL_CONFIG = MULTIMODAL | {"community__Llama-3.1-8B-Instruct-bnb-int8"}  # see the module docstring
TPS = (1, 2, 8, 16)
BLOCK = 16
FP8_CASES = [("meta-llama__Llama-3.1-8B", "fp8"), ("google__gemma-2-9b", "fp8"),
             ("deepseek-ai__DeepSeek-V2-Lite", "fp8"), ("nvidia__Nemotron-H-56B-Base-8K", "fp8"),
             ("deepseek-ai__DeepSeek-V3", "fp8_ds_mla")]


# ---- vLLM side -----------------------------------------------------------------------------


def _inspect_in_process() -> object:
    """vLLM inspects each architecture in a fresh subprocess (~13 s each here, to keep CUDA out of
    the parent) unless ~/.cache/vllm/modelinfos has it. There is no CUDA on this path, so inspect
    in-process: the same code, seconds instead of minutes on a cold cache. Returns the original."""
    import vllm.config  # noqa: F401
    import vllm.model_executor.models.registry as registry

    original = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    return original


# vLLM's CPU platform picks kernels, block sizes and state dtypes by what the host CPU has
# (``torch.cpu._is_amx_tile_supported`` / ``_is_avx512_bf16_supported``): the MLA block size, the MXFP4
# MoE experts (AMX only), the GDN state dtype. Every test here runs once on each x86 path, whatever
# this host has, so a check that holds on one path only fails on every machine, not on some.
CPU_PATHS = {"amx": (True, True),  # Intel Sapphire Rapids and later: AMX tiles and AVX512-BF16
             "avx512": (False, True)}  # AMD Zen 4/5 (no AMX), AVX512-BF16


@pytest.fixture(scope="module", params=sorted(CPU_PATHS), autouse=True)
def cpu_path(request):
    import torch

    amx, avx512_bf16 = CPU_PATHS[request.param]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        mp.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        yield request.param


def test_the_cpu_path_is_the_one_patched(cpu_path):
    """vLLM asks torch each time, so the patch decides the path (the MLA block-size rule shows it)."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    mc = _model_config("deepseek-ai__DeepSeek-V2-Lite")
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=64),
                    scheduler_config=SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048,
                                                     is_encoder_decoder=False))
    assert vc.cache_config.block_size == (64 if cpu_path == "amx" else 16)


@pytest.fixture(scope="module", autouse=True)
def _in_process_inspection():
    import vllm.model_executor.models.registry as registry

    original = _inspect_in_process()
    yield
    registry._run_in_subprocess = original


@cache
def _model_config(name: str, kv_cache_dtype: str = "auto"):
    """vLLM's ModelConfig, or None for the multimodal fixtures (see the module docstring)."""
    import vllm.config  # noqa: F401  (resolves circular imports in the config layer)
    from vllm.config import ModelConfig

    if name in NO_MODEL_CONFIG:
        return None
    folder = fixture_path(name)
    return ModelConfig(model=folder, tokenizer=folder, skip_tokenizer_init=True)


@cache
def _arch(name: str):
    """ModelArchConfigConvertor output for a config ModelConfig cannot be built for."""
    import vllm.config  # noqa: F401
    from transformers import AutoConfig
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    cfg = AutoConfig.from_pretrained(fixture_path(name), local_files_only=True)
    text = cfg.get_text_config()
    arch = MODEL_ARCH_CONFIG_CONVERTORS.get(cfg.model_type, ModelArchConfigConvertorBase)(cfg, text).convert()
    return cfg, text, arch


def _vllm_config(mc, tp: int, kv_cache_dtype: str = "auto", max_num_batched_tokens: int = 2048):
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig

    mc.config_updated = False  # the model-specific hooks (e.g. NemotronH's fp32 SSM state) update each CacheConfig
    return VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      cache_config=CacheConfig(block_size=BLOCK, cache_dtype=kv_cache_dtype),
                      scheduler_config=SchedulerConfig(max_model_len=mc.max_model_len,
                                                       max_num_batched_tokens=max_num_batched_tokens,
                                                       is_encoder_decoder=False))


def _sliding_layer(mc_or_text, arch_name: str, i: int) -> bool:
    """Which layers vLLM's model code builds with a per-layer sliding window.

    gpt_oss.py: every even layer; gemma2.py / gemma3.py / llama.py: ``layer_types[i] ==
    "sliding_attention"``. Other fixtures have no sliding layers.
    """
    text = getattr(mc_or_text, "hf_text_config", mc_or_text)
    if arch_name.startswith("GptOss"):
        return i % 2 == 0
    types = getattr(text, "layer_types", None) or []
    return i < len(types) and types[i] == "sliding_attention" and bool(getattr(text, "sliding_window", None))


def _chunked_layer(text, i: int) -> bool:
    """llama4.py Llama4Attention: a RoPE layer (``no_rope_layers[i] != 0``) with an attention chunk size
    uses ChunkedLocalAttention."""
    rope = getattr(text, "no_rope_layers", None)
    return bool(getattr(text, "attention_chunk_size", None)) and bool(rope) and rope[i] != 0


class VllmKv:
    """What vLLM's own code says for one fixture at one TP size."""

    def __init__(self, name: str, tp: int, kv_cache_dtype: str = "auto") -> None:
        import torch
        from vllm.config import ModelConfig, ParallelConfig
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype, resolve_kv_cache_dtype_string
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
            get_kv_quant_mode,
        )

        pc = ParallelConfig(tensor_parallel_size=tp)
        mc = _model_config(name)
        self.mc = mc
        self.encoder_only = False
        self.state_per_request = 0
        self.specs = []  # one spec per attention layer
        if mc is not None:
            if mc.attn_type == "encoder_only":
                self.encoder_only = True
                return
            cache_str = resolve_kv_cache_dtype_string(kv_cache_dtype, mc)
            dtype = kv_cache_dtype_str_to_dtype(cache_str, mc)
            heads, head_size, use_mla = mc.get_num_kv_heads(pc), mc.get_head_size(), mc.use_mla
            arch_name = mc.architecture
            n_layers = mc.get_num_layers(pc)
            text = mc.hf_text_config
            pattern = getattr(text, "hybrid_override_pattern", None)
            if mc.is_hybrid and pattern:  # nemotron_h.py builds layer i from hybrid_override_pattern[i]
                attn_idx = [i for i, c in enumerate(pattern) if c == "*"]
            elif mc.is_hybrid:  # Qwen3-Next: attention layers by layer_types
                attn_idx = [i for i, t in enumerate(text.layer_types) if t in ("full_attention", "attention")]
                assert len(attn_idx) == mc.get_num_layers_by_block_type(pc, "attention")
            else:
                attn_idx = list(range(n_layers))
            window = mc.get_sliding_window()
        else:
            cfg, text, arch = _arch(name)
            cache_str = kv_cache_dtype if kv_cache_dtype != "auto" else "auto"
            model_dtype = getattr(text, "dtype", None) or getattr(cfg, "dtype", None) or torch.bfloat16
            if model_dtype == torch.float32:
                model_dtype = torch.bfloat16  # ModelConfig dtype="auto" for a generative fp32 checkpoint
            dtype = model_dtype if cache_str == "auto" else kv_cache_dtype_str_to_dtype(cache_str, None)
            use_mla = False
            fake = type("ArchOnly", (), {"use_mla": False, "model_arch_config": arch})()
            heads = ModelConfig.get_num_kv_heads(fake, pc)  # vLLM's own replication rule
            head_size = arch.head_size
            arch_name = (cfg.architectures or [""])[0]
            attn_idx = list(range(arch.total_num_hidden_layers))
            window = getattr(text, "sliding_window", None)
        quant_mode = get_kv_quant_mode(cache_str)
        for i in attn_idx:
            if use_mla:  # MLAAttention.get_kv_cache_spec
                spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=head_size,
                                        dtype=dtype, cache_dtype_str=cache_str, kv_quant_mode=quant_mode,
                                        state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cache_str))
            elif _chunked_layer(text, i):  # ChunkedLocalAttention.get_kv_cache_spec
                spec = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size,
                                                 dtype=dtype, kv_quant_mode=quant_mode,
                                                 attention_chunk_size=text.attention_chunk_size)
            elif window and _sliding_layer(mc if mc is not None else text, arch_name, i):  # Attention.get_kv_cache_spec
                spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size,
                                         head_size_v=head_size, dtype=dtype, kv_quant_mode=quant_mode,
                                         sliding_window=window)
            else:
                spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size,
                                         head_size_v=head_size, dtype=dtype, kv_quant_mode=quant_mode)
            self.specs.append(spec)
        if mc is not None and mc.is_hybrid:
            self._states(mc, tp, kv_cache_dtype)

    def _states(self, mc, tp: int, kv_cache_dtype: str) -> None:
        from vllm.model_executor.models import ModelRegistry
        from vllm.v1.kv_cache_interface import MambaSpec

        vc = _vllm_config(mc, tp, kv_cache_dtype)
        cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        shapes = cls.get_mamba_state_shape_from_config(vc)
        dtypes = cls.get_mamba_state_dtype_from_config(vc)
        from vllm.config import ParallelConfig

        pc = ParallelConfig(tensor_parallel_size=tp)  # noqa: F841 (Qwen3-Next layer count below)
        pattern = getattr(mc.hf_text_config, "hybrid_override_pattern", None)
        if pattern:  # Nemotron-H: 'M' layers are Mamba-2 mixers
            kind, layers = "mamba", pattern.count("M")
        else:  # Qwen3-Next: gated delta net layers
            kind, layers = "linear_attention", mc.get_num_layers_by_block_type(pc, "linear_attention")
        self.state_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
        self.state_per_request = layers * self.state_page
        # prefix caching ("align"): MambaMixer2 adds one prefill checkpoint block, GDN does not
        checkpoints = 1 if kind == "mamba" else 0
        spec = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=BLOCK, mamba_cache_mode="align",
                         num_prefill_checkpoint_blocks=checkpoints)
        vc.cache_config.mamba_cache_mode = "align"
        self.state_pages_per_request = spec.max_memory_usage_bytes(vc) // spec.page_size_bytes
        self.block_size = _hybrid_block_size(vc)

    @property
    def bytes_per_token(self) -> int:
        return sum(s.page_size_bytes // BLOCK for s in self.specs)


def _hybrid_block_size(vc) -> int:
    """Platform._align_hybrid_block_size for the CUDA FlashAttention backend, starting from block 16."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    class _CudaLike(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):  # needs built layers; the CUDA default backend
            return [FlashAttentionBackend]

    vc.cache_config.block_size = BLOCK
    _CudaLike._align_hybrid_block_size(vc, FlashAttentionBackend)
    return vc.cache_config.block_size


def _tps(name: str) -> list[int]:
    p = profile(name)
    return [tp for tp in TPS if p.tp_problem(tp) is None]


CASES = [(name, tp) for name in NAMES for tp in _tps(name)]


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("name,tp", CASES)
def test_kv_bytes_per_token_match_vllm(name, tp):
    v = VllmKv(name, tp)
    p = profile(name)
    assert p.kv_bytes_per_token(tp) == v.bytes_per_token
    if v.encoder_only:
        assert p.encoder_only and p.kv_bytes_per_token(tp) == 0 and not p.attention_groups
    # every group's page equals the page of vLLM's spec for those layers
    pages = sorted({s.page_size_bytes for s in v.specs})
    ours = sorted({BLOCK * g.bytes_per_token_per_layer(tp, p.kv_elem_bytes) for g in p.attention_groups})
    assert ours == pages


@pytest.mark.parametrize("name,kv_dtype", FP8_CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_kv_cache_matches_vllm(name, kv_dtype, tp):
    v = VllmKv(name, tp, kv_dtype)
    assert profile(name, kv_cache_dtype=kv_dtype).kv_bytes_per_token(tp) == v.bytes_per_token


@pytest.mark.parametrize("name", ["google__gemma-2-9b", "google__gemma-3-1b-it", "openai__gpt-oss-20b"])
@pytest.mark.parametrize("max_model_len,tokens", [(8192, 2048), (2048, 512), (700, 256)])
def test_sliding_window_requests_match_vllm(name, max_model_len, tokens):
    """SlidingWindowSpec.max_memory_usage_bytes against the planner's pool for one request."""
    from vllm.config import ModelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    folder = fixture_path(name)
    mc = ModelConfig(model=folder, tokenizer=folder, skip_tokenizer_init=True, max_model_len=max_model_len)
    vc = _vllm_config(mc, 1, max_num_batched_tokens=tokens)
    v = VllmKv(name, 1)
    sliding = [s for s in v.specs if isinstance(s, SlidingWindowSpec)]
    full = [s for s in v.specs if not isinstance(s, SlidingWindowSpec)]
    assert sliding and all(isinstance(s, FullAttentionSpec) for s in full)
    p = profile(name)
    in_flight = vc.max_in_flight_tokens
    ours = {g.kind: g for g in p.attention_groups}
    # per layer: blocks one request holds x page, as vLLM sizes it
    s_vllm = sliding[0].max_memory_usage_bytes(vc)
    page = BLOCK * ours["sliding"].bytes_per_token_per_layer(1, p.kv_elem_bytes)
    blocks = min(-(-min(ours["sliding"].sliding_window - 1 + in_flight, max_model_len) // BLOCK) + 1,
                 -(-max_model_len // BLOCK) + 1)
    assert s_vllm == blocks * page
    if full:
        assert full[0].max_memory_usage_bytes(vc) == -(-max_model_len // BLOCK) * page
    # and the planner's whole-request figure is the per-group sum of exactly those blocks
    per_request, _ = p.kv_pool_need(max_model_len, 1, BLOCK, in_flight)
    layers_sliding, layers_full = len(sliding), len(full)
    counts = [c for c in (layers_full, layers_sliding) if c]
    group = min(counts) if max(counts) >= 1.5 * min(counts) else max(counts)
    expected = sum(-(-c // group) * group * m for c, m in
                   ((layers_sliding, s_vllm), (layers_full, full[0].max_memory_usage_bytes(vc) if full else 0)) if c)
    assert per_request == expected


@pytest.mark.parametrize("name", ["nvidia__Nemotron-H-56B-Base-8K", "Qwen__Qwen3-Next-80B-A3B-Thinking"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_recurrent_state_matches_vllm(name, tp, monkeypatch):
    """vLLM's general rule, as on a GPU. vLLM 0.32's CPU platform alone, on a CPU with
    AVX512-BF16 (this CI machine), stores a GDN model's SSM state in float32 unless the deploy
    sets mamba_ssm_cache_dtype; the planner does not model that CPU-only override (so a CPU
    deploy of Qwen3-Next there is under-reserved: noted for the planner work)."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    p = profile(name)
    if p.tp_problem(tp):
        pytest.skip(p.tp_problem(tp))
    v = VllmKv(name, tp)
    assert p.state_bytes_per_sequence(tp) == v.state_per_request
    assert max(g.bytes_per_layer(tp) for g in p.state_groups) == v.state_page
    assert p.block_size(on_cpu=False, tp=tp) == v.block_size
    blocks = {g.kind: (2 + (1 if g.kind == "mamba2" else 0)) for g in p.state_groups}
    assert set(blocks.values()) == {v.state_pages_per_request}


def test_qwen2_audio_tokens_match_vllm():
    """Qwen2AudioProcessingInfo.get_mm_max_tokens_per_item with the Whisper feature extractor defaults."""
    from transformers import WhisperFeatureExtractor
    from vllm.model_executor.models.qwen2_audio import Qwen2AudioProcessingInfo

    class _Info(Qwen2AudioProcessingInfo):
        def __init__(self):  # no processing context: only the feature extractor is read
            pass

        def get_feature_extractor(self, **kwargs):
            return WhisperFeatureExtractor()

    vllm_tokens = _Info().get_mm_max_tokens_per_item(seq_len=8192, mm_counts={"audio": 1})["audio"]
    assert profile("qwen2-audio-transformers-defaults").mm_items["audio"].tokens == vllm_tokens == 750


# ---- vLLM's own layers, built on the meta device ------------------------------------------------
#
# vLLM builds each model class with every layer on torch's "meta" device (no memory, no kernels), one
# process standing in for tensor-parallel rank 0 of ``tp`` ranks (the TP group's world size is set, so
# every layer shards its heads as on a real rank). The KV cache spec of every attention layer then comes
# from the layer itself (``get_kv_cache_spec``, skipping layers that share another layer's cache, as
# ``GPUModelRunner.get_kv_cache_spec`` does), and the parameters are the model's own.

SPARSE = "synthetic__deepseek-v32-sparse-mla"
NOT_BUILT = (MULTIMODAL - set(LANGUAGE_MODEL_ONLY)) | REFUSED | {
    "community__Llama-3.1-8B-Instruct-bnb-int8",  # vLLM 0.32 refuses bitsandbytes
    "Qwen__Qwen3-0.6B-FP8", "Qwen__Qwen3-8B-FP8", "deepseek-ai__DeepSeek-V3",  # no CPU kernel for block-fp8 linears
    SPARSE,  # no sparse-attention backend on CPU: test_sparse_mla_indexer_matches_vllm builds its parts
}
BUILT = [n for n in ALL_NAMES if n not in NOT_BUILT]
REMOTE_CODE = {"synthetic__nemotron-nas-blocks"}  # its config class is remote code (configuration_decilm.py)
# vLLM's numel counts packed ints (GPTQ, mxfp4) or adds scale tensors (ModelOpt fp8): weights compared unquantized only
QUANTIZED = {"TheBloke__Llama-2-13B-chat-GPTQ", "openai__gpt-oss-20b", "nvidia__Llama-3.1-70B-Instruct-FP8"}
BUILT_TPS = (1, 2, 8)


@pytest.fixture(scope="module")
def meta_build():
    """One process as a single-rank gloo group: vLLM's layers need a TP/PP group to exist."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


class Built:
    """vLLM's model for one fixture at one TP size, built on the meta device.

    ``moe_as_amx``: this CPU path has no MoE kernel for the checkpoint (vLLM's CPU MXFP4 experts need
    AMX; without AMX its grouped GEMM needs 32-aligned dimensions, which gpt-oss at TP 8 is not), so the
    layers were built with AMX reported, as vLLM builds them on an AMX CPU. Nothing runs on the meta
    device, and the attention layers' KV specs do not depend on the MoE kernel; the config (block size,
    state dtypes) is still this path's."""

    def __init__(self, name: str, tp: int, max_model_len: int | None = None, max_num_batched_tokens: int = 2048):
        self.moe_as_amx = False
        try:
            self._build(name, tp, max_model_len, max_num_batched_tokens)
        except NotImplementedError as exc:
            if "MoE backend supports" not in str(exc):
                raise
            self.moe_as_amx = True
            self._build(name, tp, max_model_len, max_num_batched_tokens)

    def _build(self, name: str, tp: int, max_model_len: int | None, max_num_batched_tokens: int) -> None:
        import torch
        import vllm.distributed.parallel_state as ps
        from vllm.config import ModelConfig, set_current_vllm_config
        from vllm.config.vllm import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.model_executor.models.utils import StageMissingLayer
        from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

        folder = _language_model_folder(name) if name in LANGUAGE_MODEL_ONLY else fixture_path(name)
        length = max_model_len or min(profile(name).max_position_embeddings or 4096, 4096)
        # the runner the planner resolved (a real embedder's folder has the sentence-transformers files
        # that make vLLM pick "pooling"; the fixture has only config.json)
        mc = ModelConfig(model=folder, tokenizer=folder, skip_tokenizer_init=True, max_model_len=length,
                         trust_remote_code=name in REMOTE_CODE, runner=profile(name).runner)
        self.cache_dtype = resolve_kv_cache_dtype_string("auto", mc)  # as EngineArgs.create_engine_config
        # vLLM's CPU platform alone, on a CPU with AVX512-BF16 (this machine), keeps a GDN state in fp32 when
        # the VllmConfig is made; the planner models the general rule (see test_recurrent_state_matches_vllm)
        avx512_bf16 = torch.cpu._is_avx512_bf16_supported
        torch.cpu._is_avx512_bf16_supported = lambda: False
        try:
            self.vc = self._config(mc, tp, self.cache_dtype, length, max_num_batched_tokens)
        finally:
            torch.cpu._is_avx512_bf16_supported = avx512_bf16
        ps._TP.world_size = tp  # read when the layers are built and again when their specs are asked for
        try:
            amx = torch.cpu._is_amx_tile_supported
            if self.moe_as_amx:
                torch.cpu._is_amx_tile_supported = lambda: True
            try:
                with set_current_vllm_config(self.vc), torch.device("meta"):
                    model = initialize_model(vllm_config=self.vc)
            finally:
                torch.cpu._is_amx_tile_supported = amx
            self.specs = {}
            for layer_name, layer in get_layers_from_vllm_config(self.vc, AttentionLayerBase).items():
                if getattr(layer, "kv_sharing_target_layer_name", None):
                    continue  # reads another layer's cache and gets no spec of its own
                spec = layer.get_kv_cache_spec(self.vc)
                if spec is not None:
                    self.specs[layer_name] = spec
        finally:
            ps._TP.world_size = 1
        # a pooling run moves lm_head to "meta" for good (adapters.py no_init_weights): it holds no memory
        missing = {id(p) for m in model.modules() if isinstance(m, StageMissingLayer) for p in m.parameters()}
        self.numel = sum(p.numel() for p in model.parameters() if id(p) not in missing)

    @staticmethod
    def _config(mc, tp: int, cache: str, length: int, max_num_batched_tokens: int):
        from vllm.config import CacheConfig, LoadConfig, ParallelConfig, SchedulerConfig, VllmConfig

        return VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                          cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache),
                          scheduler_config=SchedulerConfig(max_model_len=length,
                                                           max_num_batched_tokens=max_num_batched_tokens,
                                                           is_encoder_decoder=False),
                          load_config=LoadConfig(load_format="dummy"))


@cache
def _language_model_folder(name: str) -> str:
    """A folder holding the wrapper's ``text_config`` as a config of its own, with the architecture the wrapper
    builds its language model with (LANGUAGE_MODEL_ONLY), as that wrapper hands it to vLLM."""
    import json
    import tempfile

    with open(os.path.join(fixture_path(name), "config.json")) as f:
        text = json.load(f)["text_config"]
    text["architectures"] = [LANGUAGE_MODEL_ONLY[name]]
    folder = tempfile.mkdtemp(prefix=f"{name}-text-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(text, f)
    return folder


@cache
def built(name: str, tp: int, cpu_path: str) -> Built:
    """``cpu_path`` keys the cache: the same fixture is built once on each CPU path."""
    return Built(name, tp)


def _built_cases() -> list[tuple[str, int]]:
    return [(name, tp) for name in BUILT for tp in BUILT_TPS if profile(name).tp_problem(tp) is None]


@pytest.mark.parametrize("name,tp", _built_cases())
def test_kv_of_the_built_model_matches(name, tp, meta_build, cpu_path):
    """Every attention layer's own spec: bytes per token, and per layer kind and page, to the byte."""
    from collections import Counter

    from vllm.v1.kv_cache_interface import AttentionSpec, ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    b, p = built(name, tp, cpu_path), profile(name)
    assert not b.moe_as_amx or (cpu_path != "amx" and p.num_experts)
    attention = [s for s in b.specs.values() if isinstance(s, AttentionSpec)]
    assert p.kv_bytes_per_token(tp) == sum(s.page_size_bytes // s.block_size for s in attention)
    def kind(s) -> tuple:
        if isinstance(s, SlidingWindowSpec):
            return "sliding", s.sliding_window
        if isinstance(s, ChunkedLocalAttentionSpec):
            return "chunked", s.attention_chunk_size
        return "full", None

    theirs = Counter((*kind(s), s.page_size_bytes // s.block_size) for s in attention)
    ours = Counter()
    for g in p.attention_groups:
        local = g.sliding_window if g.kind == "sliding" else g.attention_chunk_size
        ours[(g.kind, local, g.bytes_per_token_per_layer(tp, p.kv_elem_bytes))] += g.num_layers
    assert ours == theirs
    states = [s for s in b.specs.values() if isinstance(s, MambaSpec)]
    assert p.state_bytes_per_sequence(tp) == sum(s.real_page_size_bytes for s in states)
    assert p.kv_cache_dtype == b.cache_dtype  # e.g. the ignored side file: "auto" on both sides


@pytest.mark.parametrize("name", [n for n in BUILT if n not in QUANTIZED])
def test_parameters_of_the_built_model_match(name, meta_build, cpu_path):
    """The planner's parameter count is never below the built model's and at most 1 % above (BERT's
    pooler, norms it counts generously); per rank at TP=2 at most 3 % above (vocab padding per shard,
    small tensors it counts as replicated)."""
    p = profile(name)
    b = built(name, 1, cpu_path)
    # a language model built alone (LANGUAGE_MODEL_ONLY) is compared without the towers
    towers = p.params.towers if name in LANGUAGE_MODEL_ONLY else 0
    assert b.numel <= p.num_params - towers <= b.numel * 1.01
    if p.tp_problem(2) is None and p.quant is None:
        tower_share = 1 if any(t.replicated for t in p.towers) else 2
        per_rank = (p.weight_bytes_per_rank(2) - (p.role_bytes("towers") / tower_share if towers else 0)) \
            / p.dtype_bytes
        b2 = built(name, 2, cpu_path)
        assert b2.numel <= per_rank <= b2.numel * 1.03


POOL_NAMES = ["google__gemma-2-9b", "google__gemma-3-1b-it", "openai__gpt-oss-20b", "meta-llama__Llama-3.1-8B",
              "synthetic__gemma4-per-layer", "synthetic__gemma3n-list-fields", "synthetic__nemotron-nas-blocks",
              "google__gemma-4-31B-it", "meta-llama__Llama-4-Scout-17B-16E-Instruct", "XiaomiMiMo__MiMo-V2-Flash"]


# Requests longer than a window or chunk plus the in-flight tokens, where local layers hold less than full ones:
# Llama 4's 8192-token chunks (ChunkedLocalAttentionSpec), MiMo-V2's 128-token windows with their own heads.
LONG_POOL_CASES = [("meta-llama__Llama-4-Scout-17B-16E-Instruct", 32768, 2048),
                   ("XiaomiMiMo__MiMo-V2-Flash", 8192, 512), ("google__gemma-4-31B-it", 8192, 512)]


@pytest.mark.parametrize("name,max_model_len,tokens",
                         [(n, length, tokens) for n in POOL_NAMES for length, tokens in ((4096, 2048), (700, 256))]
                         + LONG_POOL_CASES)
def test_request_pool_of_the_built_model_matches(name, max_model_len, tokens, meta_build):
    """vLLM's block pool for one full-length request (get_kv_cache_groups, then
    _max_memory_usage_bytes_from_groups) against ``kv_pool_need``, with mixed page sizes (Gemma 4),
    shared layers (Gemma 3n/4) and per-block heads (Nemotron-NAS). The CUDA FlashAttention backend
    runs sliding layers at the primary block size; the CPU backend picks a 32-token kernel block for
    them, so the specs are laid out at BLOCK and with FlashAttention's KV cache layout."""
    from dataclasses import replace

    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    b = Built(name, 1, max_model_len=max_model_len, max_num_batched_tokens=tokens)
    specs = {n: replace(s, block_size=BLOCK) if isinstance(s, SlidingWindowSpec) else s for n, s in b.specs.items()}
    layouts = [[layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]]
    b.vc.cache_config.kv_cache_layout = resolve_kv_cache_layout(b.vc, layouts, specs.values()).name
    vllm_bytes = _max_memory_usage_bytes_from_groups(b.vc, get_kv_cache_groups(b.vc, dict(specs)))
    ours, _ = profile(name).kv_pool_need(max_model_len, 1, BLOCK, b.vc.max_in_flight_tokens)
    assert ours == vllm_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sparse_mla_indexer_matches_vllm(kv_cache_dtype, meta_build, cpu_path):
    """DeepSeek-V3.2-style sparse MLA: vLLM's own ``Indexer`` (built on the meta device) gives the
    indexer cache spec; the latent is MLAAttention's spec with the cache dtype FlashMLA-sparse
    serves (``_canonicalize_sparse_mla_kv_cache_dtype``: any fp8 cache becomes fp8_ds_mla). Every
    layer of the fixture builds an indexer (index_topk_freq 1)."""
    import torch
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import _canonicalize_sparse_mla_kv_cache_dtype
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mc = _model_config(SPARSE)
    assert mc.use_mla and hasattr(mc.hf_config, "index_topk")
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=64, cache_dtype=kv_cache_dtype),
                    scheduler_config=SchedulerConfig(max_model_len=mc.max_model_len, max_num_batched_tokens=2048,
                                                     is_encoder_decoder=False))
    # FlashMLA-sparse's 64-token blocks, as on a GPU: without AMX, vLLM's CPU platform overrides an MLA
    # model's block size to 16 for its reference CPU MLA kernel when the config is made
    vc.cache_config.block_size = 64
    with set_current_vllm_config(vc), torch.device("meta"):
        indexer = Indexer(vc, mc.hf_config, mc.hf_config.hidden_size, mc.hf_config.q_lora_rank, None,
                          vc.cache_config, None, "model.layers.0.self_attn.indexer")
    index_spec = indexer.k_cache.get_kv_cache_spec(vc)
    assert index_spec.block_size == 64
    cache = _canonicalize_sparse_mla_kv_cache_dtype(FlashMLASparseBackend, kv_cache_dtype)
    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=mc.get_head_size(),
                              dtype=kv_cache_dtype_str_to_dtype(cache, mc), cache_dtype_str=cache,
                              state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cache))
    per_layer = latent.page_size_bytes // 64 + index_spec.page_size_bytes // 64
    layers = mc.get_num_layers(ParallelConfig())
    p = profile(SPARSE, kv_cache_dtype=kv_cache_dtype)
    for tp in (1, 2, 8):  # both caches are replicated on every rank (max_tp_shards=1)
        assert p.kv_bytes_per_token(tp) == layers * per_layer


# Families with no fixture yet (no such config in /work/shared/model-configs): their KV rule is the generic
# one, but their parameter counts (biased ungated MLPs, LayerNorm biases) are not checked against vLLM's.
FAMILIES_WITHOUT_FIXTURE = {"UngatedFamily", "FalconFamily"}


def test_every_family_is_cross_checked_at_tp_1_and_2():
    """A family that matched vLLM once never regresses unseen: every family the planner has (but the one that
    refuses, UnverifiedMlaFamily) has a fixture checked here at TP 1 and at TP 2, by ModelConfig or by the
    built model."""
    from hive_apps.core.planning.profile.families import FAMILIES, UnverifiedMlaFamily

    checked: dict[str, set[int]] = {}
    for name, tp in CASES + _built_cases():
        checked.setdefault(profile(name).family, set()).add(tp)
    families = {cls.__name__ for cls in FAMILIES if cls is not UnverifiedMlaFamily} | {"Family"}
    assert {f for f in families if not {1, 2} <= checked.get(f, set())} == FAMILIES_WITHOUT_FIXTURE


# ---- what vLLM 0.32 runs at all ---------------------------------------------------------------


def test_registry_snapshot_is_vllms():
    """hive_apps/core/planning/profile/vllm_registry.py is vLLM 0.32's registry (run this file with --registry
    to regenerate it after a vLLM upgrade)."""
    from vllm.model_executor.models.registry import _OOT_SUPPORTED_MODELS, _PREVIOUSLY_SUPPORTED_MODELS, ModelRegistry

    from hive_apps.core.planning.profile import vllm_registry

    assert set(ModelRegistry.get_supported_archs()) == vllm_registry.SUPPORTED_ARCHITECTURES
    assert _PREVIOUSLY_SUPPORTED_MODELS == vllm_registry.PREVIOUSLY_SUPPORTED
    assert _OOT_SUPPORTED_MODELS == vllm_registry.OUT_OF_TREE


def test_dropped_architecture_is_refused_by_vllm_and_the_planner():
    from vllm.model_executor.models.registry import ModelRegistry

    from hive_apps.core.planning.types import PlanningError

    with pytest.raises(ValueError, match="supported in vLLM until v0.10.2"):
        ModelRegistry._raise_for_unsupported(["MllamaForConditionalGeneration"])
    with pytest.raises(PlanningError, match="MllamaForConditionalGeneration"):
        profile("meta-llama__Llama-3.2-11B-Vision-Instruct")


def test_mla_model_types_and_quantization_methods_are_vllms():
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    from hive_apps.core.planning.profile.families import VLLM_MLA_MODEL_TYPES
    from hive_apps.core.planning.profile.model import VLLM_QUANTIZATION_METHODS

    for model_type in VLLM_MLA_MODEL_TYPES | {"minicpm3", "llama", "qwen3", "sarvam_mla", "deepseek"}:
        text = SimpleNamespace(model_type=model_type, kv_lora_rank=128)
        convertor = ModelArchConfigConvertorBase(SimpleNamespace(model_type=model_type), text)
        assert convertor.is_deepseek_mla() == (model_type in VLLM_MLA_MODEL_TYPES), model_type
    assert set(QUANTIZATION_METHODS) == VLLM_QUANTIZATION_METHODS


# ---- the table ---------------------------------------------------------------------------------


def kv_table() -> str:
    rows = [("fixture", "how vLLM computed it", "TP=1 project", "TP=1 vLLM", "TP=2 project", "TP=2 vLLM",
             "state/request TP=1 (project = vLLM)")]
    for name in NAMES:
        p = profile(name)
        cells = []
        for tp in (1, 2):
            if p.tp_problem(tp):
                cells += ["-", "-"]
                continue
            v = VllmKv(name, tp)
            cells += [str(p.kv_bytes_per_token(tp)), str(v.bytes_per_token)]
        v1 = VllmKv(name, 1)
        how = ("convertor + specs (multimodal)" if name in MULTIMODAL else
               "convertor + specs (bnb: no ModelConfig)" if name in NO_MODEL_CONFIG else
               "encoder_only: no KV" if v1.encoder_only else
               "ModelConfig + MLAAttentionSpec" if any(type(s).__name__ == "MLAAttentionSpec" for s in v1.specs) else
               "ModelConfig + Full/SlidingWindowSpec" + (" + MambaSpec" if v1.state_per_request else ""))
        state = (f"{p.state_bytes_per_sequence(1)} = {v1.state_per_request}" if v1.state_per_request else "-")
        rows.append((name, how, *cells, state))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    out.insert(1, "  ".join("-" * w for w in width))
    return "\n".join(out)


def write_registry() -> str:
    """hive_apps/core/planning/profile/vllm_registry.py from the installed vLLM's registry."""
    import vllm
    from vllm.model_executor.models.registry import _OOT_SUPPORTED_MODELS, _PREVIOUSLY_SUPPORTED_MODELS, ModelRegistry

    from hive_apps.core.planning.profile import vllm_registry

    path = vllm_registry.__file__
    with open(path) as f:
        head = f.read().split("VLLM_VERSION = ")[0]
    lines = [head + f"VLLM_VERSION = {vllm.__version__!r}".replace("'", '"'), "",
             "# Every architecture name vLLM resolves to a model class (native or through its Transformers backend).",
             "SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({"]
    lines += [f'    "{a}",' for a in sorted(ModelRegistry.get_supported_archs())] + ["})", ""]
    lines += ["# Architectures vLLM removed, with the last version that ran them (vLLM refuses them at start).",
              "PREVIOUSLY_SUPPORTED: dict[str, str] = {"]
    lines += [f'    "{k}": "{v}",' for k, v in _PREVIOUSLY_SUPPORTED_MODELS.items()] + ["}", ""]
    lines += ["# Architectures only an out-of-tree vLLM plugin runs.", "OUT_OF_TREE: dict[str, str] = {"]
    lines += [f'    "{k}": "{v}",' for k, v in _OOT_SUPPORTED_MODELS.items()] + ["}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    if "--registry" in sys.argv:
        print("wrote", write_registry())
    else:
        _inspect_in_process()
        print(kv_table())
