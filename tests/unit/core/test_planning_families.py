"""Architecture families (hive_apps/core/planning/profile/families/): one test beside each KV rule.

Expected figures are worked out by hand from the fixture configs and the vLLM 0.32 code each
rule cites; tests/engine/test_kv_crosscheck.py checks the same fixtures against vLLM's own
layers built on the meta device.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hive_apps.core.planning.profile import profile_from_config_dict
from hive_apps.core.planning.types import PlanningError
from tests.unit.planning_fixtures import fixture_path, profile


def _config(name: str) -> dict:
    with open(os.path.join(fixture_path(name), "config.json")) as f:
        return json.load(f)


def _refused(d: dict, **vllm_kwargs) -> str:
    with pytest.raises(PlanningError) as err:
        profile_from_config_dict(d, vllm_kwargs=vllm_kwargs)
    assert err.value.status_code == 422
    return err.value.message


# ---- MLA-shaped configs vLLM 0.32 does not run as MLA --------------------------------------


def test_minicpm3_stores_full_per_head_k_and_v_not_a_latent():
    """minicpm3.py MiniCPM3Attention: Attention(heads, qk_nope + qk_rope, num_kv_heads=heads), V padded to
    the same width; its model type is not in vLLM's MLA list, so no latent cache."""
    p = profile("synthetic__minicpm3-mla-shaped")  # 4 layers, 8 heads, qk_nope 32 + qk_rope 16, kv_lora 128
    assert not p.is_mla and p.family == "MlaFullKvFamily"
    assert p.kv_bytes_per_token(1) == 4 * 2 * 8 * (32 + 16) * 2  # 6144, not the 4 x (128 + 16) x 2 latent
    assert p.kv_bytes_per_token(2) == 4 * 2 * 4 * (32 + 16) * 2  # heads split over the ranks


def test_deepseek_code_under_a_model_type_outside_vllms_mla_list_keeps_full_heads():
    """ModelConfig.use_mla is False for a model type outside is_deepseek_mla's list, so DeepseekV2 layers
    are DeepseekV2Attention: full per-head K and V of qk_nope + qk_rope."""
    d = {**_config("deepseek-ai__DeepSeek-V2-Lite"), "model_type": "my_deepseek_finetune"}
    p = profile_from_config_dict(d)
    assert not p.is_mla
    assert p.kv_bytes_per_token(1) == 27 * 2 * 16 * (128 + 64) * 2  # 16 heads, qk 128 + 64; V padded to 192
    assert p.kv_bytes_per_token(1) > 10 * profile("deepseek-ai__DeepSeek-V2-Lite").kv_bytes_per_token(1)


def test_bidirectional_deepseek_keeps_no_kv_cache():
    d = {**_config("deepseek-ai__DeepSeek-V2-Lite"), "is_causal": False}  # an embedding variant
    p = profile_from_config_dict(d)
    assert not p.is_mla and p.encoder_only and p.kv_bytes_per_token(1) == 0


def test_mla_shaped_config_of_an_unmodelled_architecture_is_refused():
    d = {**_config("synthetic__minicpm3-mla-shaped"), "architectures": ["SarvamMLAForCausalLM"],
         "model_type": "sarvam_mla"}
    msg = _refused(d)
    assert "SarvamMLAForCausalLM" in msg and "kv_lora_rank" in msg and "hive_attention_cls" in msg


def test_mla_model_type_whose_layout_is_unchecked_is_refused():
    d = {**_config("deepseek-ai__DeepSeek-V2-Lite"), "model_type": "longcat_flash",
         "architectures": ["LongcatFlashForCausalLM"]}
    assert "longcat_flash" in _refused(d)


# ---- the KV cache dtype vLLM applies ------------------------------------------------------


def test_side_quant_file_without_modelopt_producer_is_not_applied(tmp_path):
    """config.py::get_config merges hf_quant_config.json, but _normalize_quantization_config marks it
    ModelOpt only with producer.name "modelopt": without it there is no quant_method, so neither the fp8
    weights nor the fp8 KV cache it asks for are applied."""
    p = profile("synthetic__llama-side-quant-file-ignored")  # 4 layers, 4 KV heads, head_dim 64
    assert p.quant is None and p.kv_cache_dtype == "auto" and not p.fp8_kv
    assert p.kv_bytes_per_token(1) == 4 * 2 * 4 * 64 * 2  # bf16, twice what the file asks for
    assert any("does not name ModelOpt" in n for n in p.notes)
    marked = tmp_path / "with-producer"
    shutil.copytree(fixture_path("synthetic__llama-side-quant-file-ignored"), marked)
    side = json.loads((marked / "hf_quant_config.json").read_text())
    (marked / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, **side}))
    from hive_apps.core.planning.profile import load_profile

    q = load_profile(str(marked), {})
    assert q.quant.method == "modelopt" and q.kv_cache_dtype == "fp8_e4m3"
    assert q.kv_bytes_per_token(1) == 4 * 2 * 4 * 64 * 1


def test_compressed_tensors_kv_cache_scheme_means_fp8():
    """attention.py: a quant config's kv_cache_scheme makes an "auto" cache fp8."""
    d = {**_config("meta-llama__Llama-3.1-8B"), "quantization_config": {
        "quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"},
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}}}}
    p = profile_from_config_dict(d)
    assert p.kv_cache_dtype == "fp8" and p.kv_bytes_per_token(1) == 32 * 2 * 8 * 128 * 1


def test_kv_cache_dtype_with_a_backend_chosen_packing_is_refused_with_the_fix():
    msg = _refused(_config("meta-llama__Llama-3.1-8B"), kv_cache_dtype="int8_per_token_head")
    assert "int8_per_token_head" in msg and "kv_cache_dtype" in msg and "'fp8'" in msg


# ---- sparse MLA: the indexer's second cache ------------------------------------------------


def test_sparse_mla_adds_the_indexer_cache_on_every_layer():
    """DeepSeek-V3.2 (deepseek_v2.py Indexer): k_cache of index_head_dim fp8 bytes + one fp32 scale per
    128, uint8, replicated like the latent."""
    p = profile("synthetic__deepseek-v32-sparse-mla")  # 4 layers, kv_lora 128 + rope 16, index_head_dim 128
    latent, indexer = (128 + 16) * 2, 128 + 4
    assert p.is_mla and p.kv_bytes_per_token(1) == 4 * (latent + indexer)
    assert p.kv_bytes_per_token(8) == p.kv_bytes_per_token(1)
    assert {g.role for g in p.attention_groups} == {"mla", "indexer"}


def test_sparse_mla_fp8_cache_is_sized_as_fp8_ds_mla():
    """FlashMLA-sparse serves any quantized cache as fp8_ds_mla (_canonicalize_sparse_mla_kv_cache_dtype):
    656 B per token, more than a plain fp8 latent of 144 B, so the larger figure is planned."""
    p = profile("synthetic__deepseek-v32-sparse-mla", kv_cache_dtype="fp8")
    assert p.kv_bytes_per_token(1) == 4 * (656 + 132)


def test_index_topk_freq_and_pattern_skip_indexers():
    """DeepseekV2MLAAttention: without a pattern, layer i keeps its indexer when
    max(i - offset + 1, 0) % freq == 0 (offset 2): layers 0, 1 and 3 of 4 for freq 2; a pattern skips "S"."""
    d = {**_config("synthetic__deepseek-v32-sparse-mla"), "index_topk_freq": 2}
    assert profile_from_config_dict(d).kv_bytes_per_token(1) == 4 * 288 + 3 * 132
    d = {**_config("synthetic__deepseek-v32-sparse-mla"), "index_topk_pattern": "FSSF"}
    assert profile_from_config_dict(d).kv_bytes_per_token(1) == 4 * 288 + 2 * 132


# ---- per-layer configs and list-valued fields ----------------------------------------------


def test_gemma4_per_layer_head_sizes_and_shared_kv_layers():
    """gemma4.py reads head_dim / num_key_value_heads from config.per_layer_config[i]; the last
    num_kv_shared_layers layers read an earlier layer's cache (kv_sharing_target_layer_name)."""
    p = profile("synthetic__gemma4-per-layer")  # 8 layers s,s,s,F,s,s,s,F; last 2 shared
    sliding = 5 * 2 * 2 * 64 * 2  # layers 0,1,2,4,5: 2 KV heads x 64
    full = 1 * 2 * 2 * 128 * 2  # layer 3: global 2 KV heads x 128
    assert p.kv_bytes_per_token(1) == sliding + full
    assert p.kv_bytes_per_token(2) == (sliding + full) // 2
    assert {(g.kind, g.num_layers, g.head_size) for g in p.attention_groups} == {("sliding", 5, 64),
                                                                                  ("full", 1, 128)}


def test_per_layer_values_an_architecture_reads_globally_are_refused():
    """LlamaForCausalLM reads config.num_key_value_heads: a transformers 5 per_layer_config overriding it
    raises there (and in vLLM), so the planner answers a 422 naming the attribute."""
    d = {**_config("meta-llama__Llama-3.2-1B-Instruct"), "per_layer_config": {"3": {"num_key_value_heads": 2}}}
    msg = _refused(d)
    assert "num_key_value_heads" in msg and "per_layer_config" in msg


def test_gemma3n_list_valued_mlp_widths_and_shared_kv_layers():
    """gemma3n.py: intermediate_size[layer] per layer; layers >= num_hidden_layers - num_kv_shared_layers
    keep no cache."""
    p = profile("synthetic__gemma3n-list-fields")  # 6 layers s,s,F,s,s,F; last 2 shared; 2 KV heads x 64
    assert p.kv_bytes_per_token(1) == 4 * 2 * 2 * 64 * 2
    assert p.intermediate_size == 1024  # the widest layer (activations are sized for it)


def test_nemotron_nas_block_configs():
    """nemotron_nas.py DeciLMDecoderLayer: no_op attention keeps no cache; otherwise
    num_attention_heads // n_heads_in_group KV heads."""
    p = profile("synthetic__nemotron-nas-blocks")  # 8 heads of 64; groups 4, 2, no_op, 8, no_op, 4
    assert p.kv_bytes_per_token(1) == (2 + 4 + 1 + 2) * 2 * 64 * 2
    assert p.kv_bytes_per_token(2) == (1 + 2 + 1 + 1) * 2 * 64 * 2  # one head stays on every rank
    assert p.intermediate_size == 1024  # ffn_mult 2.625: int(2 x 2.625 x 512 / 3) = 896, next multiple of 256


def test_nemotron_nas_linear_replacements_are_refused():
    d = _config("synthetic__nemotron-nas-blocks")
    d["block_configs"][1]["attention"]["replace_with_linear"] = True
    assert "replaced with a linear layer" in _refused(d)


# ---- architectures vLLM 0.32 does not run ----------------------------------------------------


def test_cross_attention_vision_model_dropped_by_vllm_is_refused():
    with pytest.raises(PlanningError) as err:
        profile("meta-llama__Llama-3.2-11B-Vision-Instruct")
    assert err.value.status_code == 422
    assert "MllamaForConditionalGeneration" in err.value.message and "0.10.2" in err.value.message


def test_unknown_layer_type_is_refused():
    d = {**_config("meta-llama__Llama-3.2-1B-Instruct"), "layer_types": ["full_attention"] * 15 + ["mamba"]}
    msg = _refused(d)
    assert "layer type 'linear_attention' (layer 15)" in msg  # transformers 5 names 'mamba' layers so


def test_unknown_tower_is_refused_unless_its_modality_is_off():
    d = {**_config("llava-hf__llava-1.5-7b-hf")}
    d["vision_config"] = {"model_type": "timm_wrapper", "architecture": "mobilenetv5_300m_enc"}
    msg = _refused(d)
    assert "vision tower" in msg and "limit_mm_per_prompt" in msg
    text_only = profile_from_config_dict(d, vllm_kwargs={"limit_mm_per_prompt": {"image": 0}})
    assert text_only.towers == [] and text_only.kv_bytes_per_token(1) == 32 * 2 * 32 * 128 * 2


def test_gemma4_vision_tower_without_its_token_budget_is_a_422_unless_images_are_off():
    """gemma4_mm.py reads vision_config.default_output_length for the tokens of an image; without it the
    planner does not guess."""
    d = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
         "text_config": {k: v for k, v in _config("synthetic__gemma4-per-layer").items()
                         if k not in ("architectures", "transformers_version")},
         "vision_config": {"model_type": "gemma4_vision", "hidden_size": 256, "num_hidden_layers": 2}}
    assert "default_output_length" in _refused(d)
    text_only = profile_from_config_dict(d, vllm_kwargs={"limit_mm_per_prompt": {"image": 0}})
    assert text_only.kv_bytes_per_token(1) == profile("synthetic__gemma4-per-layer").kv_bytes_per_token(1)

# ---- Gemma 4 31B, Llama 4 (chunked local attention), MiMo-V2-Flash (separate V head size) --------------


def test_gemma4_31b_global_layers_keep_their_own_head_size_and_kv_heads():
    """60 layers, every sixth global: 10 global layers of 4 KV heads x 512 (K and V both stored, also under
    attention_k_eq_v), 50 sliding layers of 16 KV heads x 256, bf16."""
    p = profile("google__gemma-4-31B-it")
    assert p.family == "Gemma4Family"
    assert p.kv_bytes_per_token(1) == 10 * 4 * (512 + 512) * 2 + 50 * 16 * (256 + 256) * 2  # 901,120
    assert p.kv_bytes_per_token(2) == 10 * 2 * 1024 * 2 + 50 * 8 * 512 * 2
    assert p.kv_bytes_per_token(8) == 10 * 1 * 1024 * 2 + 50 * 2 * 512 * 2  # 4 KV heads replicated past TP 4


SCOUT = "meta-llama__Llama-4-Scout-17B-16E-Instruct"


def test_llama4_rope_layers_are_chunked_local_attention_and_nope_layers_global():
    """llama4.py: no_rope_layers[i] == 0 (every fourth layer of 48) is a global layer, the 36 others use
    ChunkedLocalAttention of attention_chunk_size 8192; all 8 KV heads x 128, bf16."""
    p = profile(SCOUT)
    assert p.family == "Llama4Family"
    groups = {g.kind: g for g in p.attention_groups}
    assert (groups["full"].num_layers, groups["chunked"].num_layers) == (12, 36)
    assert groups["chunked"].attention_chunk_size == 8192 and groups["chunked"].sliding_window is None
    assert p.kv_bytes_per_token(1) == 48 * 2 * 8 * 128 * 2  # 196,608: a chunked layer costs the same per token
    assert p.kv_bytes_per_token(2) == 48 * 2 * 4 * 128 * 2
    assert p.kv_bytes_per_token(8) == 48 * 2 * 1 * 128 * 2


def test_llama4_chunked_layers_hold_one_chunk_plus_the_in_flight_tokens():
    """ChunkedLocalAttentionSpec.max_admission_blocks_per_request: cdiv(min(chunk + in-flight, L), block),
    no extra block; full layers hold cdiv(L, block). 12 full and 36 chunked layers make groups of 12."""
    p = profile(SCOUT)
    page = 16 * 2 * 8 * 128 * 2  # one layer's 16-token block: 65,536 bytes
    in_flight = 2 * 2048
    per_request, block = p.kv_pool_need(32768, 1, 16, in_flight)
    chunked_blocks = (8192 + 4096) // 16  # 768
    full_blocks = 32768 // 16  # 2048
    assert per_request == 12 * page * full_blocks + 3 * 12 * page * chunked_blocks
    assert block == 12 * page
    # shorter than one chunk: every layer holds the whole request
    short, _ = p.kv_pool_need(4096, 1, 16, in_flight)
    assert short == 48 * page * (4096 // 16)
    # without the hybrid KV cache manager vLLM promotes chunked layers to full attention
    promoted, _ = p.kv_pool_need(32768, 1, 16, in_flight, hybrid_manager=False)
    assert promoted == 48 * page * full_blocks


def test_llama4_moe_interleave_and_shared_expert():
    """Llama4DecoderLayer: MoE on layers with (i + 1) % interleave_moe_layer_step == 0, each with a router
    (hidden x experts), one shared expert and the routed experts of intermediate_size; the other layers a
    dense MLP of intermediate_size_mlp (Maverick: step 2, 128 experts)."""
    text = {"model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96,
            "vocab_size": 1000, "num_local_experts": 8, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
            "attention_chunk_size": 128, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    p = profile_from_config_dict({"architectures": ["Llama4ForCausalLM"], **text})
    assert p.num_moe_layers == 2  # layers 1 and 3
    h = 64
    attention = 4 * (h * 4 * 16 + 2 * h * 2 * 16 + 4 * 16 * h)
    dense = 2 * 3 * h * 96
    moe = 2 * (h * 8 + 3 * h * 32 + 8 * 3 * h * 32)  # router, shared expert, experts
    norms = 4 * 2 * h + h
    assert p.num_params == 2 * 1000 * h + attention + dense + moe + norms
    # layers 0, 1, 2 use RoPE (chunked), layer 3 is NoPE (global), as no_rope_layer_interval 4 gives
    assert {g.kind: g.num_layers for g in p.attention_groups} == {"full": 1, "chunked": 3}


MIMO = "XiaomiMiMo__MiMo-V2-Flash"


def test_mimo_v2_flash_keeps_v_at_its_own_head_size_with_per_kind_heads():
    """mimo_v2.py: hybrid_layer_pattern 1 = sliding window (swa_num_key_value_heads 8, swa_head_dim 192,
    swa_v_head_dim 128), 0 = global (4 KV heads, head_dim 192, v_head_dim 128); Attention(head_size_v=...)
    stores K and V at their own widths: (192 + 128) x 2 bytes per head."""
    p = profile(MIMO)
    assert p.family == "MiMoV2Family"
    groups = {g.kind: g for g in p.attention_groups}
    assert (groups["full"].num_layers, groups["sliding"].num_layers) == (9, 39)
    assert groups["sliding"].sliding_window == 128
    assert p.kv_bytes_per_token(1) == 9 * 4 * (192 + 128) * 2 + 39 * 8 * (192 + 128) * 2  # 222,720
    assert p.kv_bytes_per_token(2) == 9 * 2 * 320 * 2 + 39 * 4 * 320 * 2
    assert p.kv_bytes_per_token(8) == 9 * 1 * 320 * 2 + 39 * 1 * 320 * 2  # 4 global KV heads replicated


def test_mimo_v2_flash_request_pool_mixes_its_two_page_sizes():
    """The global page (4 heads) is half the sliding one (8 heads): vLLM gives it twice the tokens per block
    (unify_kv_cache_spec_page_size). 9 global and 39 sliding layers make groups of 9 (5 sliding groups)."""
    p = profile(MIMO)
    sliding_page = 16 * 8 * 320 * 2  # 81,920
    per_request, block = p.kv_pool_need(8192, 1, 16, 1024)
    full_blocks = 8192 // 32  # 32 tokens per global block
    sliding_blocks = -(-(128 - 1 + 1024) // 16) + 1  # 73
    assert per_request == 9 * sliding_page * full_blocks + 5 * 9 * sliding_page * sliding_blocks
    assert block == 9 * sliding_page


def test_mimo_v2_without_a_hybrid_layer_pattern_is_refused():
    d = {k: v for k, v in _config(MIMO).items() if k != "hybrid_layer_pattern"}
    assert "hybrid_layer_pattern" in _refused(d)
