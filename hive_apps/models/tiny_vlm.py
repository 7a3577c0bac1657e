"""A tiny random-weight vision-language model (Idefics3: SigLIP-style tower + Llama), built offline.

The multimodal counterpart of ``tiny.py``: vLLM runs the whole image path on it (vLLM's
media parsing, the HF ``Idefics3Processor`` with its PIL image processor, the vision
tower, the pixel-shuffle connector, placeholder expansion), so an engine test can chat
about images with no download and no GPU. Answers are gibberish by design.

Why Idefics3 and not LLaVA: vLLM 0.32's ``llava`` module (and llava_next/onevision,
qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3_mm, internvl) imports transformers' Pixtral or
other image processors that need torchvision, and PyPI's torchvision is a CUDA build
that cannot load beside the CPU torch; ``idefics3`` imports cleanly and vLLM handles its
PIL image processor. Idefics3 also takes any number of images per prompt
(``limit_mm_per_prompt`` is the deploy's to set), where PaliGemma/BLIP-2 take one.

Shape: images resized to 32x32 with no tiling, 8x8 patches, pixel shuffle x2 = 4 image
tokens per image (plus 3 wrapper tokens); the text side reuses tiny.py's tokenizer (plus
Idefics3's image tokens) and ChatML template with image parts rendered as ``<image>``;
head_dim 32 on the text side (vLLM's CPU attention accepts 32, 64, 80, ...).

    python -m hive_apps.models.tiny_vlm --out ~/.cache/ray-hive/tiny-vlm
"""

from __future__ import annotations

from pathlib import Path

from hive_apps.models.tiny import (
    chat_template_with_media,
    cli,
    media_tokenizer,
    save_processor,
    save_weights,
    text_config,
)

IMAGE_TOKEN = "<image>"
IMAGE_SPECIALS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 32, 8, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
VLM_CHAT_TEMPLATE = chat_template_with_media(("image", "image_url"), IMAGE_TOKEN)


def build_tiny_vlm(out: str | Path, vocab_size: int = 2048, corpus_bytes: int = 1_500_000, seed: int = 0) -> Path:
    """Write the checkpoint to ``out`` (skipped when a complete one is already there)."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    out = Path(out).expanduser()
    if (out / "model.safetensors").exists() and (out / "processor_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    raw, ids, tokenizer = media_tokenizer(vocab_size, corpus_bytes, IMAGE_SPECIALS)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=IMAGE_SEQ_LEN, chat_template=VLM_CHAT_TEMPLATE)
    save_processor(processor, tokenizer, VLM_CHAT_TEMPLATE, out)
    text = LlamaConfig(**text_config(raw.get_vocab_size(), ids))
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            image_token_id=ids[IMAGE_TOKEN], scale_factor=SCALE_FACTOR,
                            pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True)
    config.dtype = "bfloat16"
    torch.manual_seed(seed)
    save_weights(Idefics3ForConditionalGeneration(config).to(torch.bfloat16), out, ids)  # type: ignore[arg-type]
    return out


if __name__ == "__main__":
    cli(__doc__, build_tiny_vlm, "tiny-vlm")
