"""Multimodal planning: worst-case placeholder tokens as vLLM counts them, limits, max_model_len, MmContextError."""

from __future__ import annotations

import pytest

from hive_apps.core.planning import multimodal as mm
from hive_apps.core.planning.memory import activation_bytes
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.profile import profile_from_config_dict
from hive_apps.core.planning.types import MmContextError, PlanningError
from hive_apps.core.spec import ModelSpec
from tests.unit.planning_fixtures import fixture_path, gpu, profile

VL7 = "Qwen__Qwen2.5-VL-7B-Instruct"  # has the published preprocessor_config.json
VL3 = "Qwen__Qwen2.5-VL-3B-Instruct"  # config only
GEMMA3 = "google__gemma-3-27b-it"
LLAVA = "llava-hf__llava-1.5-7b-hf"
AUDIO = "qwen2-audio-transformers-defaults"
SMALL_PIXELS = 1280 * 28 * 28


def mm_profile(name: str, **vllm_kwargs):
    return profile(name, **vllm_kwargs)


def plan(name: str, devices, **spec_fields):
    spec = ModelSpec(model_id="m", model=fixture_path(name), **spec_fields)
    return plan_deployment(spec, devices, mm_profile(name, **spec.vllm_kwargs))


# ---- per-item tokens ----------------------------------------------------------------------


def test_qwen_vl_arithmetic_mirrors_qwen2vl_processing_info():
    # get_image_size_with_most_features: factor max_pixels // 28^2 into (h, w) units of 28 px
    assert mm.qwen_image_size_with_most_features(12845056, 14, 2) == (3584, 3584)
    assert mm.qwen_image_size_with_most_features(SMALL_PIXELS, 14, 2) == (896, 1120)
    size = {"shortest_edge": 3136, "longest_edge": 12845056}
    assert mm.qwen_vision_tokens(3584, 3584, 1, patch=14, merge=2, temporal=2, size=size) == 16384
    # real images (research note A5): 640x480 -> 391, 1920x1080 -> 2691
    assert mm.qwen_vision_tokens(480, 640, 1, patch=14, merge=2, temporal=2, size=size) == 391
    assert mm.qwen_vision_tokens(1080, 1920, 1, patch=14, merge=2, temporal=2, size=size) == 2691


def test_qwen25_vl_16384_tokens_per_image_by_default_and_1280_with_small_max_pixels():
    assert mm_profile(VL7).mm_items["image"].tokens == 16384
    assert mm_profile(VL3).mm_items["image"].tokens == 16384  # no preprocessor file: the published one
    small = mm_profile(VL7, mm_processor_kwargs={"max_pixels": SMALL_PIXELS})
    assert small.mm_items["image"].tokens == 1280
    assert small.mm_items["video"].tokens == 8960  # 14 frames -> 7 temporal patches x 1280
    scoped = mm_profile(VL7, mm_processor_kwargs={"images_kwargs": {"max_pixels": 512 * 28 * 28}})
    assert scoped.mm_items["image"].tokens == 512
    by_size = mm_profile(VL7, mm_processor_kwargs={"size": {"longest_edge": SMALL_PIXELS}})
    assert by_size.mm_items["image"].tokens == 1280


def test_other_families_follow_their_vllm_processing_info():
    assert mm_profile(GEMMA3).mm_items["image"].tokens == 256  # mm_tokens_per_image, pan-and-scan off
    pas = mm_profile(GEMMA3, mm_processor_kwargs={"do_pan_and_scan": True})
    assert pas.mm_items["image"].tokens == (4 + 1) * 256  # pan_and_scan_max_num_crops=4 crops + the original
    assert pas.mm_items["image"].encoder_positions == 5 * 64 * 64  # 896 px / patch 14 per crop
    assert mm_profile(LLAVA).mm_items["image"].tokens == 576  # (336/14)^2, CLS dropped
    audio = mm_profile(AUDIO).mm_items["audio"]
    assert (audio.tokens, audio.encoder_positions) == (750, 1500)  # 3000 mel frames -> 1500 -> 750


# ---- limits and towers --------------------------------------------------------------------


def test_default_limits_come_from_the_config():
    assert {m: i.limit for m, i in mm_profile(VL7).mm_items.items()} == {"image": 1, "video": 0}
    assert {m: i.limit for m, i in mm_profile(AUDIO).mm_items.items()} == {"audio": 1}
    assert {m: i.limit for m, i in mm_profile(LLAVA).mm_items.items()} == {"image": 1}
    assert not mm_profile("Qwen__Qwen3-8B").is_multimodal


def test_planner_passes_limits_and_keeps_user_processor_kwargs():
    kw = {"mm_processor_kwargs": {"max_pixels": SMALL_PIXELS}}
    r = plan(VL7, [gpu("H100-80GB")], vllm_kwargs=kw).replicas[0]
    assert r.engine_kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert r.engine_kwargs["mm_processor_kwargs"] == {"max_pixels": SMALL_PIXELS}
    odd = {"image": {"count": 2, "width": 512, "height": 512}}  # vLLM's dict form is passed through as given
    r = plan(VL7, [gpu("H100-80GB")], vllm_kwargs={**kw, "limit_mm_per_prompt": odd}).replicas[0]
    assert r.engine_kwargs["limit_mm_per_prompt"] == {**odd, "video": 0}
    assert r.settings.max_model_len == 1024 + 2 * (1280 + 2) + 256


def test_zero_limits_disable_a_modality_and_all_zero_drops_the_tower():
    full = mm_profile(VL7)
    text_only = mm_profile(VL7, limit_mm_per_prompt={"image": 0})
    tower = full.tower("vision")
    assert tower is not None and text_only.tower("vision") is None
    assert full.weight_bytes - text_only.weight_bytes == tower.params * 2  # bf16 tower weights gone
    assert text_only.mm_prompt_tokens == 0 and not text_only.mm_active
    p = plan(VL7, [gpu("H100-80GB")], vllm_kwargs={"limit_mm_per_prompt": {"image": 0}})
    s = p.replicas[0].settings
    assert s.max_model_len == 1024 + 256 and s.max_num_batched_tokens < 16384
    assert p.replicas[0].engine_kwargs["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    video = mm_profile(VL7, limit_mm_per_prompt={"image": 0, "video": 1},
                       mm_processor_kwargs={"max_pixels": SMALL_PIXELS})
    assert video.tower("vision") is not None and video.mm_prompt_tokens == 8960 + 2  # video keeps the tower
    lm_only = plan(VL7, [gpu("H100-80GB")], vllm_kwargs={"language_model_only": True}).replicas[0]
    assert "limit_mm_per_prompt" not in lm_only.engine_kwargs and lm_only.settings.max_model_len == 1280


# ---- max_model_len, batched tokens, encoder budget --------------------------------------------


@pytest.mark.parametrize("name,kw,per_item", [
    (VL7, {}, 16384 + 2), (VL7, {"mm_processor_kwargs": {"max_pixels": SMALL_PIXELS}}, 1280 + 2),
    (GEMMA3, {}, 256 + 4), (LLAVA, {}, 576), (AUDIO, {}, 750 + 2),
])
def test_max_model_len_is_input_plus_placeholders_plus_output(name, kw, per_item):
    p = plan(name, [gpu("H100-80GB", "a", 0), gpu("H100-80GB", "a", 1)], max_input_prompt_length=512,
             max_output_prompt_length=1024, vllm_kwargs=kw)
    assert p.replicas[0].settings.max_model_len == 512 + per_item + 1024
    three = plan(name, [gpu("H100-80GB", "a", 0), gpu("H100-80GB", "a", 1)], max_input_prompt_length=512,
                 max_output_prompt_length=1024,
                 vllm_kwargs={**kw, "limit_mm_per_prompt": {mm_profile(name).mm_largest_item.modality: 3}})
    assert three.replicas[0].settings.max_model_len == 512 + 3 * per_item + 1024


def test_batched_tokens_hold_the_largest_item():
    r = plan(VL7, [gpu("H100-80GB")]).replicas[0]
    assert r.settings.max_num_batched_tokens >= 16384
    with pytest.raises(PlanningError) as err:
        plan(VL7, [gpu("H100-80GB")], vllm_kwargs={"max_num_batched_tokens": 8192})
    msg = err.value.message
    assert err.value.status_code == 422 and "16384" in msg and "by 8192 tokens" in msg and "max_pixels" in msg


def test_encoder_budget_is_in_the_activation_estimate():
    big, small = mm_profile(VL7), mm_profile(VL7, mm_processor_kwargs={"max_pixels": SMALL_PIXELS})
    text = mm_profile(VL7, limit_mm_per_prompt={"image": 0})
    t = 16384
    a_big, a_small, a_text = (activation_bytes(p, 1, t, 64, 20000) for p in (big, small, text))
    assert a_big > a_small > a_text
    # 16384 tokens of budget hold 1 default image but 12 small ones: the profile encodes all of them
    assert a_small - a_text > 12 * 5120 * 1280 * 2


def test_mm_context_error_names_the_knobs():
    with pytest.raises(MmContextError) as err:
        plan(VL7, [gpu("H100-80GB")], vllm_kwargs={"limit_mm_per_prompt": {"image": 8}})
    e = err.value
    assert isinstance(e, PlanningError) and e.status_code == 422
    assert "max_pixels" in e.message and "limit_mm_per_prompt" in e.message and "max_output_prompt_length" in e.message
    total = 1024 + 8 * 16386 + 256
    assert f"= {total} exceeds the model's max_position_embeddings=128000 by {total - 128000} tokens" in e.message
    with pytest.raises(MmContextError) as err:  # LLaVA: 4096 positions, 576 per image
        plan(LLAVA, [gpu("H100-80GB")], vllm_kwargs={"limit_mm_per_prompt": {"image": 8}})
    assert "limit_mm_per_prompt" in err.value.message and "576" in err.value.message
    ok = plan(VL7, [gpu("H100-80GB")],
              vllm_kwargs={"limit_mm_per_prompt": {"image": 8}, "mm_processor_kwargs": {"max_pixels": SMALL_PIXELS}})
    assert ok.replicas[0].settings.max_model_len == 1024 + 8 * 1282 + 256


def test_user_max_model_len_is_kept_with_a_note():
    p = plan(VL7, [gpu("H100-80GB")], vllm_kwargs={"max_model_len": 8192})
    assert p.replicas[0].settings.max_model_len == 8192
    assert any("max_model_len=8192 is kept" in n for n in p.notes)


# ---- the hook -----------------------------------------------------------------------------


UNKNOWN_VLM = {
    "architectures": ["FooVLForConditionalGeneration"], "model_type": "foo-vl", "hidden_size": 1024,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
    "intermediate_size": 2816, "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 4,
                      "image_size": 384, "patch_size": 16},
}


def test_hook_overrides_multimodal_token_math():
    with pytest.raises(PlanningError) as err:  # vLLM 0.32 has no FooVL: refused, naming it
        profile_from_config_dict(UNKNOWN_VLM)
    assert err.value.status_code == 422 and "FooVLForConditionalGeneration" in err.value.message
    # an architecture vLLM runs, with a vision config the planner has no family for: the generic ViT estimate
    generic = profile_from_config_dict({**UNKNOWN_VLM, "architectures": ["Idefics3ForConditionalGeneration"]})
    assert generic.mm_items["image"].tokens == (384 // 16) ** 2  # generic ViT estimate, noted
    assert any("estimated" in n for n in generic.notes)
    hooked = profile_from_config_dict({**UNKNOWN_VLM, "architectures": ["Idefics3ForConditionalGeneration"]},
                                      vllm_kwargs={
        "hive_attention_cls": "tests.unit.planning_fixtures.FixedImageTokens"})
    assert hooked.mm_items["image"].tokens == 1000
    assert hooked.kv_bytes_per_token(1) == generic.kv_bytes_per_token(1)  # MM-only hook keeps the KV math
    both = profile(VL7, hive_attention_cls="tests.unit.planning_fixtures.KvAndImageHook")
    assert both.mm_items["image"].tokens == 1000 and both.kv_bytes_per_token(1) == 2 * 57344
    p = plan(VL7, [gpu("H100-80GB")], vllm_kwargs={"hive_attention_cls": "tests.unit.planning_fixtures.KvAndImageHook",
                                                   "mm_processor_kwargs": {"tokens_per_image": 2000}})
    assert p.replicas[0].settings.max_model_len == 1024 + 2000 + 256
    assert "hive_attention_cls" not in p.replicas[0].engine_kwargs


def test_hook_without_either_method_is_refused():
    with pytest.raises(PlanningError) as err:
        profile_from_config_dict(UNKNOWN_VLM, vllm_kwargs={"hive_attention_cls": "tests.unit.planning_fixtures.gpu"})
    assert err.value.status_code == 422 and "hive_attention_cls" in err.value.message


def _idefics3_folder(tmp_path, vision: dict, processor: dict, scale: int = 2) -> str:
    """A config and preprocessor file only, written by transformers itself (no weights, no tokenizer)."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3VisionConfig, LlamaConfig

    text = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=1000)
    Idefics3Config(vision_config=Idefics3VisionConfig(**vision).to_dict(), text_config=text.to_dict(),
                   scale_factor=scale).save_pretrained(tmp_path)
    Idefics3ImageProcessorPil(**processor).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("vision, processor, scale", [
    ({"image_size": 364, "patch_size": 14}, {}, 2),  # Idefics3-8B's shape, transformers' processor defaults
    ({"image_size": 512, "patch_size": 16}, {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}},
     4),  # SmolVLM-256M's shape
    ({"image_size": 32, "patch_size": 8}, {"do_image_splitting": False, "size": {"longest_edge": 32},
                                           "max_image_size": {"longest_edge": 32}}, 2),  # hive_apps/models/tiny_vlm.py
])
def test_idefics3_tiles_as_transformers_splits_them(tmp_path, vision, processor, scale):
    """vLLM's Idefics3ProcessingInfo.get_num_image_tokens: the image processor's patch count (tiles + the
    global image, at least 1) x image_seq_len, for its largest (square) image."""
    from transformers import Idefics3ImageProcessorPil

    from hive_apps.core.planning.profile import load_profile

    proc = Idefics3ImageProcessorPil(**processor)
    edge = proc.max_image_size["longest_edge"]
    patches, rows, cols = proc.get_number_of_image_patches(edge, edge, {})
    image_seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // scale ** 2
    item = load_profile(_idefics3_folder(tmp_path, vision, processor, scale), {}).mm_items["image"]
    assert item.tokens == max(patches, 1) * image_seq_len
    assert item.prompt_tokens >= item.tokens + 3 + 2 * rows * cols
    if not rows:  # the tiny VLM: vLLM's prompt held 4 image tokens and 3 wrappers (tests/engine/test_multimodal.py)
        assert (item.tokens, item.prompt_tokens) == (4, 7)


def test_idefics3_splitting_off_is_one_tile(tmp_path):
    folder = _idefics3_folder(tmp_path, {"image_size": 364, "patch_size": 14}, {})
    from hive_apps.core.planning.profile import load_profile

    split = load_profile(folder, {}).mm_items["image"]
    single = load_profile(folder, {"mm_processor_kwargs": {"do_image_splitting": False}}).mm_items["image"]
    assert single.tokens == 169 and split.tokens == 17 * single.tokens
    assert "do_image_splitting" in split.knob


# ---- Gemma 4 and Llama 4 vision towers ----------------------------------------------------------

GEMMA4 = "google__gemma-4-31B-it"
SCOUT = "meta-llama__Llama-4-Scout-17B-16E-Instruct"


def test_gemma4_image_is_its_soft_token_budget():
    """Gemma4ProcessingInfo.get_mm_max_tokens_per_item: vision_config.default_output_length (280), or a
    supported max_soft_tokens from mm_processor_kwargs; <boi> and <eoi> around it; the tower runs over
    tokens x pooling_kernel_size^2 (3 x 3) patches."""
    image = mm_profile(GEMMA4).mm_items["image"]
    assert (image.tokens, image.prompt_tokens, image.encoder_positions, image.limit) == (280, 282, 280 * 9, 1)
    assert mm_profile(GEMMA4, mm_processor_kwargs={"max_soft_tokens": 1120}).mm_items["image"].tokens == 1120
    scoped = mm_profile(GEMMA4, mm_processor_kwargs={"images_kwargs": {"max_soft_tokens": 70}})
    assert scoped.mm_items["image"].tokens == 70
    # vLLM keeps the config's budget for a value outside (70, 140, 280, 560, 1120)
    assert mm_profile(GEMMA4, mm_processor_kwargs={"max_soft_tokens": 300}).mm_items["image"].tokens == 280
    video = mm_profile(GEMMA4).mm_items["video"]
    assert (video.tokens, video.limit) == (32 * (70 + 2 + 6), 0)  # 32 frames; off unless asked for


def test_gemma4_vision_tower_weights_and_replication():
    """transformers' Gemma4VisionModel as vLLM builds it (every linear ReplicatedLinear) plus embed_vision.
    31B tower: 1152 wide, 27 layers of 16 heads x 72 (q, k, v, o, q/k norms), gated MLP 4304, four norms;
    a 16 px patch projection, a 2 x 10240 position table, std bias/scale; projection to 5376."""
    p = mm_profile(GEMMA4)
    layer = 4 * 1152 * (16 * 72) + 2 * 72 + 3 * 1152 * 4304 + 4 * 1152
    embed = 3 * 16 * 16 * 1152 + 2 * 10240 * 1152 + 2 * 1152
    tower = p.tower("vision")
    assert tower is not None and tower.replicated
    assert tower.params == p.params.towers == 27 * layer + embed + 1152 * 5376  # 575,743,536
    # every rank holds the whole tower at TP 2
    off = mm_profile(GEMMA4, limit_mm_per_prompt={"image": 0})
    assert p.weight_bytes_per_rank(2) - off.weight_bytes_per_rank(2) == tower.params * 2


def test_llama4_image_is_sixteen_tiles_and_the_global_image():
    """mllama4.py: the dummy image is max_patches (16) tiles high; 17 chunks of (336 / 14)^2 / 4 = 144
    tokens; the prompt adds <|image_start|>, a separator per tile, <|image|>, <|image_end|>."""
    image = mm_profile(SCOUT).mm_items["image"]
    assert image.tokens == 17 * 144 == 2448
    assert image.prompt_tokens == 2448 + 16 + 3
    assert image.encoder_positions == 17 * (24 * 24 + 1)  # patches plus the class token per chunk
    four = mm_profile(SCOUT, mm_processor_kwargs={"max_patches": 4}).mm_items["image"]
    assert (four.tokens, four.prompt_tokens) == (5 * 144, 5 * 144 + 4 + 3)
    one = mm_profile(SCOUT, mm_processor_kwargs={"max_patches": 1}).mm_items["image"]
    assert (one.tokens, one.prompt_tokens) == (144, 144 + 3)  # a single tile has no global image


def test_llama4_vision_tower_weights():
    """Llama4VisionModel + multi_modal_projector: per layer fused qkv and o with biases, a biased fc1/fc2
    MLP and two LayerNorms; patch projection (no bias), class token, 577 positions, pre/post LayerNorms;
    the pixel-shuffle adapter (5632 -> 4096 -> 4096, no bias) and the projector 4096 -> 5120."""
    vh, vi = 1408, 5632
    layer = (vh * 3 * vh + 3 * vh) + (vh * vh + vh) + (vh * vi + vi) + (vi * vh + vh) + 2 * 2 * vh
    embed = 3 * 14 * 14 * vh + vh + 577 * vh + 2 * 2 * vh
    adapter = 5632 * 4096 + 4096 * 4096
    p = mm_profile(SCOUT)
    tower = p.tower("vision")
    assert tower is not None and not tower.replicated  # TP-sharded unless mm_encoder_tp_mode="data"
    assert tower.params == 34 * layer + embed + adapter + 4096 * 5120
    assert mm_profile(SCOUT, mm_encoder_tp_mode="data").tower("vision").replicated
