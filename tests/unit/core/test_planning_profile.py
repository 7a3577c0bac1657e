"""ModelProfile from real Hugging Face configs: KV bytes per token, weights, runner, dtype, quantization."""

from __future__ import annotations

import json
import os

import pytest

from hive_apps.core.planning.memory import kv_need
from hive_apps.core.planning.profile import load_profile, profile_from_config_dict
from hive_apps.core.planning.types import PlanningError
from tests.unit.planning_fixtures import fixture_path, profile

# KV bytes per token at TP=1, as vLLM 0.32 lays the cache out (bf16 unless noted).
KV_BYTES_PER_TOKEN = {
    "tiny-qwen2": 2 * 2 * 2 * 32 * 2,  # 2 layers x K,V x 2 KV heads x head_dim 32 x 2 B = 512
    "meta-llama__Llama-3.1-8B": 32 * 2 * 8 * 128 * 2,  # 131072
    "meta-llama__Llama-3.1-70B": 80 * 2 * 8 * 128 * 2,  # 327680
    "meta-llama__Llama-3.2-1B-Instruct": 16 * 2 * 8 * 64 * 2,  # head_dim 64
    "Qwen__Qwen3-0.6B": 28 * 2 * 8 * 128 * 2,  # 114688
    "Qwen__Qwen3-8B": 36 * 2 * 8 * 128 * 2,  # 147456
    "Qwen__Qwen3-30B-A3B": 48 * 2 * 4 * 128 * 2,  # MoE: attention only
    "mistralai__Mixtral-8x7B-v0.1": 32 * 2 * 8 * 128 * 2,
    "deepseek-ai__DeepSeek-V3": 61 * (512 + 64) * 2,  # MLA latent 576 x 2 B = 1152 per layer -> 70272
    "deepseek-ai__DeepSeek-V2-Lite": 27 * (512 + 64) * 2,  # 31104
    "google__gemma-3-1b-it": 26 * 2 * 1 * 256 * 2,  # sliding layers cost the same per token
    "google__gemma-2-9b": 42 * 2 * 8 * 256 * 2,
    "openai__gpt-oss-20b": 24 * 2 * 8 * 64 * 2,
    "Qwen__Qwen3-Next-80B-A3B-Thinking": 12 * 2 * 2 * 256 * 2,  # only every 4th layer has KV
    "nvidia__Nemotron-H-56B-Base-8K": 10 * 2 * 8 * 128 * 2,  # 10 attention layers of 118
    "nvidia__Llama-3.1-70B-Instruct-FP8": 80 * 2 * 8 * 128 * 1,  # ModelOpt asks for an fp8 KV cache
    "intfloat__e5-mistral-7b-instruct": 32 * 2 * 8 * 128 * 2,  # decoder embedder keeps its KV
    "sentence-transformers__all-MiniLM-L6-v2": 0,  # encoder-only: no KV cache at all
    "BAAI__bge-m3": 0,
    "Qwen__Qwen3-0.6B-FP8": 28 * 2 * 8 * 128 * 2,  # fp8 weights, bf16 KV
    "TheBloke__Llama-2-13B-chat-GPTQ": 40 * 2 * 40 * 128 * 2,  # MHA
    "community__Llama-3.1-8B-Instruct-bnb-int8": 32 * 2 * 8 * 128 * 2,
    "Qwen__Qwen2.5-VL-3B-Instruct": 36 * 2 * 2 * 128 * 2,  # the language model's KV only
    "Qwen__Qwen2.5-VL-7B-Instruct": 28 * 2 * 4 * 128 * 2,
    "google__gemma-3-27b-it": 62 * 2 * 16 * 128 * 2,
    "llava-hf__llava-1.5-7b-hf": 32 * 2 * 32 * 128 * 2,
    "qwen2-audio-transformers-defaults": 32 * 2 * 32 * 128 * 2,
}


@pytest.mark.parametrize("name,expected", sorted(KV_BYTES_PER_TOKEN.items()))
def test_kv_bytes_per_token_matches_vllm_layout(name, expected):
    assert profile(name).kv_bytes_per_token(1) == expected


def test_kv_per_token_under_tensor_parallel():
    llama70 = profile("meta-llama__Llama-3.1-70B")
    assert llama70.kv_bytes_per_token(2) == 327680 // 2
    assert llama70.kv_bytes_per_token(8) == 327680 // 8
    # tp > kv heads: vLLM replicates so every rank still holds one head
    assert llama70.kv_bytes_per_token(16) == 80 * 2 * 1 * 128 * 2
    # the MLA latent is replicated on every rank, not divided
    assert profile("deepseek-ai__DeepSeek-V3").kv_bytes_per_token(8) == 70272


def test_kv_cache_dtype_fp8_halves_the_cache():
    assert profile("tiny-qwen2", kv_cache_dtype="fp8").kv_bytes_per_token() == 256  # research note B9
    assert profile("meta-llama__Llama-3.1-8B", kv_cache_dtype="fp8").kv_bytes_per_token() == 65536
    assert profile("meta-llama__Llama-3.1-8B", kv_cache_dtype="fp8").fp8_kv
    assert profile("deepseek-ai__DeepSeek-V3", kv_cache_dtype="fp8_ds_mla").kv_bytes_per_token() == 61 * 656


def test_weights_from_architecture_match_published_sizes():
    llama = profile("meta-llama__Llama-3.1-8B")
    assert abs(llama.num_params - 8.03e9) / 8.03e9 < 0.02
    assert abs(llama.weight_bytes - 8.03e9 * 2) / (8.03e9 * 2) < 0.02
    qwen = profile("Qwen__Qwen3-0.6B")
    assert qwen.num_params == 596_049_920  # tied embeddings counted once, q/k norms included
    assert qwen.params.lm_head == 0
    vl = profile("Qwen__Qwen2.5-VL-3B-Instruct")
    assert vl.weight_bytes == 7_509_245_952  # safetensors total_size, vision tower included
    assert vl.mm_items["image"].tokens == 16384 and vl.tower("vision").loaded
    for name, published in [("mistralai__Mixtral-8x7B-v0.1", 46.7e9), ("Qwen__Qwen3-30B-A3B", 30.5e9),
                            ("deepseek-ai__DeepSeek-V3", 671e9), ("Qwen__Qwen3-8B", 8.19e9)]:
        assert abs(profile(name).num_params - published) / published < 0.01, name


def test_quantized_checkpoints_are_sized_packed():
    bf16 = profile("Qwen__Qwen3-8B")
    fp8 = profile("Qwen__Qwen3-8B-FP8")
    assert fp8.quant and fp8.quant.fp8_weights and fp8.needs_fp8_hardware
    assert 0.5 < fp8.weight_bytes / bf16.weight_bytes < 0.62  # linears 1 B, embeddings/lm_head 2 B
    bnb = profile("community__Llama-3.1-8B-Instruct-bnb-int8")
    assert abs(bnb.weight_bytes - 9_086_705_888) / 9_086_705_888 < 0.01  # its safetensors total_size
    gptq = profile("TheBloke__Llama-2-13B-chat-GPTQ")
    assert gptq.quant.weight_format == "gptq int4 g128"
    assert 0.27 < gptq.weight_bytes / (gptq.num_params * 2) < 0.30  # 4 bit + group scales, 16-bit embeddings
    modelopt = profile("nvidia__Llama-3.1-70B-Instruct-FP8")  # marker only in hf_quant_config.json
    assert modelopt.quant.fp8_weights and modelopt.kv_cache_dtype == "fp8_e4m3"  # vLLM's resolved name
    oss = profile("openai__gpt-oss-20b")
    assert oss.quant.method == "mxfp4" and "attention" not in oss.quant.quantized_roles
    assert 13e9 < oss.weight_bytes < 14.5e9


def test_runner_and_dtype_follow_vllm_auto():
    mini = profile("sentence-transformers__all-MiniLM-L6-v2")
    assert (mini.runner, mini.dtype, mini.encoder_only) == ("pooling", "float16", True)  # fp32 -> fp16
    assert mini.max_position_embeddings == 512
    assert profile("meta-llama__Llama-3.1-8B").runner == "generate"
    assert profile("intfloat__e5-mistral-7b-instruct").runner == "pooling"  # MistralModel
    assert profile("google__gemma-2-9b").dtype == "bfloat16"  # fp32 checkpoint, generative
    forced = profile("Qwen__Qwen3-8B", runner="pooling")
    assert forced.runner == "pooling" and forced.params.lm_head == 0
    assert profile("BAAI__bge-m3").max_position_embeddings == 8192  # RoBERTa: 8194 - padding_idx - 1


def test_sliding_window_requests_hold_only_the_window():
    gemma = profile("google__gemma-3-1b-it")
    page = 16 * 1 * 2 * 256 * 2  # block 16 x one KV head x (K + V) x 256 x 2 B
    per_request, block = kv_need(gemma, 8192, 1, 16, 2048)
    # buckets: 4 full, 22 sliding -> groups of 4 layers, 6 sliding groups (2 padding layers)
    full = 4 * page * (8192 // 16)
    sliding = 24 * page * (-(-min(512 - 1 + 2 * 2048, 8192) // 16) + 1)
    assert per_request == full + sliding
    assert block == 4 * page
    assert per_request < 8192 * gemma.kv_bytes_per_token()


def test_recurrent_state_is_per_request():
    nemotron = profile("nvidia__Nemotron-H-56B-Base-8K")
    conv = (256 * 64 + 2 * 8 * 256) * 3 * 2  # bf16 conv state, kernel 4
    ssm = 256 * 64 * 256 * 4  # NemotronH keeps the SSM state in fp32
    assert nemotron.state_bytes_per_sequence(1) == 54 * (conv + ssm)
    qnext = profile("Qwen__Qwen3-Next-80B-A3B-Thinking")
    gdn = (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 2
    assert qnext.state_bytes_per_sequence(1) == 36 * gdn
    assert qnext.block_size(on_cpu=False) > 16  # attention pages grow to hold a state


def test_hybrid_block_size_follows_vllm_alignment_per_tp():
    """Platform._align_hybrid_block_size: block = align x cdiv(state page, align x attention page per token)."""
    nemotron = profile("nvidia__Nemotron-H-56B-Base-8K")
    state = (256 * 64 + 2 * 8 * 256) * 3 * 2 + 256 * 64 * 256 * 4  # 16,900,096 B per layer (vLLM MambaSpec)
    attn = 2 * 8 * 128 * 2  # one layer, one token
    assert nemotron.block_size(on_cpu=False) == 16 * -(-state // (16 * attn)) == 4128
    assert nemotron.block_size(on_cpu=True) == 128 * -(-state // (128 * attn)) == 4224
    # TP=2 halves both the state and the KV heads; TP=16 replicates KV heads (1 per rank) but still splits the state
    state16 = (256 * 64 + 2 * 16 * 256) // 16 * 3 * 2 + 256 // 16 * 64 * 256 * 4  # groups padded to 16
    assert nemotron.block_size(on_cpu=False, tp=16) == 16 * -(-state16 // (16 * 2 * 1 * 128 * 2))
    qnext = profile("Qwen__Qwen3-Next-80B-A3B-Thinking")
    assert qnext.block_size(on_cpu=False, tp=4) != qnext.block_size(on_cpu=False, tp=1)  # 2 KV heads replicated


def test_prefix_caching_keeps_two_or_three_state_blocks_per_request():
    """Generative hybrids cache prefixes by default (mamba_cache_mode="align"): MambaSpec.max_memory_usage_bytes
    is 2 pages per layer, 3 for Mamba-2 mixers (one prefill checkpoint); without prefix caching 1."""
    qnext = profile("Qwen__Qwen3-Next-80B-A3B-Thinking")
    block = qnext.block_size(on_cpu=False)
    on, _ = kv_need(qnext, 4096, 1, block, 2048, prefix_caching=True)
    off, _ = kv_need(qnext, 4096, 1, block, 2048, prefix_caching=False)
    page = block * 2 * 2 * 256 * 2  # gdn pages are padded to the attention page
    assert on - off == 36 * page  # one more page per gdn layer (12 groups of 3 layers)
    nemotron = profile("nvidia__Nemotron-H-56B-Base-8K")
    block = nemotron.block_size(on_cpu=False)
    on, _ = kv_need(nemotron, 4096, 1, block, 2048, prefix_caching=True)
    off, _ = kv_need(nemotron, 4096, 1, block, 2048, prefix_caching=False)
    # two more pages per mamba2 layer slot: 54 layers in 6 groups of 10 (the attention count), padded to 60
    assert on - off == 2 * 60 * block * 2 * 8 * 128 * 2


def test_missing_fields_name_themselves():
    with pytest.raises(PlanningError) as err:
        profile_from_config_dict({"architectures": ["LlamaForCausalLM"], "model_type": "foo-unknown", "hidden_size": 64})
    assert err.value.status_code == 422
    for field in ("num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        assert field in err.value.message


GENERIC = {"architectures": ["LlamaForCausalLM"], "model_type": "foo-unknown", "hidden_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "intermediate_size": 512, "torch_dtype": "bfloat16", "max_position_embeddings": 2048}


def test_unknown_model_type_of_a_vllm_architecture_is_planned_generically():
    p = profile_from_config_dict(GENERIC)
    assert p.family == "Family"
    assert p.kv_bytes_per_token() == 4 * 2 * 2 * 64 * 2
    assert p.num_params == 1000 * 256 * 2 + 4 * (256 * 256 * 2 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 256


def test_architecture_vllm_does_not_run_is_refused_unless_a_user_family_says_how():
    foo = {**GENERIC, "architectures": ["FooForCausalLM"]}
    with pytest.raises(PlanningError) as err:
        profile_from_config_dict(foo)
    assert err.value.status_code == 422
    assert "FooForCausalLM" in err.value.message and "not supported by vLLM 0.32" in err.value.message
    hooked = profile_from_config_dict(foo, vllm_kwargs={"hive_attention_cls": "tests.unit.planning_fixtures.DoubleKV"})
    assert hooked.kv_bytes_per_token() == 2 * 4 * 2 * 2 * 64 * 2  # an out-of-tree model the user describes


def test_config_dict_and_folder_agree():
    with open(os.path.join(fixture_path("Qwen__Qwen3-8B"), "config.json")) as f:
        d = json.load(f)
    a = profile_from_config_dict(d)
    b = profile("Qwen__Qwen3-8B")
    assert (a.weight_bytes, a.kv_bytes_per_token(), a.max_position_embeddings) == \
        (b.weight_bytes, b.kv_bytes_per_token(), b.max_position_embeddings)


def test_attention_hook_overrides_kv():
    hooked = profile("meta-llama__Llama-3.1-8B", hive_attention_cls="tests.unit.planning_fixtures.DoubleKV")
    assert hooked.kv_bytes_per_token(1) == 2 * 131072
    assert hooked.kv_bytes_per_token(2) == 131072
    with pytest.raises(PlanningError) as err:
        profile("meta-llama__Llama-3.1-8B", hive_attention_cls="tests.unit.nope.Missing")
    assert err.value.status_code == 422 and "hive_attention_cls" in err.value.message
    with pytest.raises(PlanningError) as err:
        profile("meta-llama__Llama-3.1-8B", hive_attention_cls="tests.unit.planning_fixtures.OldStyleKvHook")
    assert err.value.status_code == 422 and "Class(profile) form is gone" in err.value.message


def test_model_not_in_local_cache_is_a_clear_422():
    with pytest.raises(PlanningError) as err:
        load_profile("no-such-org/no-such-model-xyz", {})
    assert err.value.status_code == 422 and "local" in err.value.message


def test_summary_carries_the_planner_figures():
    s = profile("tiny-qwen2").summary()
    assert (s.architecture, s.runner, s.dtype, s.kv_bytes_per_token, s.num_params) == \
        ("Qwen2ForCausalLM", "generate", "bfloat16", 512, 558_208)
    assert s.path.endswith("tiny-qwen2")




def test_a_config_shape_the_planner_cannot_read_is_a_422_not_a_crash():
    with open(fixture_path("Qwen__Qwen3-0.6B") + "/config.json") as f:
        d = json.load(f)
    d["num_key_value_heads"] = [8] * d["num_hidden_layers"]  # a per-layer list where a number is read
    with pytest.raises(PlanningError) as err:
        profile_from_config_dict(d, "x")
    assert err.value.status_code == 422
    msg = err.value.message
    assert "cannot model" in msg and "qwen3" in msg and "'num_key_value_heads' is a list of 28 values" in msg
    assert "TypeError" not in msg  # a clear message, not an internal error


@pytest.mark.parametrize("content", [[{"model_type": "llama"}], "llama", 7, None])
def test_a_config_json_that_is_not_an_object_is_a_422(tmp_path, content):
    (tmp_path / "config.json").write_text(json.dumps(content))
    for plan in (lambda: load_profile(str(tmp_path)), lambda: profile_from_config_dict(content)):
        with pytest.raises(PlanningError) as refused:
            plan()
        assert refused.value.status_code == 422 and "must hold a JSON object" in refused.value.message


SIZES = ("hidden_size", "num_key_value_heads", "num_attention_heads", "head_dim", "num_hidden_layers",
         "intermediate_size", "vocab_size")


@pytest.mark.parametrize("field,value", [(f, -8) for f in SIZES] + [(f, 0) for f in SIZES if f != "head_dim"])
def test_a_size_that_is_not_positive_is_a_422_naming_it(field, value):
    with open(os.path.join(fixture_path("meta-llama__Llama-3.1-8B"), "config.json")) as f:
        config = {**json.load(f), "head_dim": 128, field: value}
    with pytest.raises(PlanningError) as refused:
        profile_from_config_dict(config)
    assert refused.value.status_code == 422 and f"'{field}' is {value}" in refused.value.message


def test_head_dim_zero_is_unset_as_in_vllm():
    """vLLM's get_head_size reads head_dim 0 as absent (transformers writes some missing ones as 0)."""
    with open(os.path.join(fixture_path("meta-llama__Llama-3.1-8B"), "config.json")) as f:
        config = {**json.load(f), "head_dim": 0}
    assert profile_from_config_dict(config).head_dim == 4096 // 32


def test_chunked_local_attention_requests_hold_a_chunk_plus_two_batches():
    """kv_need passes two batches of max_num_batched_tokens as in flight (VllmConfig.max_in_flight_tokens);
    a Llama 4 Scout chunked layer then holds min(8192 + 2 x 8192, L) tokens, a global layer all L."""
    p = profile("meta-llama__Llama-4-Scout-17B-16E-Instruct")
    page = 16 * 2 * 8 * 128 * 2  # one layer's 16-token block, TP 1
    per_request, block = kv_need(p, 65536, 1, 16, 8192)
    assert per_request == 12 * page * (65536 // 16) + 36 * page * ((8192 + 16384) // 16)
    assert block == 12 * page
    # at TP 2 each rank holds half the KV heads
    half, _ = kv_need(p, 65536, 2, 16, 8192)
    assert half * 2 == per_request
