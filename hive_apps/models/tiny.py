"""A tiny random-weight chat model, built offline in seconds: the hive's embedded default.

vLLM (CPU or GPU) loads it like any Hugging Face checkpoint, so the whole path (plan,
engine, chat template, streaming, structured output) runs with no download and no GPU.
The answers are gibberish by design. Shape: Qwen2 with head_dim 32 (vLLM's CPU attention
accepts 32, 64, 80, ... only), 2 layers, GQA 4:2, vocabulary 2048 from a byte-level BPE
trained on this machine's Python sources, ChatML template that takes string or list
content (vLLM turns message content into lists of parts before it renders).

    python -m hive_apps.models.tiny --out ~/.cache/ray-hive/tiny-chat
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen2's pre-tokenizer split, so the raw tokenizer and transformers' Qwen2 tokenizer agree.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- elif m.role == 'assistant' -%}
<|im_start|>assistant
{{ text(m.content) }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>{{ text(m.content) }}</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ text(m.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif -%}"""


def corpus_files(max_bytes: int) -> list[str]:
    """Deterministic local training text: the standard library's Python sources."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        files.append(path)
        total += os.path.getsize(path)
        if total >= max_bytes:
            break
    return files


def train_tokenizer(vocab_size: int, max_bytes: int, special_tokens: list[str] | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens or SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(max_bytes), trainer)
    return tok


def build_tiny_model(out: str | Path, vocab_size: int = 2048, corpus_bytes: int = 1_500_000, seed: int = 0) -> Path:
    """Write the checkpoint to ``out`` (skipped when a complete one is already there)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out).expanduser()
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size, corpus_bytes)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    config = Qwen2Config(**text_config(tok.get_vocab_size(), ids), dtype="bfloat16")
    torch.manual_seed(seed)
    save_weights(Qwen2ForCausalLM(config).to(torch.bfloat16), out, ids)  # type: ignore[arg-type]
    return out


def save_weights(model, out: Path, ids: dict[str, int]) -> None:
    """Safetensors, and a generation config that stops at the chat template's end of turn."""
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }))


LORA_TARGETS = ("q_proj", "v_proj")


def build_tiny_lora(base_folder: str | Path, out: str | Path, rank: int = 8, seed: int = 1,
                    base_name: str = "hive-test/tiny-chat") -> Path:
    """A random-weight PEFT LoRA adapter for the tiny chat model in ``base_folder`` (or any Qwen2/Llama
    shaped checkpoint): ``adapter_config.json`` and ``adapter_model.safetensors`` written directly, on
    q_proj and v_proj of every layer, rank ``rank``. B is not zero (PEFT initialises it to zero, which
    would change nothing) and large next to the base's random weights, so the adapter's greedy answers
    differ from the base's and, per ``seed``, from each other's. ``base_name`` goes into the config's
    ``base_model_name_or_path``."""
    import torch
    from safetensors.torch import save_file

    base = json.loads((Path(base_folder).expanduser() / "config.json").read_text())
    hidden, layers = base["hidden_size"], base["num_hidden_layers"]
    head_dim = base.get("head_dim") or hidden // base["num_attention_heads"]
    outs = {"q_proj": base["num_attention_heads"] * head_dim,
            "v_proj": base.get("num_key_value_heads", base["num_attention_heads"]) * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=gen) * 0.2).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(outs[module], rank, generator=gen) * 0.2).to(torch.bfloat16)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(LORA_TARGETS),
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }, indent=2))
    return out


# --- what the multimodal tiny models (tiny_vlm.py, tiny_audio.py) share with this one ---------------

# The language side of every tiny checkpoint: head_dim 32, which vLLM's CPU attention accepts.
TEXT_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True}


def text_config(vocab_size: int, ids: dict[str, int]) -> dict:
    """Keyword arguments of the text model's config (Qwen2Config, LlamaConfig alike)."""
    return {"vocab_size": vocab_size, **TEXT_SHAPE, "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}


def chat_template_with_media(part_types: tuple[str, ...], placeholder: str) -> str:
    """CHAT_TEMPLATE with content parts of these types rendered as the placeholder their processor expands."""
    types = ", ".join(repr(t) for t in part_types)
    return CHAT_TEMPLATE.replace(
        "{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}",
        "{%- if part.type == 'text' -%}{{ part.text }}"
        "{%- elif part.type in (" + types + ") -%}" + placeholder + "{%- endif -%}",
    )


def media_tokenizer(vocab_size: int, corpus_bytes: int, media_tokens: list[str]):
    """This model's tokenizer plus a media model's special tokens: (raw tokenizer, special ids, HF tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + media_tokens
    raw = train_tokenizer(vocab_size, corpus_bytes, specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    return raw, {t: raw.token_to_id(t) for t in specials}, tokenizer


def save_processor(processor, tokenizer, chat_template: str, out: Path) -> None:
    """The processor and its tokenizer, both carrying the chat template (vLLM reads either)."""
    processor.save_pretrained(out)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)


def cli(doc: str | None, build, folder: str) -> None:
    """``python -m hive_apps.models.<module> [--out DIR]``: build into DIR (default ~/.cache/ray-hive/<folder>)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "ray-hive" / folder))
    print(build(ap.parse_args().out))


if __name__ == "__main__":
    cli(__doc__, build_tiny_model, "tiny-chat")
