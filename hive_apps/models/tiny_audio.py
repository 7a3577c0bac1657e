"""A tiny random-weight audio-language model (Qwen2-Audio: Whisper-style encoder + Qwen2), built offline.

The audio counterpart of ``tiny_vlm.py``: vLLM runs the whole audio path on it (its media
decoding with soundfile, resampling to 16 kHz, the HF ``Qwen2AudioProcessor`` with Whisper's
log-mel feature extractor, the audio encoder, the projector, placeholder expansion), so an
engine test can chat about a WAV with no download and no GPU. Answers are gibberish by design.

Why Qwen2-Audio: transformers ships its config, processor and encoder (vLLM reuses the
encoder class), so no remote code is needed; Ultravox's processor lives on the Hub only.
A clip of ``s`` seconds becomes ``audio_tokens(s)`` placeholder tokens (Whisper's two
stride-2 steps over 100 mel frames a second) between ``<|audio_bos|>``/``<|audio_eos|>``.

    python -m hive_apps.models.tiny_audio --out ~/.cache/ray-hive/tiny-audio
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

AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS = "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"
SAMPLE_RATE, MEL_BINS = 16_000, 128
AUDIO_CHAT_TEMPLATE = chat_template_with_media(("audio", "audio_url", "input_audio"), AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS)


def audio_tokens(seconds: float) -> int:
    """Placeholder tokens for a clip: mel frames (10 ms hop), halved by the encoder's conv, halved by its pooling."""
    frames = int(seconds * 100)
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def build_tiny_audio(out: str | Path, vocab_size: int = 2048, corpus_bytes: int = 1_500_000, seed: int = 0) -> Path:
    """Write the checkpoint to ``out`` (skipped when a complete one is already there)."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    out = Path(out).expanduser()
    if (out / "model.safetensors").exists() and (out / "processor_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    raw, ids, tokenizer = media_tokenizer(vocab_size, corpus_bytes, [AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS])
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLE_RATE)
    processor = Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer,
                                    chat_template=AUDIO_CHAT_TEMPLATE)
    save_processor(processor, tokenizer, AUDIO_CHAT_TEMPLATE, out)
    text = Qwen2Config(**text_config(raw.get_vocab_size(), ids))
    encoder = Qwen2AudioEncoderConfig(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2,
                                      encoder_ffn_dim=128, d_model=64)
    config = Qwen2AudioConfig(audio_config=encoder.to_dict(), text_config=text.to_dict(),
                              audio_token_index=ids[AUDIO_TOKEN])
    config.dtype = "bfloat16"
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.bfloat16)  # type: ignore[arg-type]
    save_weights(model, out, ids)
    # transformers 5 writes this architecture's text weights as ``language_model.model.model.*``
    # (its save-time key renaming applied twice); vLLM loads the original layout.
    save_file({vllm_name(k): v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def vllm_name(key: str) -> str:
    """The original Qwen2-Audio checkpoint's name for an in-memory parameter, as vLLM loads it."""
    for prefix, original in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                             ("model.", "")):
        if key.startswith(prefix):
            return original + key[len(prefix):]
    return key


if __name__ == "__main__":
    cli(__doc__, build_tiny_audio, "tiny-audio")
