"""LoRA memory in the plan (``core/planning/lora.py``): vLLM 0.32's allocation, computed by hand for
known configs, and what the planner passes to vLLM and books for it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hive_apps.core.planning.lora import lora_memory, lora_problem, punica_bytes, slot_elements
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.types import PlanningError
from hive_apps.core.spec import LoraSpec, ModelSpec
from tests.unit.planning_fixtures import cpu, fixture_path, gpu, profile

TINY = "tiny-qwen2"  # Qwen2: hidden 128, 4 heads of 32, 2 KV heads, intermediate 256, 2 layers, vocab 2048, bf16
QWEN3 = "Qwen__Qwen3-0.6B"  # hidden 1024, 16 heads of 128, 8 KV heads, intermediate 3072, 28 layers, vocab 151936, tied


def test_one_slot_of_the_tiny_qwen2_by_hand():
    """Qwen2ForCausalLM lists no embedding_modules: only the four linear wrappers of each layer."""
    r = 8
    qkv = 3 * (r * 128) + (128 + 64 + 64) * r  # MergedQKVParallelLinearWithLoRA: 3 A slices, B of q + k + v
    o = r * 128 + 128 * r  # RowParallelLinearWithLoRA: A r x (heads x head_dim), B hidden x r
    gate_up = 2 * (r * 128) + 2 * 256 * r  # MergedColumnParallelLinearWithLoRA: 2 slices
    down = r * 256 + 128 * r
    assert qkv + o + gate_up + down == 16384
    assert slot_elements(profile(TINY), r) == 2 * 16384  # two layers


def test_the_tiny_qwen2s_lora_memory_on_cpu_and_gpu():
    p, lora = profile(TINY), LoraSpec(max_loras=4, max_lora_rank=8)
    on_cpu = lora_memory(p, lora, tp=1, tokens=2048, seqs=64, on_cpu=True)
    assert on_cpu.adapter_bytes == 32768 * 2  # one adapter of rank 8 on every module, bf16
    assert on_cpu.slots_per_rank == 4 * 65536  # max_loras slots, allocated at start whatever is loaded
    # punica: 4 int64 index tensors of T, 3 of S; the qkv shrink buffer, fp32, 3 x T x r
    assert on_cpu.punica_per_rank == 4 * 2048 * 8 + 3 * 64 * 8 + 3 * 2048 * 8 * 4 == 263680
    assert on_cpu.cpu_cache == 4 * 65536  # max_cpu_loras defaults to max_loras
    assert on_cpu.on_device(1, on_cpu=True) == 262144 + 263680 + 262144  # a CPU device holds its cache too
    on_gpu = lora_memory(p, lora, tp=1, tokens=2048, seqs=64, on_cpu=False)
    # CUDA adds two LoRAKernelMeta: two int32 tensors of T, and 3 of max_loras + 1, + 1, + 2
    assert on_gpu.punica_per_rank - on_cpu.punica_per_rank == 2 * (2 * 2048 * 4 + (5 + 5 + 6) * 4) == 32896
    assert on_gpu.on_device(1, on_cpu=False) == 262144 + 296576  # the CPU cache is host RAM there
    bigger = lora_memory(p, LoraSpec(max_loras=4, max_lora_rank=8, max_cpu_loras=20), tp=1, tokens=2048, seqs=64,
                         on_cpu=True)
    assert bigger.cpu_cache == 20 * 65536


def test_qwen3_adds_embedding_slots_and_tied_embeddings_count_twice():
    """Qwen3ForCausalLM lists embed_tokens and lm_head in embedding_modules; its lm_head is the embedding."""
    r = 16
    layer = r * (7 * 1024 + 2 * 2048 + 2 * 1024 + 3 * 3072)
    embed = r * (151936 + 1024)  # VocabParallelEmbeddingWithLoRA: A vocab x r, B hidden x r
    logits = r * (1024 + 151936)  # LogitsProcessorWithLoRA: A r x hidden, B vocab x r
    assert slot_elements(profile(QWEN3), r) == 28 * layer + embed + logits + embed == 17434624
    mem = lora_memory(profile(QWEN3), LoraSpec(), tp=1, tokens=8192, seqs=256, on_cpu=False)
    assert mem.slots_per_rank == 4 * 17434624 * 2 == 139476992  # max_loras=4, rank 16, bf16
    # tensor parallel 2: q, kv and intermediate are split (8 KV heads: 4 per rank); embeddings are not
    layer_tp2 = r * (7 * 1024 + 2 * 1024 + 2 * 512 + 3 * 1536)
    assert slot_elements(profile(QWEN3), r, tp=2) == 28 * layer_tp2 + 2 * embed + logits
    assert punica_bytes(4, 16, 8192, 256, on_cpu=False) == (4 * 8192 * 8 + 3 * 256 * 8 + 2 * (2 * 8192 * 4 + 16 * 4)
                                                            + 3 * 8192 * 16 * 4)


def _plan(lora: dict | None, device, **kw):
    spec = ModelSpec(model_id="q", model=fixture_path(QWEN3), engine="sim", max_input_prompt_length=512,
                     max_output_prompt_length=128, lora=lora, vllm_kwargs={"max_num_seqs": 8, **kw})
    return plan_deployment(spec, [device], profile(QWEN3))


def test_the_plan_books_the_lora_memory_and_passes_vllms_settings():
    without = _plan(None, gpu("L4"), enforce_eager=True).replicas[0]
    with_lora = _plan({"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 8}, gpu("L4"), enforce_eager=True).replicas[0]
    s = with_lora.settings
    expected = lora_memory(profile(QWEN3), LoraSpec(max_loras=4, max_lora_rank=16, max_cpu_loras=8), tp=1,
                           tokens=s.max_num_batched_tokens, seqs=s.max_num_seqs, on_cpu=False).on_device(1, on_cpu=False)
    assert with_lora.memory.lora == expected > 139_000_000
    assert with_lora.reservation_bytes == with_lora.memory.total == without.reservation_bytes + expected
    assert {k: with_lora.engine_kwargs[k] for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")} == \
        {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 8}
    assert "enable_lora" not in without.engine_kwargs and without.memory.lora == 0
    note = next(n for n in with_lora.notes if n.startswith("lora:"))
    assert "4 slots of rank 16" in note and "host RAM (not booked)" in note
    # with CUDA graphs, vLLM captures each size with and without LoRA: more than the slots alone
    graphs = _plan({"max_loras": 4}, gpu("L4")).replicas[0]
    plain = _plan(None, gpu("L4")).replicas[0]
    assert graphs.memory.overhead > plain.memory.overhead and graphs.memory.lora > 0
    on_cpu = _plan({"max_loras": 2, "max_lora_rank": 8}, cpu()).replicas[0]
    assert on_cpu.memory.lora == lora_memory(profile(QWEN3), LoraSpec(max_loras=2, max_lora_rank=8), tp=1,
                                             tokens=on_cpu.settings.max_num_batched_tokens,
                                             seqs=on_cpu.settings.max_num_seqs, on_cpu=True).on_device(1, on_cpu=True)
    assert "in the same RAM" in next(n for n in on_cpu.notes if n.startswith("lora:"))


@pytest.mark.parametrize("name, words", [
    ("BAAI__bge-m3", "pooling model"),
    ("Qwen__Qwen3-30B-A3B", "MoE experts"),
    ("nvidia__Nemotron-H-56B-Base-8K", "recurrent layers"),
    ("google__gemma-3-1b-it", "not Gemma3ForCausalLM"),
])
def test_models_the_planner_does_not_model_lora_for_are_refused_with_the_fix(name, words):
    problem = lora_problem(profile(name))
    assert problem is not None and words in problem and "drop lora" in problem
    spec = ModelSpec(model_id="x", model=fixture_path(name), engine="sim", max_output_prompt_length=0
                     if "bge" in name else 64, lora={})
    with pytest.raises(PlanningError) as caught:
        plan_deployment(spec, [gpu("H100-80GB")], profile(name))
    assert caught.value.status_code == 422 and caught.value.message.startswith("lora: ")


def test_the_lora_field_is_checked_where_it_is_written():
    assert LoraSpec().model_dump() == {"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": None}
    with pytest.raises(ValidationError, match="one of vLLM's ranks .* got 12; the next one up is 16"):
        LoraSpec(max_lora_rank=12)
    with pytest.raises(ValidationError, match="max_cpu_loras=2 is below max_loras=4"):
        LoraSpec(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValidationError, match="extra"):
        LoraSpec(max_loras=2, target_modules=["q_proj"])
    body = {"model_id": "m", "model": fixture_path(QWEN3)}
    with pytest.raises(ValidationError, match="pooling model"):
        ModelSpec(**body, lora={}, vllm_kwargs={"runner": "pooling"})
    for key in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules"):
        with pytest.raises(ValidationError, match=f"{key} is refused: set by the hive from the deploy's 'lora'"):
            ModelSpec(**body, vllm_kwargs={key: 1})
