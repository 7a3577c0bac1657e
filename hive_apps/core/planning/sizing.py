"""Sizing one replica on its devices: the search over batch tokens and sequences (``Sizer``).

The planner places replicas and asks the sizer for each one's engine settings; packing asks
the same sizer for footprints and scores when it plans a deploy jointly with pending ones, so
both live on these public names rather than on the planner's internals.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning import memory as mem
from hive_apps.core.planning.lora import lora_memory
from hive_apps.core.planning.memory import human_bytes
from hive_apps.core.planning.placement import Placement, capacity, dtype_note, fp8_fallback_note
from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.planning.throughput import Perf, Throughput, device_perf
from hive_apps.core.planning.types import DeviceCapacity, EngineSettings, MmContextError, PlanningError, ReplicaPlan
from hive_apps.core.spec import EngineKind, ModelSpec
from hive_apps.core.vllm_args import legacy_task


def sleeps_in_place(spec: ModelSpec, kind: DeviceKind) -> bool:
    """Whether a replica of ``spec`` on this kind of device gets vLLM's sleep mode (it sleeps in place
    instead of parking): a vLLM engine on a GPU of a model that can sleep."""
    return spec.can_sleep and spec.engine is EngineKind.VLLM and kind is DeviceKind.GPU


def sleep_release_kwargs(tp: int) -> dict[str, bool]:
    """The vLLM options that let an engine asleep in place give back more of its devices
    (``memory.sleep_residual_bytes`` counts what still stays). Read from vLLM 0.32's code:

    - ``sleep_mode_offload_cudagraph`` (config/model.py:380): CUDA graphs are captured into a cuMem
      pool that sleep copies to pinned host RAM at both levels and wake restores in place
      (config/vllm.py ``use_cumem_cudagraph_pool``). It acts only with ``enable_sleep_mode``, the
      default ``cumem`` sleep backend, CUDA graphs on (nothing to offload with ``enforce_eager``)
      and CUDA; it sets ``NCCL_GRAPH_REGISTER=0`` (registration would pin the pool), and custom
      all-reduce copies its buffers at capture instead of registering them (cuda_communicator.py).
      The graphs' host-RAM copy is not booked (a level-1 sleeper books its weights there).
    - ``enable_nccl_comm_suspend`` (config/model.py:383, "experimental"), TP > 1 only: ``Worker.sleep``
      calls ``ncclCommSuspend`` on every device communicator after the pools (gpu_worker.py:312),
      ``wake_up`` calls ``ncclCommResume`` (:334). It needs NCCL >= 2.29.7: pynccl.py checks for the
      symbol and, without it, only warns and keeps the buffers. torch 2.13, which vLLM 0.32 pins,
      pins ``nvidia-nccl-cu13==2.29.7`` (pip metadata, research/gpu-readiness-turn3.md), so it
      suspends. vLLM's custom all-reduce buffers are not NCCL's and stay.
    Neither has run on a GPU under the hive yet (the engine tier runs vLLM on CPU, which cannot sleep)."""
    kwargs = {"sleep_mode_offload_cudagraph": True}
    if tp > 1:
        kwargs["enable_nccl_comm_suspend"] = True
    return kwargs

GPU_BATCH_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
CPU_BATCH_TOKENS = (2048,)  # vLLM's CPU default for API servers; prefill on CPU is compute-bound anyway
GPU_MAX_SEQS = 1024  # vLLM's own default on H100/H200 (research note §A3)
CPU_MAX_SEQS = 64  # a CPU engine serves a few dozen sequences at best
CPU_UTILIZATION = 0.9  # passed on CPU; ignored there when kv_cache_memory_bytes is set
NEAR_BEST = 0.98  # settings within 2 % of the best score count as equally good
RANK_SEQS = 64  # the performance policy ranks devices by expected tokens/s at this batch ...
RANK_TOKENS = 2048  # ... and this many batched tokens (see Sizer.device_speed)
DEFAULT_SEQS = 16  # the demand that packs bench_packing.py's catalog one at a time (HIVE_DEFAULT_DEMAND_SEQS)
FLOOR_SEQS = 4  # the fewest sequences that keep a replica useful: placement prefers a device that holds them


class Overrides(BaseModel):
    """The engine settings a user may fix in vllm_kwargs; everything else passes through."""

    model_config = ConfigDict(extra="ignore")

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int | None = None
    block_size: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    disable_hybrid_kv_cache_manager: bool | None = None

    @field_validator("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes",
                     "tensor_parallel_size", "block_size")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _fraction(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError("must be in (0, 1]")
        return v


class _Choice(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    tokens: int
    seqs: int
    kv_bytes: int  # per rank
    estimate: mem.MemoryEstimate
    score: float


def engine_overrides(spec: ModelSpec) -> tuple[dict[str, Any], Overrides]:
    """The deploy's vLLM arguments (``hive_*`` keys are the hive's) and the sizing ones among them."""
    engine_kwargs, _ = legacy_task({k: v for k, v in spec.vllm_kwargs.items() if not k.startswith("hive_")})
    try:
        return engine_kwargs, Overrides.model_validate(engine_kwargs)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise PlanningError(f"vllm_kwargs.{first['loc'][0]}: {first['msg']}", 422) from exc


def make_sizer(spec: ModelSpec, profile: ModelProfile, budget_is_applied: bool) -> Sizer:
    engine_kwargs, overrides = engine_overrides(spec)
    return Sizer(spec, profile, overrides, engine_kwargs, budget_is_applied)


class Sizer:
    """Sizes one replica on its devices; memoised per device signature (1000 equal GPUs, one search)."""

    def __init__(self, spec: ModelSpec, profile: ModelProfile, overrides: Overrides,
                 engine_kwargs: dict[str, Any], budget_is_applied: bool, demand_seqs: int | None = None) -> None:
        self.spec = spec
        self.profile = profile
        self.ov = overrides
        self.kwargs = engine_kwargs
        self.budget_is_applied = budget_is_applied
        self.input_len = spec.max_input_prompt_length
        self.output_len = 0 if profile.runner == "pooling" else spec.max_output_prompt_length
        self.notes: list[str] = []
        self.mm_item = profile.mm_largest_item
        self.max_model_len = self._max_model_len()
        self.chunked = overrides.enable_chunked_prefill if overrides.enable_chunked_prefill is not None \
            else profile.runner == "generate"
        self.prefix_caching = overrides.enable_prefix_caching if overrides.enable_prefix_caching is not None \
            else profile.runner == "generate"
        self.hybrid = not overrides.disable_hybrid_kv_cache_manager
        self.mm_limits = profile.mm_limits(engine_kwargs) if profile.is_multimodal and \
            not engine_kwargs.get("language_model_only") else None
        if overrides.max_num_seqs and overrides.max_num_batched_tokens and \
                overrides.max_num_seqs > overrides.max_num_batched_tokens:
            raise PlanningError(
                f"vllm_kwargs.max_num_seqs={overrides.max_num_seqs} exceeds max_num_batched_tokens="
                f"{overrides.max_num_batched_tokens}; vLLM requires max_num_seqs <= max_num_batched_tokens", 422)
        if overrides.max_num_batched_tokens and not self.chunked and \
                overrides.max_num_batched_tokens < self.max_model_len:
            raise PlanningError(
                f"vllm_kwargs.max_num_batched_tokens={overrides.max_num_batched_tokens} is below max_model_len="
                f"{self.max_model_len} without chunked prefill; vLLM refuses that. Raise it by "
                f"{self.max_model_len - overrides.max_num_batched_tokens} tokens, turn chunked prefill on, or "
                "shorten the prompt lengths", 422)
        if overrides.max_num_batched_tokens and self.mm_item and \
                overrides.max_num_batched_tokens < self.mm_item.tokens:
            it = self.mm_item
            raise PlanningError(
                f"vllm_kwargs.max_num_batched_tokens={overrides.max_num_batched_tokens} is below the largest "
                f"multimodal item ({it.tokens} tokens per {it.modality}: {it.how}), by "
                f"{it.tokens - overrides.max_num_batched_tokens} tokens; a step must hold one whole item. Raise "
                f"it or turn {it.knob}", 422)
        self.demand = spec.max_concurrency  # the deploy's max_concurrency over all replicas
        self.seq_target: int | None = None  # per replica: set once the replica count is known
        if self.demand is not None and spec.replicas >= 1:
            self.seq_target = -(-self.demand // spec.replicas)
        # No declared demand and nothing fixed that sizes the KV: the hive's demand when it has one
        # (HIVE_DEFAULT_DEMAND_SEQS, planner.py's docstring), else throughput-first.
        self.default_seqs: int | None = None
        if demand_seqs and self.demand is None and not (overrides.max_num_seqs or overrides.kv_cache_memory_bytes
                                                        or overrides.gpu_memory_utilization is not None):
            self.default_seqs = max(FLOOR_SEQS, demand_seqs)
        self.relax_level = 0  # 1: placement needs FLOOR_SEQS of the demand; 2: one sequence
        self._need_cache: dict[tuple[bool, int], int] = {}
        self._plan_cache: dict[tuple[Any, ...], _Choice] = {}
        self._frames: dict[tuple[bool, int, int], mem.Frame] = {}
        self._throughput: dict[tuple[Any, ...], Throughput] = {}
        self._speed: dict[tuple[Any, ...], float] = {}

    def set_target(self, seqs: int) -> None:
        self.seq_target = seqs
        self._need_cache.clear()
        self._plan_cache.clear()

    @property
    def demand_sized(self) -> bool:
        """Sized for a demand (declared or default) rather than throughput-first: placement packs it."""
        return self.seq_target is not None or self.default_seqs is not None

    @property
    def single_gpu_first(self) -> bool:
        """Tensor parallelism or the CPU only once one GPU cannot hold even one sequence: the default demand
        and the floor are not worth either (a declared demand is, at first)."""
        return self.demand_sized and self.relax_level < 2 and (self.relax_level > 0 or self.seq_target is None)

    def relax_demand(self) -> bool:
        """No device holds the demand: ask placement for FLOOR_SEQS, then one; False when nothing is left to relax."""
        if not self.demand_sized or self.relax_level >= 2:
            return False
        self.relax_level += 1
        self._need_cache.clear()
        return True

    # ---- lengths --------------------------------------------------------------------

    def _max_model_len(self) -> int:
        """input + worst-case multimodal placeholder tokens + output (pooling: input + placeholders)."""
        limit = self.profile.max_position_embeddings
        mm_tokens = self.profile.mm_prompt_tokens
        total = self.input_len + mm_tokens + self.output_len
        if self.ov.max_model_len is not None:
            if limit and self.ov.max_model_len > limit:
                raise PlanningError(f"vllm_kwargs.max_model_len={self.ov.max_model_len} exceeds the model's "
                                    f"max_position_embeddings={limit}", 422)
            if self.ov.max_model_len < total:
                self.notes.append(
                    f"vllm_kwargs.max_model_len={self.ov.max_model_len} is kept, but the declared lengths need "
                    f"{total} (input {self.input_len} + multimodal {mm_tokens} + output {self.output_len}); "
                    "longer requests will be refused by vLLM")
            return self.ov.max_model_len
        if mm_tokens and limit and total > limit:
            raise self._mm_context_error(limit, mm_tokens, total)
        if limit and total > limit:
            if self.profile.runner == "pooling":
                raise PlanningError(f"max_input_prompt_length={self.input_len} exceeds the model's "
                                    f"max_position_embeddings={limit} (a pooling model reads the input only)", 422)
            raise PlanningError(
                f"max_input_prompt_length + max_output_prompt_length = {self.input_len} + {self.output_len} = "
                f"{total} exceeds the model's max_position_embeddings={limit}; shorten one of them", 422)
        return total

    def _mm_context_error(self, limit: int, mm_tokens: int, total: int) -> MmContextError:
        parts = []
        knobs: list[str] = []
        for item in self.profile.mm_active.values():
            parts.append(f"{item.limit} {item.modality} x {item.prompt_tokens} tokens ({item.how})")
            knobs.append(item.knob)
        knobs += ["limit_mm_per_prompt (fewer items per prompt, 0 disables a modality)",
                  "max_output_prompt_length", "max_input_prompt_length"]
        knobs = list(dict.fromkeys(knobs))
        room = limit - self.output_len - self.input_len
        return MmContextError(
            f"the context cannot hold the multimodal placeholders plus the output: max_input_prompt_length "
            f"{self.input_len} + multimodal placeholders {mm_tokens} ({'; '.join(parts)}) + "
            f"max_output_prompt_length {self.output_len} = {total} exceeds the model's max_position_embeddings="
            f"{limit} by {total - limit} tokens. Placeholders may take at most {max(0, room)} tokens here. Turn "
            + ", or ".join(knobs), knobs)

    # ---- per-device settings ----------------------------------------------------------

    def eager(self, on_cpu: bool) -> bool:
        return self.ov.enforce_eager if self.ov.enforce_eager is not None else on_cpu

    def token_candidates(self, on_cpu: bool) -> list[int]:
        if self.ov.max_num_batched_tokens:
            return [self.ov.max_num_batched_tokens]
        floor = self.ov.max_num_seqs or self.seq_target or 1  # vLLM: max_num_seqs <= max_num_batched_tokens
        if not self.chunked:
            floor = max(floor, self.max_model_len)
        if self.mm_item is not None:  # one step holds the largest multimodal item whole
            floor = max(floor, self.mm_item.tokens)
        base = CPU_BATCH_TOKENS if on_cpu else GPU_BATCH_TOKENS
        return sorted({max(t, floor) for t in base})

    def seq_cap(self, on_cpu: bool, tokens: int, *, ceiling: bool = False) -> int:
        """The most sequences a plan may have; ``ceiling``: past the default demand, up to throughput-first."""
        if self.ov.max_num_seqs:
            return self.ov.max_num_seqs
        if self.seq_target is not None:  # the demand, as far as one step's tokens allow
            return max(1, min(self.seq_target, tokens))
        hard = max(1, min(CPU_MAX_SEQS if on_cpu else GPU_MAX_SEQS, tokens))
        if self.default_seqs is None or ceiling or self.frame(on_cpu, 1, tokens).per_seq == 0:
            return hard  # sequences without KV cost nothing: the default demand does not bound them
        return min(self.default_seqs, hard)

    def frame(self, on_cpu: bool, tp: int, tokens: int) -> mem.Frame:
        key = (on_cpu, tp, tokens)
        frame = self._frames.get(key)
        if frame is None:
            frame = mem.Frame(self.profile, tp=tp, on_cpu=on_cpu, max_model_len=self.max_model_len,
                              max_num_batched_tokens=tokens, enforce_eager=self.eager(on_cpu),
                              block_size=self.profile.block_size(on_cpu, self.ov.block_size, tp),
                              hybrid_manager=self.hybrid, vllm_kwargs=self.kwargs,
                              prefix_caching=self.prefix_caching, lora=self.spec.lora)
            self._frames[key] = frame
        return frame

    def _estimate(self, on_cpu: bool, tp: int, tokens: int, seqs: int, kv_bytes: int | None = None) -> mem.MemoryEstimate:
        return self.frame(on_cpu, tp, tokens).estimate(seqs, kv_bytes)

    def device_speed(self, dc: DeviceCapacity) -> float:
        """Expected tokens/s of this model on one such device at a canonical batch: the performance ranking.

        The roofline of ``Throughput`` at tp=1, ``RANK_SEQS`` sequences and ``RANK_TOKENS``
        batched tokens, independent of the device's free memory, so the ranking is about speed
        (memory bandwidth for decode, compute for prefill), not size.
        """
        d = dc.device
        on_cpu = d.kind is DeviceKind.CPU
        key = (on_cpu, d.memory_bandwidth_gbps, d.fp16_tflops, d.fp8_tflops, d.cpu_count)
        speed = self._speed.get(key)
        if speed is None:
            perf = device_perf([dc], on_cpu, 1, self.eager(on_cpu), self.profile)
            tokens = max(RANK_TOKENS, self.token_candidates(on_cpu)[0])
            speed = self._speed[key] = self.score(perf, 1, tokens, min(RANK_SEQS, tokens))
        return speed

    def min_need(self, on_cpu: bool, tp: int) -> int:
        """Smallest footprint per device any plan can have: what placement compares with capacity."""
        key = (on_cpu, tp)
        if key not in self._need_cache:
            tokens = self.token_candidates(on_cpu)[0]
            seqs = self.ov.max_num_seqs or 1
            if not self.ov.max_num_seqs and self.demand_sized and self.relax_level < 2:
                seqs = self.seq_cap(on_cpu, tokens)
                if self.relax_level == 1:
                    seqs = min(FLOOR_SEQS, seqs)
            self._need_cache[key] = self.frame(on_cpu, tp, tokens).total(seqs, self.ov.kv_cache_memory_bytes)
        return self._need_cache[key]

    def plan_replica(self, index: int, placement: Placement) -> ReplicaPlan:
        devs = placement.devices
        on_cpu = placement.on_cpu
        tp = placement.tp
        cap = min(capacity(dc, budget_is_applied=self.budget_is_applied) for dc in devs) // placement.share
        if placement.budget is not None:  # the share a joint plan with pending deploys gave it
            cap = min(cap, placement.budget)
        perf = device_perf(devs, on_cpu, tp, self.eager(on_cpu), self.profile)
        fill = placement.budget is not None  # a joint plan's share: its sequences are what it was given for
        key = (on_cpu, tp, cap, tuple(dc.device.total_bytes for dc in devs), perf.bandwidth, perf.flops, perf.step_s,
               fill)
        choice = self._plan_cache.get(key)
        if choice is None:
            choice = self._choose(devs, on_cpu, tp, cap, perf, fill=fill)
            self._plan_cache[key] = choice
        util = self._utilization(devs, on_cpu, choice)
        settings = EngineSettings(
            tensor_parallel_size=tp, max_model_len=self.max_model_len, max_num_seqs=choice.seqs,
            max_num_batched_tokens=choice.tokens, gpu_memory_utilization=util,
            kv_cache_memory_bytes=choice.kv_bytes, enforce_eager=self.eager(on_cpu),
        )
        engine_kwargs = dict(self.kwargs)
        engine_kwargs.update(settings.model_dump())
        if self.mm_limits is not None:
            engine_kwargs["limit_mm_per_prompt"] = dict(self.mm_limits)
        if tp > 1 and not on_cpu:
            engine_kwargs.setdefault("distributed_executor_backend", "mp")
        if sleeps_in_place(self.spec, devs[0].device.kind):
            engine_kwargs["enable_sleep_mode"] = True  # it sleeps in place (level 1 or 2) instead of parking
            engine_kwargs.update(sleep_release_kwargs(tp))
        notes = list(placement.notes)
        if self.spec.lora is not None:
            engine_kwargs.update(self.spec.lora.engine_kwargs())
            notes.append(self._lora_note(on_cpu, tp, choice))
        if self.seq_target is not None and choice.seqs < self.seq_target:
            notes.append(f"max_concurrency={self.demand} asks {self.seq_target} sequences of this replica; "
                         f"{choice.seqs} fit on {', '.join(dc.device.id for dc in devs)} (the rest queue): add "
                         "replicas or free memory for the full demand")
        notes.extend(n for dc in devs if (n := dtype_note(self.profile, dc)))
        notes.extend(n for dc in devs if (n := fp8_fallback_note(self.profile, dc)))
        first = devs[0].device
        return ReplicaPlan(
            index=index, node_id=first.node_id, node_name=first.node_name,
            devices=[dc.device.id for dc in devs], device_kind=first.kind,
            device_indices=[dc.device.index for dc in devs if dc.device.index is not None and not on_cpu],
            settings=settings, memory=choice.estimate.memory, reservation_bytes=choice.estimate.memory.total,
            engine_kwargs=engine_kwargs, expected_tokens_per_s=round(choice.score, 1), notes=notes,
        )

    def _lora_note(self, on_cpu: bool, tp: int, choice: _Choice) -> str:
        """What the plan books for LoRA on each device, and what it leaves to the node's host RAM."""
        lora = self.spec.lora
        assert lora is not None
        lm = lora_memory(self.profile, lora, tp=tp, tokens=choice.tokens, seqs=choice.seqs, on_cpu=on_cpu)
        ranks = mem.ranks_on_device(on_cpu, tp)
        cache = (f"and its cache of {lora.cpu_loras} adapters {human_bytes(lm.cpu_cache)} in the same RAM" if on_cpu
                 else f"its cache of {lora.cpu_loras} adapters takes up to {human_bytes(lm.cpu_cache)} of the node's "
                      "host RAM (not booked)")
        return (f"lora: {lora.max_loras} slots of rank {lora.max_lora_rank} {human_bytes(lm.slots_per_rank * ranks)} + "
                f"punica buffers {human_bytes(lm.punica_per_rank * ranks)} booked per device, {cache}; one adapter of "
                f"that rank on every module is {human_bytes(lm.adapter_bytes)}")

    # ---- the search -----------------------------------------------------------------

    def _choose(self, devs: list[DeviceCapacity], on_cpu: bool, tp: int, cap: int, perf: Perf, *,
                fill: bool = False) -> _Choice:
        ov = self.ov
        if not on_cpu and ov.gpu_memory_utilization is not None and ov.kv_cache_memory_bytes is None:
            return self._fill_utilization(devs, tp, cap, perf)
        options: list[tuple[float, int, int]] = []  # (score, tokens, seqs)
        for tokens in self.token_candidates(on_cpu):
            top = self._max_seqs(on_cpu, tp, tokens, cap, ceiling=fill)
            if top >= 1:
                options.append((self.score(perf, tp, tokens, top), tokens, top))
        if not options:
            raise self._no_fit(devs, on_cpu, tp, cap)
        best = max(o[0] for o in options)
        threshold = NEAR_BEST * best
        free_seqs = self.frame(on_cpu, tp, options[0][1]).per_seq == 0
        picks: list[tuple[int, float, int, int]] = []  # (footprint, -score, tokens, seqs)
        for score, tokens, top in options:
            if score < threshold:
                continue
            seqs = top
            if not (ov.max_num_seqs or ov.kv_cache_memory_bytes or free_seqs or self.seq_target or fill):
                lo, hi = min(FLOOR_SEQS, top) if self.default_seqs else 1, top  # fewest that still score near the best
                while lo < hi:
                    mid = (lo + hi) // 2
                    if self.score(perf, tp, tokens, mid) >= threshold:
                        hi = mid
                    else:
                        lo = mid + 1
                seqs = lo
                score = self.score(perf, tp, tokens, seqs)
            footprint = self.frame(on_cpu, tp, tokens).total(seqs, ov.kv_cache_memory_bytes)
            picks.append((footprint, -score, tokens, seqs))
        _, neg_score, tokens, seqs = min(picks)
        frame = self.frame(on_cpu, tp, tokens)
        kv = ov.kv_cache_memory_bytes or frame.kv_bytes(seqs)
        return _Choice(tokens=tokens, seqs=seqs, kv_bytes=kv, estimate=frame.estimate(seqs, kv), score=-neg_score)

    def _max_seqs(self, on_cpu: bool, tp: int, tokens: int, cap: int, *, ceiling: bool = False) -> int:
        """The most sequences whose footprint fits ``cap`` at this batch size (0: none)."""
        frame = self.frame(on_cpu, tp, tokens)
        kv = self.ov.kv_cache_memory_bytes
        hi = self.seq_cap(on_cpu, tokens, ceiling=ceiling)
        lo = 1
        if self.ov.max_num_seqs:
            lo = hi
        elif kv:
            fit = mem.seqs_for_kv(kv, frame.per_seq, frame.block)
            if fit < 1:
                raise PlanningError(
                    f"vllm_kwargs.kv_cache_memory_bytes={kv} ({human_bytes(kv)}) cannot hold one request of "
                    f"max_model_len={self.max_model_len} tokens: that needs "
                    f"{human_bytes(frame.per_seq + frame.block)}, short by "
                    f"{human_bytes(frame.per_seq + frame.block - kv)}", 422)
            hi = lo = min(hi, fit)
        if frame.total(lo, kv) > cap:
            return 0
        if frame.total(hi, kv) <= cap:
            return hi
        while lo < hi:  # largest seqs that fits
            mid = (lo + hi + 1) // 2
            if frame.total(mid, kv) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _fill_utilization(self, devs: list[DeviceCapacity], tp: int, cap: int, perf: Perf) -> _Choice:
        """User fixed gpu_memory_utilization: KV takes whatever that budget leaves."""
        util = self.ov.gpu_memory_utilization or 0.0
        budget = int(util * min(dc.device.total_bytes for dc in devs))
        best: _Choice | None = None
        shortfall = None
        for tokens in self.token_candidates(False):
            seqs = self.ov.max_num_seqs or self.seq_cap(False, tokens)
            lo, hi = 1, seqs
            if self.ov.max_num_seqs:
                lo = seqs
            frame = self.frame(False, tp, tokens)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if frame.total(mid) - frame.context <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            in_budget = frame.total(lo) - frame.context
            if in_budget > budget:
                shortfall = in_budget - budget if shortfall is None else min(shortfall, in_budget - budget)
                continue
            kv = frame.kv_bytes(lo) + (budget - in_budget)  # fill the user's budget
            est = frame.estimate(lo, kv)
            choice = _Choice(tokens=tokens, seqs=lo, kv_bytes=kv, estimate=est, score=self.score(perf, tp, tokens, lo))
            if best is None or choice.score > best.score:
                best = choice
        if best is None:
            raise PlanningError(
                f"vllm_kwargs.gpu_memory_utilization={util} gives {human_bytes(budget)} per device, but one request "
                f"of max_model_len={self.max_model_len} with the weights needs more: short by "
                f"{human_bytes(shortfall or 0)}", 422)
        if best.estimate.memory.total > cap:
            raise PlanningError(
                f"vllm_kwargs.gpu_memory_utilization={util} asks for {human_bytes(best.estimate.memory.total)} per "
                f"device with the CUDA context, but {devs[0].device.id} can give {human_bytes(cap)}: short by "
                f"{human_bytes(best.estimate.memory.total - cap)}", 422)
        return best

    def _utilization(self, devs: list[DeviceCapacity], on_cpu: bool, choice: _Choice) -> float:
        if self.ov.gpu_memory_utilization is not None:
            util = self.ov.gpu_memory_utilization
            if not on_cpu:
                for dc in devs:
                    if util * dc.device.total_bytes + choice.estimate.context_bytes > dc.free_bytes:
                        raise PlanningError(
                            f"vllm_kwargs.gpu_memory_utilization={util} x {human_bytes(dc.device.total_bytes)} "
                            f"plus the CUDA context exceeds the {human_bytes(dc.free_bytes)} free on {dc.device.id}: "
                            f"vLLM would refuse to start (short by "
                            f"{human_bytes(util * dc.device.total_bytes + choice.estimate.context_bytes - dc.free_bytes)})",
                            422)
            return util
        if on_cpu:
            return CPU_UTILIZATION
        total = min(dc.device.total_bytes for dc in devs)
        util = math.ceil(choice.estimate.in_budget / total * 1000) / 1000
        # Mixed cards in a TP group: util is a fraction of each rank's own total, so a bigger
        # card could fail the start check; the start check wins (KV is explicit anyway).
        ceiling = min(math.floor((dc.free_bytes - choice.estimate.context_bytes) / dc.device.total_bytes * 1000)
                      for dc in devs) / 1000
        return min(util, ceiling)

    def _no_fit(self, devs: list[DeviceCapacity], on_cpu: bool, tp: int, cap: int) -> PlanningError:
        tokens = self.token_candidates(on_cpu)[0]
        seqs = self.ov.max_num_seqs or 1
        est = self._estimate(on_cpu, tp, tokens, seqs, self.ov.kv_cache_memory_bytes)
        need = est.memory.total
        fixed = [f"{k}={v}" for k, v in self.ov.model_dump(exclude_none=True).items()]
        why = f" with vllm_kwargs {', '.join(fixed)}" if fixed else ""
        ids = ", ".join(dc.device.id for dc in devs)
        m = est.memory
        lora = f", LoRA {human_bytes(m.lora)}" if m.lora else ""
        return PlanningError(
            f"{self.spec.model_id!r} does not fit on {ids}{why}: the smallest plan (max_num_seqs={seqs}, "
            f"max_num_batched_tokens={tokens}, max_model_len={self.max_model_len}, tensor_parallel_size={tp}) needs "
            f"{human_bytes(need)} per device (weights {human_bytes(m.weights)}, KV {human_bytes(m.kv_cache)}, "
            f"activations {human_bytes(m.activations)}, overhead {human_bytes(m.overhead)}{lora}) but it can give "
            f"{human_bytes(cap)}: short by {human_bytes(need - cap)} ({need - cap} bytes)", 422)

    # ---- throughput -----------------------------------------------------------------

    def score(self, perf: Perf, tp: int, tokens: int, seqs: int) -> float:
        key = (tp, perf.bandwidth, perf.flops, perf.step_s)
        model = self._throughput.get(key)
        if model is None:
            model = self._throughput[key] = Throughput(self.profile, perf, tp, self.input_len, self.output_len)
        return model.tokens_per_s(tokens, seqs)
