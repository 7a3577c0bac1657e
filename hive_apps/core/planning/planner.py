"""Plan a deployment: which devices each replica gets, and the vLLM settings that fit there.

This module places the replicas; ``sizing.py`` searches each one's settings (``Sizer``) and
``throughput.py`` holds the roofline below, so ``packing.py`` uses both without the planner.

Objective ("throughput first"). For each replica the planner searches
``max_num_batched_tokens`` (T) over powers of two and ``max_num_seqs`` (S) up to the most
that fit, with KV for S full-length requests, and scores each pair with a roofline estimate
of output tokens per second for the declared lengths (P input, G output tokens)::

    decode step  t_d(S) = step overhead + max(bytes read / bandwidth, flops / compute)
                 bytes read = weights (MoE: the experts S x top_k tokens touch) + S x (P + G/2) x KV/token
                 flops      = S x (2 x active params + attention over P + G/2 tokens)
    prefill step t_p(T) = step overhead + max(weights / bandwidth, T x flops per token / compute)
    tokens/s   = S x G / (G x t_d(S) + ceil(S x P / T) x t_p(T))       (pooling: S x P / prefill time)

Bandwidth and compute are the device's datasheet figures (``core/catalog.py``: real
GPUs are identified by their NVML name; a card the catalog lacks gets NVML-derived estimates,
listed in its ``estimates``) at 80 % and 50 % efficiency; compute is the dense FP16/BF16
figure, or the FP8 one for fp8-weight checkpoints on cards with FP8 tensor cores; a
step costs 1.5 ms with CUDA graphs, 4 ms eager, 10 ms on CPU. The estimate only ranks
settings (and is reported as ``expected_tokens_per_s``); it is not a promise. Among the
settings within 2 % of the best score the one with the smallest footprint wins, so a replica
does not take a whole GPU for a 1 % gain and co-located models keep room. Limits: one
request shape (the declared maximum lengths), no prefix-cache hits, no queueing, no
speculative decoding, datasheet figures; T is searched over powers of two only.

Demand. The sizing rule, in order:

* ``max_concurrency`` given (the deploy's demand over all replicas, split evenly and rounded
  up): exactly that many sequences per replica and KV for them (the 2 % trimming does not
  apply); placement prefers a device that holds them, and where none does, the replica gets
  the most that fit and a note saying so. ``vllm_kwargs.max_num_seqs`` is the per-replica
  override and cannot be combined with it.
* no ``max_concurrency``, with ``demand_seqs`` (HIVE_DEFAULT_DEMAND_SEQS, off by default; issue
  33): sized for that demand all the same, so the first deploy onto an empty card does not take
  it: ``demand_seqs`` sequences per replica at the declared lengths (``DEFAULT_SEQS`` = 16 packs
  bench_packing.py's catalog one at a time), never below ``FLOOR_SEQS`` = 4; the search above runs with that cap (so the 2 % knee may trim it, not below
  the floor). Sequences without KV (encoders) and fixed ``max_num_seqs``, ``kv_cache_memory_bytes``
  or ``gpu_memory_utilization`` are not capped. Throughput-first is only the ceiling: a demand of
  ``GPU_MAX_SEQS`` reaches it, and the joint plan below gives spare memory up to it.
* nothing pending, no ``max_concurrency``, no ``demand_seqs``: throughput-first for the model alone,
  as above (until a model sized for a demand can grow back when it needs to, issue 33).
* placement of a demand-sized deploy packs (``placement.py``): the fastest card that holds the
  demand whatever else runs there, the fullest of equal cards, so whole cards stay free for models
  only they hold; then the floor on one GPU; tensor parallelism or the CPU only when no GPU holds
  one sequence (a declared demand may take them at once). Throughput-first deploys (fixed
  ``max_num_seqs`` etc.) and user policies keep unshared-first.
* deploys pending (``pending=``): the deploy is planned jointly with them (``packing.py``):
  fit first (best-fit decreasing on their smallest footprints), then the spare memory where
  it buys the most (square root of each deploy's planned tokens/s), and the deploy takes its
  own GPU and share of that plan, unless the joint plan would place fewer pending deploys on
  GPUs than the normal plan leaves room for. So the best device is given up exactly when
  keeping it would leave a pending model without room, or cost the others more than it gains.

The plan reports ``expected_tokens_per_s`` (per replica and summed) and
``planned_concurrency`` (the sum of ``max_num_seqs``).

The same estimate ranks devices for the ``performance`` allocation policy
(``Sizer.device_speed`` in ``sizing.py``: tokens/s at 64 sequences and 2048 batched tokens on one such
device), so a card with more bandwidth wins decode-heavy work even with fewer TFLOPS.

``max_model_len`` = input + worst-case multimodal placeholder tokens (items per prompt x
tokens per item, ``multimodal.py``) + output (pooling: no output). When the model's
positions cannot hold that, a multimodal model gets an ``MmContextError`` (422) that names
the knob to turn (``max_pixels``, ``limit_mm_per_prompt``, the lengths). Multimodal plans
pass ``limit_mm_per_prompt`` explicitly (the user's entries, the hive's defaults for the
rest) and keep the user's ``mm_processor_kwargs``.

vLLM's rules are never broken: ``max_num_seqs <= max_num_batched_tokens``; without chunked
prefill (pooling models, or ``enable_chunked_prefill=False``) ``max_num_batched_tokens >=
max_model_len``; ``max_num_batched_tokens`` >= the largest multimodal item (one step holds a
whole item; the encoder budget is ``max(T, item)``); KV holds ``max_num_seqs`` requests of
``max_model_len`` tokens, block-rounded, plus the null block. ``kv_cache_memory_bytes`` is
always passed explicitly, and ``gpu_memory_utilization`` is the smallest multiple of 0.001 of the device's total that covers
the in-budget footprint (everything but the CUDA context) and passes vLLM's start check
(``util x total + context <= free``). On CPU, ``gpu_memory_utilization=0.9`` is passed but
ignored by vLLM when ``kv_cache_memory_bytes`` is set (the CPU start check is skipped then).

User overrides in ``vllm_kwargs`` are honoured exactly: ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, ``kv_cache_memory_bytes``,
``gpu_memory_utilization`` (then KV fills that budget), ``enforce_eager``,
``tensor_parallel_size``, ``kv_cache_dtype``, ``block_size``, ``enable_chunked_prefill``,
``enable_prefix_caching``. One that cannot fit, or that breaks one of vLLM's rules above,
raises a 422 that says by how much. Keys starting with ``hive_`` belong to the hive and are
stripped from the engine kwargs (``hive_attention_cls``: a user family class, ``profile/families/``;
``hive_placement_policy``: a user placement policy by class path, ``placement.py``). Checkpoints quantized with a method vLLM 0.32 does not have
(bitsandbytes) are refused for the real engine. A deploy that names no ``tool_call_parser`` /
``reasoning_parser`` gets them from the model's family and chat template (``parsers.py``), in the
engine kwargs and the plan's notes.
"""

from __future__ import annotations

from collections.abc import Sequence

from hive_apps.core.planning.lora import lora_problem
from hive_apps.core.planning.memory import human_bytes
from hive_apps.core.planning.packing import joint_slot
from hive_apps.core.planning.parsers import apply_choice, choose_parsers, read_chat_template
from hive_apps.core.planning.placement import PLACEMENT_POLICY_KEY, Placement, UserPolicy, place_auto, place_pinned
from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.planning.sizing import Sizer, engine_overrides, make_sizer
from hive_apps.core.planning.types import DeviceCapacity, Plan, PlanningError, Rejection
from hive_apps.core.spec import EngineKind, ModelSpec
from hive_apps.core.vllm_args import legacy_task


def plan_deployment(spec: ModelSpec, devices: list[DeviceCapacity], profile: ModelProfile, *,
                    budget_is_applied: bool = True,
                    pending: Sequence[tuple[ModelSpec, ModelProfile]] = (),
                    demand_seqs: int | None = None) -> Plan:
    """Place every replica of ``spec`` and size its engine; raises PlanningError when it cannot.

    ``devices`` is the registry's snapshot. With ``budget_is_applied`` (the registry's view)
    ``available_bytes`` already is budget - reservations - foreign use; without it the
    planner itself keeps each device under 90 % of its total (``DEFAULT_BUDGET_FRACTION``).
    Replicas of this plan that share a device split its capacity evenly.

    ``pending``: deploys still to be planned after this one (spec and profile). With any,
    an automatic single-replica deploy is planned jointly with them (``packing.py``): it
    takes the GPU and the share of memory that the joint plan gives it, so it does not take
    the room a pending model needs.

    ``demand_seqs``: the sequences per replica a deploy without ``max_concurrency`` is sized for
    (HIVE_DEFAULT_DEMAND_SEQS); None: throughput-first.
    """
    engine_kwargs, overrides = engine_overrides(spec)
    quant = profile.quant
    if spec.engine is EngineKind.VLLM and quant is not None and not quant.vllm_supported:
        raise PlanningError(
            f"{spec.model!r} is quantized with {quant.method!r} ({quant.weight_format}), which vLLM 0.32 does not "
            "support (its quantization methods include fp8, gptq, awq, compressed-tensors, modelopt, mxfp4); "
            "use a checkpoint in one of those formats, or engine 'sim' to plan it anyway", 422)
    if spec.lora is not None and (problem := lora_problem(profile)):
        raise PlanningError(f"lora: {problem}", 422)
    parsers = choose_parsers(model_type=profile.model_type, model=spec.model, user=engine_kwargs, runner=profile.runner,
                             template=engine_kwargs.get("chat_template") or read_chat_template(profile.path))
    engine_kwargs = apply_choice(engine_kwargs, parsers)
    sizer = Sizer(spec, profile, overrides, engine_kwargs, budget_is_applied, demand_seqs)
    policy_path = spec.vllm_kwargs.get(PLACEMENT_POLICY_KEY)
    policy = UserPolicy(policy_path) if policy_path is not None else None  # checked for pins too
    policy_notes: list[str] = []

    if spec.pins:
        placements = place_pinned(spec, devices, profile, overrides.tensor_parallel_size)
        rejected: list[Rejection] = []
    else:
        try:
            while True:
                try:
                    placements, rejected = place_auto(spec, devices, profile, sizer.min_need,
                                                      overrides.tensor_parallel_size,
                                                      budget_is_applied=budget_is_applied, speed=sizer.device_speed,
                                                      policy=policy, pack=sizer.demand_sized,
                                                      single_gpu=sizer.single_gpu_first)
                    break
                except PlanningError:
                    if not sizer.relax_demand():  # no device holds the whole demand: the floor, then the most that fit
                        raise
        except PlanningError as exc:
            fixed = overrides.model_dump(exclude_none=True)
            if fixed and exc.status_code == 422:
                exc.message += ("; sized with the fixed vllm_kwargs "
                                + ", ".join(f"{k}={v}" for k, v in fixed.items()) + ", which the planner never lowers")
                exc.args = (exc.message,)
            raise
        if policy is not None:
            policy_notes.append(f"devices ranked by {PLACEMENT_POLICY_KEY} {policy.path!r} within the hive's "
                                f"fit and unshared-first rules (allocation={spec.allocation.value!r} not used)")
    slot = None
    if pending and policy is None and not spec.pins:
        use: dict[str, int] = {}
        for i, p in enumerate(placements):
            r = sizer.plan_replica(i, p)
            for dev in r.devices:
                use[dev] = use.get(dev, 0) + r.reservation_bytes
        slot = joint_slot(spec, sizer, pending, devices, lambda s, p: make_sizer(s, p, budget_is_applied),
                          budget_is_applied, use)
        if slot is not None:
            placements, rejected = [Placement(devices=[slot.device], tp=1, budget=slot.budget)], []
            policy_notes.append(
                f"planned jointly with {slot.pending} pending deploy(s) (packing.py): this one takes "
                f"{slot.device.device.id} with up to {human_bytes(slot.budget)}; the joint plan places "
                f"{slot.placed_pending} of them on GPUs")
    if sizer.demand is not None and spec.replicas == -1:
        sizer.set_target(-(-sizer.demand // len(placements)))
    replicas = [sizer.plan_replica(i, p) for i, p in enumerate(placements)]
    if sizer.demand is not None:
        sizer.notes.append(f"sized for max_concurrency={sizer.demand}: max_num_seqs "
                           f"{', '.join(str(r.settings.max_num_seqs) for r in replicas)} over {len(replicas)} "
                           "replica(s), KV for that many full-length requests")
    elif sizer.default_seqs is not None and slot is None:
        sizer.notes.append(f"no max_concurrency: sized for the hive's demand (HIVE_DEFAULT_DEMAND_SEQS) of "
                           f"{sizer.default_seqs} sequences per "
                           "replica (max_num_seqs " + ", ".join(str(r.settings.max_num_seqs) for r in replicas)
                           + "); set max_concurrency to size it for more")
    if spec.lora is not None:  # what LoRA books, once per kind of replica, in the model's own notes
        sizer.notes.extend(dict.fromkeys(n for r in replicas for n in r.notes if n.startswith("lora:")))
    return Plan(model_id=spec.model_id, model=spec.model, engine=spec.engine.value,
                profile=profile.summary(), replicas=replicas, rejected=rejected,
                notes=list(profile.notes) + parsers.notes + sizer.notes + policy_notes + [n for n in [legacy_task(spec.vllm_kwargs)[1]] if n],
                expected_tokens_per_s=round(sum(r.expected_tokens_per_s or 0.0 for r in replicas), 1),
                planned_concurrency=sum(r.settings.max_num_seqs for r in replicas))
