"""The planner's KV bytes per token against vLLM 0.32's own KV-spec arithmetic.

Lives in the engine tier because importing vLLM's config layer takes ~13 s.
"""

from __future__ import annotations

import pytest

from tests.unit.planning_fixtures import fixture_path, profile

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("name", ["tiny-qwen2", "meta-llama__Llama-3.1-8B", "meta-llama__Llama-3.1-70B",
                                  "Qwen__Qwen3-0.6B", "deepseek-ai__DeepSeek-V3", "deepseek-ai__DeepSeek-V2-Lite",
                                  "mistralai__Mixtral-8x7B-v0.1", "Qwen__Qwen3-30B-A3B"])
@pytest.mark.parametrize("tp", [1, 2, 16])
def test_kv_bytes_match_vllm_kv_spec(name, tp):
    """vLLM's own arithmetic: ModelArchConfigConvertor head size / KV heads + FullAttentionSpec/MLAAttentionSpec."""
    import torch
    import vllm.config  # noqa: F401  (resolves the convertor's circular import)
    from transformers import AutoConfig
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS, ModelArchConfigConvertorBase,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    cfg = AutoConfig.from_pretrained(fixture_path(name), local_files_only=True)
    text = cfg.get_text_config()
    arch = MODEL_ARCH_CONFIG_CONVERTORS.get(cfg.model_type, ModelArchConfigConvertorBase)(cfg, text).convert()
    block = 16
    if arch.is_deepseek_mla:
        spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=arch.head_size, dtype=torch.bfloat16)
    else:
        heads = max(1, arch.total_num_kv_heads // tp)  # ModelConfig.get_num_kv_heads
        spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=arch.head_size, dtype=torch.bfloat16)
    vllm_bytes = spec.page_size_bytes // block * arch.total_num_hidden_layers
    assert profile(name).kv_bytes_per_token(tp) == vllm_bytes
