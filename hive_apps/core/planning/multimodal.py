"""Multimodal towers and the worst-case placeholder tokens of one item, the way vLLM 0.32 counts them.

vLLM sizes multimodal work from the *largest possible item* of each modality
(``vllm/multimodal/encoder_budget.py::get_mm_max_toks_per_item``): either the model's
``ProcessingInfo.get_mm_max_tokens_per_item`` or the placeholder embeddings of a dummy input
at the largest size. That number drives the encoder budget (``max(max_num_batched_tokens,
largest item)``), the profiling pass (the tower runs on as many worst-case items as the
budget holds and keeps their outputs while the language model is profiled) and, with the
items a prompt may carry (``limit_mm_per_prompt``), how long a prompt can get.

Per family (each function below cites the vLLM code it mirrors):

* Qwen2-VL / Qwen2.5-VL (``qwen2_vl.py::Qwen2VLProcessingInfo``): the image with most
  features is ``unit x factors(max_pixels // unit^2)`` with ``unit = patch x merge``,
  resized by ``smart_resize`` within ``[min_pixels, max_pixels]``; tokens =
  ``(h / patch) x (w / patch) / merge^2``. Published processor: 16384 tokens per image;
  ``max_pixels = 1280*28*28``: 1280. Video: up to 14 frames, two frames per temporal patch.
* Gemma 3 (``gemma3_mm.py::Gemma3ProcessingInfo``): ``mm_tokens_per_image`` (256) per crop,
  ``(crops + 1)`` crops with pan-and-scan (off by default; at most
  ``pan_and_scan_max_num_crops`` = 4 extra crops).
* LLaVA (``llava.py::BaseLlavaProcessingInfo``): ``(image_size / patch)^2`` (+1 CLS, dropped
  by the ``default`` feature select strategy): 576 for CLIP ViT-L/336.
* Idefics3 / SmolVLM (``idefics3.py::Idefics3ProcessingInfo``, transformers'
  ``Idefics3ImageProcessor.get_number_of_image_patches``): an image is resized to
  ``size.longest_edge`` and, with ``do_image_splitting`` (the default), cut into tiles of
  ``max_image_size.longest_edge`` plus one global image; each tile is ``image_seq_len =
  (image_size / patch)^2 / scale_factor^2`` tokens (pixel shuffle). Idefics3 defaults: 1456 / 364 px,
  4 x 4 tiles + 1 = 17 x 169 = 2873 tokens per image.
* Gemma 4 (``gemma4_mm.py::Gemma4ProcessingInfo.get_mm_max_tokens_per_item``): the pooler yields at most
  ``vision_config.default_output_length`` soft tokens per image (280), or the ``max_soft_tokens`` of
  ``mm_processor_kwargs`` when it is one of 70, 140, 280, 560, 1120; the tower runs over ``tokens x
  pooling_kernel_size^2`` patches. A video is up to 32 frames of 70 tokens plus 8 wrapper tokens each.
* Llama 4 (``mllama4.py::Mllama4ProcessingInfo``, no ``get_mm_max_tokens_per_item``: vLLM measures its
  dummy image, ``max_patches`` tiles high and one wide): ``max_patches`` tiles plus the global image, each
  ``(image_size / patch)^2 x pixel_shuffle_ratio^2`` tokens (144 at 336 px, 16 tiles: 17 x 144 = 2448).
* Qwen2-Audio (``qwen2_audio.py::Qwen2AudioProcessingInfo``): a 30 s clip at 16 kHz, hop
  160 = 3000 mel frames -> ``((3000 - 1) // 2 + 1 - 2) // 2 + 1`` = 750 tokens.

``limit_mm_per_prompt`` defaults come from the HF config: a vision tower gives
``{"image": 1}``, an audio tower ``{"audio": 1}``; every other modality the model supports
(Qwen-VL video) is passed as 0, because vLLM's own default for an unnamed modality is 999
and would profile a worst-case video. Explicit user values win; a 0 disables a modality, and
a tower whose modalities are all 0 is not loaded (``SupportsMultiModal._mark_tower_model``),
so its weights drop out of the plan.

A ``hive_attention_cls`` hook may define ``mm_max_tokens_per_item(mm_processor_kwargs) ->
{modality: tokens}`` to replace this math for models the hive does not know.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

# Qwen2-VL published processor (preprocessor_config.json of Qwen2/2.5-VL): min/max pixels.
QWEN_VL_MIN_PIXELS = 56 * 56
QWEN_VL_MAX_PIXELS = 12845056
# transformers' Qwen2VLImageProcessor default size when a preprocessor file has no size keys.
QWEN_VL_TRANSFORMERS_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
QWEN_VL_MAX_FRAMES_PER_VIDEO = 14  # vllm/model_executor/models/qwen2_vl.py::_MAX_FRAMES_PER_VIDEO
QWEN_VL_MAX_ASPECT = 200  # smart_resize refuses more extreme aspect ratios
# transformers/models/gemma3/processing_gemma3.py Gemma3ProcessorKwargs defaults.
GEMMA3_PAN_AND_SCAN = {"do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256,
                       "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
# transformers' Idefics3 defaults: Idefics3ImageProcessor size / max_image_size / MAX_IMAGE_SIZE,
# Idefics3VisionConfig image_size / patch_size.
IDEFICS3_LONGEST_EDGE, IDEFICS3_TILE_EDGE, IDEFICS3_MAX_EDGE = 4 * 364, 364, 4096
IDEFICS3_VISION_IMAGE_SIZE, IDEFICS3_VISION_PATCH = 224, 32
# vllm/model_executor/models/gemma4_mm.py: _SUPPORTED_SOFT_TOKENS, _VIDEO_MAX_SOFT_TOKENS, _VIDEO_MAX_FRAMES, and
# the 2 + 6 tokens around each frame (get_mm_max_tokens_per_item); <boi> and <eoi> around an image (get_image_repl).
GEMMA4_SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
GEMMA4_VIDEO_TOKENS_PER_FRAME = 70
GEMMA4_VIDEO_MAX_FRAMES = 32
GEMMA4_VIDEO_WRAPPER_TOKENS_PER_FRAME = 2 + 6
GEMMA4_IMAGE_WRAPPER_TOKENS = 2
# transformers Llama4ImageProcessor default max_patches (tiles per image, without the global one).
LLAMA4_MAX_PATCHES = 16
# WhisperFeatureExtractor defaults (Qwen2-Audio's processor): 16 kHz, hop 160, 30 s chunks.
WHISPER_SAMPLING_RATE = 16000
WHISPER_HOP_LENGTH = 160
WHISPER_CHUNK_LENGTH = 30
# Prompt tokens around an item's placeholders (an upper bound, so max_model_len is never short):
# Qwen-VL <|vision_start|>..<|vision_end|>; Gemma 3 "\n\n<boi>..<eoi>\n\n" per crop plus the
# pan-and-scan sentence; Qwen2-Audio <|audio_bos|>..<|audio_eos|>.
QWEN_VL_WRAPPER_TOKENS = 2
GEMMA3_WRAPPER_TOKENS_PER_CROP = 4
GEMMA3_PAN_AND_SCAN_TEXT_TOKENS = 32
AUDIO_WRAPPER_TOKENS = 2


class TowerInfo(BaseModel):
    """A multimodal encoder with its projector: enough to size its weights and its profiling pass."""

    kind: str  # "vision" | "audio" | "hook"
    modalities: list[str]  # the vLLM modalities it serves
    hidden_size: int
    intermediate_size: int
    num_layers: int
    params: int
    replicated: bool = False  # mm_encoder_tp_mode="data": every rank holds the whole tower
    loaded: bool = True  # False when every modality it serves has limit 0


class MmItem(BaseModel):
    """The worst-case item of one modality."""

    modality: str
    tower: str  # TowerInfo.kind
    tokens: int  # placeholder embeddings vLLM counts for it (get_mm_max_tokens_per_item)
    prompt_tokens: int  # tokens it adds to a prompt: placeholders + wrapper tokens (upper bound)
    encoder_positions: int  # sequence positions the tower runs over for it (patches, audio frames)
    limit: int  # items per prompt (limit_mm_per_prompt)
    knob: str  # what to turn to make it smaller (named in MmContextError)
    how: str = ""  # how the figure was derived (for notes and errors)


# ---- limit_mm_per_prompt ---------------------------------------------------------------


def limit_count(value: Any) -> int:
    """An entry of limit_mm_per_prompt as vLLM reads it: an int or {"count": n, ...} (default 999)."""
    if isinstance(value, dict):
        return int(value.get("count", 999))
    return int(value)


def resolve_limits(supported: list[str], defaults: dict[str, int], vllm_kwargs: dict[str, Any]) -> dict[str, int]:
    """Items per prompt for every supported modality: the user's, else the hive's default."""
    if vllm_kwargs.get("language_model_only"):
        return dict.fromkeys(supported, 0)
    user = vllm_kwargs.get("limit_mm_per_prompt")
    user = user if isinstance(user, dict) else {}
    return {m: limit_count(user[m]) if m in user else defaults.get(m, 0) for m in supported}


def engine_limits(items: dict[str, MmItem], vllm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``limit_mm_per_prompt`` for the engine: the user's entries untouched, the hive's defaults added."""
    user = vllm_kwargs.get("limit_mm_per_prompt")
    out: dict[str, Any] = dict(user) if isinstance(user, dict) else {}
    for modality, item in items.items():
        out.setdefault(modality, item.limit)
    return out


# ---- per-family token math -------------------------------------------------------------


def _scoped(mm_kwargs: dict[str, Any], scope: str) -> dict[str, Any]:
    """vLLM routes flat mm_processor_kwargs into each HF scope; scoped values win."""
    flat = {k: v for k, v in mm_kwargs.items() if not k.endswith("_kwargs")}
    inner = mm_kwargs.get(scope) or {}
    merged = dict(flat)
    for key, value in inner.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _qwen_size(scoped: dict[str, Any], default: dict[str, int]) -> dict[str, int]:
    """Qwen2VLProcessingInfo._get_vision_size: size overrides defaults, then min/max_pixels."""
    size = dict(default)
    if isinstance(scoped.get("size"), dict):
        size.update({k: int(v) for k, v in scoped["size"].items() if v is not None})
    if scoped.get("min_pixels") is not None:
        size["shortest_edge"] = int(scoped["min_pixels"])
    if scoped.get("max_pixels") is not None:
        size["longest_edge"] = int(scoped["max_pixels"])
    return size


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize (no torchvision needed)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_image_size_with_most_features(max_pixels: int, patch: int, merge: int) -> tuple[int, int]:
    """Qwen2VLProcessingInfo.get_image_size_with_most_features: (height, width)."""
    unit = patch * merge
    max_seq_len = max_pixels // (unit * unit)
    height_factor, width_factor = 1, max(1, max_seq_len)
    for seq_len in range(max_seq_len, 0, -1):
        d = math.isqrt(seq_len)
        while seq_len % d:
            d -= 1
        height_factor, width_factor = d, seq_len // d
        if width_factor / height_factor <= QWEN_VL_MAX_ASPECT:
            break
    return unit * height_factor, unit * width_factor


def qwen_vision_tokens(height: int, width: int, frames: int, *, patch: int, merge: int, temporal: int,
                       size: dict[str, int]) -> int:
    """Qwen2VLProcessingInfo._get_vision_info: tokens of one image (frames=1) or video."""
    h, w = qwen_smart_resize(height, width, patch * merge, size["shortest_edge"], size["longest_edge"])
    padded = frames + (-frames % temporal)
    grid_t = max(padded // temporal, 1)
    return grid_t * (h // patch) * (w // patch) // (merge * merge)


def qwen_vl_items(vc: Any, get: Any, preprocessor: dict[str, Any] | None, mm_kwargs: dict[str, Any],
                  notes: list[str]) -> dict[str, tuple[int, int, str]]:
    """{modality: (tokens per item, tower positions per item, how)} for Qwen2/2.5-VL."""
    patch = int(get(vc, "patch_size", "spatial_patch_size", default=14))
    merge = int(get(vc, "spatial_merge_size", default=2))
    temporal = int(get(vc, "temporal_patch_size", default=2))
    if preprocessor is None:
        default = {"shortest_edge": QWEN_VL_MIN_PIXELS, "longest_edge": QWEN_VL_MAX_PIXELS}
        notes.append("no preprocessor_config.json: assuming the published Qwen-VL processor "
                     f"(min_pixels {QWEN_VL_MIN_PIXELS}, max_pixels {QWEN_VL_MAX_PIXELS})")
    else:  # Qwen2VLImageProcessor.__init__: size, then min_pixels / max_pixels
        default = dict(QWEN_VL_TRANSFORMERS_SIZE)
        if isinstance(preprocessor.get("size"), dict):
            default.update({k: int(v) for k, v in preprocessor["size"].items()
                            if k in ("shortest_edge", "longest_edge") and v})
        if preprocessor.get("min_pixels"):
            default["shortest_edge"] = int(preprocessor["min_pixels"])
        if preprocessor.get("max_pixels"):
            default["longest_edge"] = int(preprocessor["max_pixels"])
    image_size = _qwen_size(_scoped(mm_kwargs, "images_kwargs"), default)
    video_size = _qwen_size(_scoped(mm_kwargs, "videos_kwargs"), default)
    height, width = qwen_image_size_with_most_features(image_size["longest_edge"], patch, merge)
    image = qwen_vision_tokens(height, width, 1, patch=patch, merge=merge, temporal=temporal, size=image_size)
    frames = QWEN_VL_MAX_FRAMES_PER_VIDEO
    video = qwen_vision_tokens(height, width, frames, patch=patch, merge=merge, temporal=temporal, size=video_size)
    how = (f"{width}x{height} px image at max_pixels={image_size['longest_edge']} "
           f"(patch {patch}, merge {merge})")
    return {"image": (image, image * merge * merge, how),
            "video": (video, video * merge * merge, f"{frames} frames of the largest image, "
                      f"videos max_pixels={video_size['longest_edge']}")}


def gemma3_image(cfg: Any, vc: Any, get: Any, preprocessor: dict[str, Any] | None,
                 mm_kwargs: dict[str, Any]) -> tuple[int, int, int, str]:
    """(tokens, prompt tokens, tower positions, how) of Gemma 3's worst image (Gemma3ProcessingInfo)."""
    opts = dict(GEMMA3_PAN_AND_SCAN)
    for source in (preprocessor or {}, _scoped(mm_kwargs, "images_kwargs")):
        opts.update({k: source[k] for k in GEMMA3_PAN_AND_SCAN if source.get(k) is not None})
    per_crop = int(get(cfg, "mm_tokens_per_image", default=256))
    native = int(get(vc, "image_size", default=896))
    patch = int(get(vc, "patch_size", default=14))
    crops = 0
    if opts["do_pan_and_scan"]:
        n = int(opts["pan_and_scan_max_num_crops"])
        width, height = native, native * n  # get_image_size_with_most_features
        if height / width >= float(opts["pan_and_scan_min_ratio_to_activate"]):
            crops_h = min(int(math.floor(height / int(opts["pan_and_scan_min_crop_size"]))),
                          int(math.floor(height / width + 0.5)))
            crops_h = min(n, max(2, crops_h))
            if min(width, int(math.ceil(height / crops_h))) >= int(opts["pan_and_scan_min_crop_size"]):
                crops = crops_h
    tokens = (crops + 1) * per_crop
    prompt = tokens + (crops + 1) * GEMMA3_WRAPPER_TOKENS_PER_CROP + (GEMMA3_PAN_AND_SCAN_TEXT_TOKENS if crops else 0)
    positions = (crops + 1) * (native // patch) ** 2
    how = f"{crops + 1} crop(s) x {per_crop} tokens" + (" (pan-and-scan)" if crops else "")
    return tokens, prompt, positions, how


def llava_image(cfg: Any, vc: Any, get: Any) -> tuple[int, int, str]:
    """(tokens, tower positions, how) of a LLaVA-1.5 image: CLIP patches, CLS dropped by 'default'."""
    image = int(get(vc, "image_size", default=336))
    patch = int(get(vc, "patch_size", default=14))
    positions = (image // patch) ** 2 + 1
    strategy = get(cfg, "vision_feature_select_strategy", default="default")
    tokens = positions - 1 if strategy == "default" else positions
    return tokens, positions, f"CLIP {image}px / patch {patch}, select '{strategy}'"


def idefics3_image(cfg: Any, vc: Any, get: Any, preprocessor: dict[str, Any] | None,
                   mm_kwargs: dict[str, Any]) -> tuple[int, int, int, str]:
    """(tokens, prompt tokens, tower positions, how) of the largest Idefics3/SmolVLM image.

    A square image splits most (transformers ``get_number_of_image_patches``); vLLM counts the
    image tokens of every tile (``get_num_image_tokens``), the prompt adds per tile a fake-image
    and a ``<row_i_col_j>`` token, a newline per row, and the global image's three wrappers."""
    scoped = _scoped(mm_kwargs, "images_kwargs")
    pre = {**(preprocessor or {}), **scoped}
    image = int(get(vc, "image_size", default=IDEFICS3_VISION_IMAGE_SIZE))
    patch = int(get(vc, "patch_size", default=IDEFICS3_VISION_PATCH))
    scale = int(get(cfg, "scale_factor", default=2))
    per_tile = (image // patch) ** 2 // (scale * scale)
    longest = min(int((pre.get("size") or {}).get("longest_edge", IDEFICS3_LONGEST_EDGE)), IDEFICS3_MAX_EDGE)
    tile = int((pre.get("max_image_size") or {}).get("longest_edge", IDEFICS3_TILE_EDGE))
    rows = math.ceil(longest / tile) if pre.get("do_image_splitting", True) and longest > tile else 0
    crops = rows * rows + 1 if rows else 1
    tokens = crops * per_tile
    prompt = tokens + 2 * rows * rows + rows + (1 if rows else 0) + 3
    how = (f"{rows} x {rows} tiles of {tile} px + the global image" if rows else "one image, no tiling") + \
        f", {per_tile} tokens each ((image_size {image} / patch {patch})^2 / scale_factor {scale}^2)"
    return tokens, prompt, crops * (image // patch) ** 2, how


def gemma4_items(vc: Any, get: Any, mm_kwargs: dict[str, Any]) -> dict[str, tuple[int, int, int, str]]:
    """{modality: (tokens, prompt tokens, tower positions, how)} for Gemma 4's vision tower
    (Gemma4ProcessingInfo.get_mm_max_tokens_per_item, _compute_num_soft_tokens)."""
    default = get(vc, "default_output_length")
    if default is None:
        raise ValueError("vision_config.default_output_length is missing (vLLM's Gemma 4 reads it for the "
                         "tokens of an image)")
    chosen = mm_kwargs.get("max_soft_tokens")  # _get_max_soft_tokens: flat first, then images_kwargs
    if chosen is None:
        chosen = (mm_kwargs.get("images_kwargs") or {}).get("max_soft_tokens")
    tokens = int(chosen) if isinstance(chosen, int) and chosen in GEMMA4_SUPPORTED_SOFT_TOKENS else int(default)
    pool = int(get(vc, "pooling_kernel_size", default=3)) ** 2
    frame = GEMMA4_VIDEO_TOKENS_PER_FRAME
    video = GEMMA4_VIDEO_MAX_FRAMES * (frame + GEMMA4_VIDEO_WRAPPER_TOKENS_PER_FRAME)
    return {
        "image": (tokens, tokens + GEMMA4_IMAGE_WRAPPER_TOKENS, tokens * pool,
                  f"{tokens} soft tokens (max_soft_tokens; {tokens * pool} patches pooled {pool}:1)"),
        "video": (video, video, GEMMA4_VIDEO_MAX_FRAMES * frame * pool,
                  f"{GEMMA4_VIDEO_MAX_FRAMES} frames of {frame} soft tokens"),
    }


def llama4_image(vc: Any, get: Any, preprocessor: dict[str, Any] | None,
                 mm_kwargs: dict[str, Any]) -> tuple[int, int, int, str]:
    """(tokens, prompt tokens, tower positions, how) of Llama 4's largest image.

    vLLM's dummy image is ``max_patches`` tiles high (get_image_size_with_most_features), so it is
    cut into ``max_patches`` tiles plus the global image; each yields ``get_patch_per_chunk`` patch
    tokens. The prompt (Llama4Processor._prompt_split_image) adds <|image_start|>, one separator per
    tile, <|image|> and <|image_end|>."""
    scoped = _scoped(mm_kwargs, "images_kwargs")
    tiles = int(scoped.get("max_patches") or (preprocessor or {}).get("max_patches") or LLAMA4_MAX_PATCHES)
    image = int(get(vc, "image_size", default=448))
    patch = int(get(vc, "patch_size", default=14))
    shuffle = float(get(vc, "pixel_shuffle_ratio", default=0.5))
    per_chunk = (image // patch) ** 2 // int(round(1.0 / (shuffle * shuffle)))
    chunks = tiles + 1 if tiles > 1 else 1
    tokens = chunks * per_chunk
    prompt = tokens + (tiles if tiles > 1 else 0) + 3
    how = (f"{tiles} tiles of {image} px + the global image, {per_chunk} tokens each "
           f"((image_size {image} / patch {patch})^2 x pixel_shuffle_ratio {shuffle}^2)")
    return tokens, prompt, chunks * ((image // patch) ** 2 + 1), how


def whisper_audio(preprocessor: dict[str, Any] | None) -> tuple[int, int, str]:
    """(tokens, encoder positions, how) of Qwen2-Audio's longest clip (Qwen2AudioProcessingInfo)."""
    pre = preprocessor or {}
    chunk = min(int(pre.get("chunk_length") or WHISPER_CHUNK_LENGTH), 30)
    rate = int(pre.get("sampling_rate") or WHISPER_SAMPLING_RATE)
    hop = int(pre.get("hop_length") or WHISPER_HOP_LENGTH)
    mel = chunk * rate // hop
    feat = (mel - 1) // 2 + 1  # Qwen2AudioEncoder._get_feat_extract_output_lengths
    tokens = (feat - 2) // 2 + 1
    return tokens, feat, f"{chunk} s at {rate} Hz, hop {hop}: {mel} mel frames"
