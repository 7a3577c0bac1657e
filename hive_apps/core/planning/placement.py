"""Which device(s) each replica runs on.

Pins are taken as given (after checks); automatic placement ranks the eligible devices by the
allocation policy, spreads replicas over devices that hold no hive replica before it
co-locates, and only when no single device fits, escalates to the smallest same-node
tensor-parallel group. CPU devices are the last resort of automatic placement.

The memory side is the planner's: placement gets ``need(on_cpu, tp)``, the smallest
footprint (bytes per device) a replica can have, and only compares it with what a device
can give. It never builds a plan, so ranking 1000 devices costs a sort, not 1000 plans.

Policies. ``allocation`` names a built-in: ``performance`` (the planner's expected tokens/s
of this model on the device, then bandwidth, then room) or ``conserve_tdp`` (lowest board
TDP, then most SMs). A user policy is named by class path in
``vllm_kwargs["hive_placement_policy"] = "package.module.ClassName"`` (like every ``hive_*``
key it is stripped before the engine sees its kwargs); it replaces ``allocation``, which is
then ignored. The interface::

    class ClassName:
        def __init__(self): ...                      # constructed with no arguments, once per plan
        def rank(self, candidates: list[DeviceCapacity], profile: ModelProfile) -> list[DeviceCapacity]:
            ...                                      # best first

``rank`` is called once per automatic placement with every device that passed the hive's
own checks for this model (engine kind, NVIDIA driver, architecture taints: fp8, bf16), GPUs and CPUs
together, *before* any fit check. It returns those devices (the same objects, or any with
the same ``device.id``) best first; a device it leaves out is not used by this plan (the
dry-run lists it as rejected: "left out by placement policy"). The hive then keeps its own
rules around the user's order, which only breaks ties *within* them:

* fit: a device (or TP rank) that cannot hold the replica's smallest footprint is skipped;
* unshared first: devices with no hive replica come before devices that already host one,
  and replicas of one plan spread before they co-locate (the user's order ranks devices
  inside each tier of "replicas already here");
* single device before tensor parallelism, identical cards preferred in a TP group (the
  group's rank is its worst member's position), GPUs before CPUs.

An import failure, a class that cannot be built with no arguments, a class without a
callable ``rank``, a ``rank`` that raises, or one that returns something other than a list
of the candidates (unknown or repeated devices) is a 422 that names the path and what is
wrong. Pinned deployments do not consult the policy, but the path is still checked.
The class path is imported in the admin's process: it must be importable there.
"""

from __future__ import annotations

import heapq
import importlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from hive_apps.core.devices import DeviceKind
from hive_apps.core.drivers import driver_problem
from hive_apps.core.planning.memory import human_bytes
from hive_apps.core.planning.profile import ModelProfile
from hive_apps.core.planning.types import DeviceCapacity, PlanningError, Rejection
from hive_apps.core.spec import Allocation, EngineKind, ModelSpec

# vLLM's start check rounds util up to what we pass; leave one rounding step of headroom.
UTIL_STEP = 0.001
# When the registry has not applied a budget (budget_is_applied=False), the planner keeps
# this fraction of each device's total as the most the hive may fill (like vLLM's 0.9x).
DEFAULT_BUDGET_FRACTION = 0.90
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: fp8 tensor cores (W8A8 fp8 GEMMs, fp8 KV cache)
# Below 8.9 vLLM 0.32 still runs fp8 *weights*: Fp8Config.get_min_capability() is 75 and the
# linear/MoE layers pick the FP8 Marlin weight-only kernel (kernels/linear/scaled_mm/marlin.py:
# "FP8 Marlin requires compute capability 7.5 or higher"). Weights stay 1 byte each; matmuls
# run in 16 bits (W8A16). So fp8 weights taint only cards below 7.5 (V100).
FP8_MARLIN_MIN_CAPABILITY = (7, 5)
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: bf16; older cards make vLLM fall back to fp16
MAX_LISTED_DEVICES = 20

PLACEMENT_POLICY_KEY = "hive_placement_policy"

NeedFn = Callable[[bool, int], int]
SpeedFn = Callable[[DeviceCapacity], float]
KeyFn = Callable[[DeviceCapacity], tuple[Any, ...]]  # sort key of one device, best first


class Placement(BaseModel):
    """One replica's devices: one per TP rank (a CPU device holds every rank itself)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    devices: list[DeviceCapacity]
    tp: int
    share: int = 1  # replicas of this plan on the same device(s), who split its capacity
    budget: int | None = None  # at most this many bytes per device (a joint plan with pending deploys)
    notes: list[str] = []

    @property
    def on_cpu(self) -> bool:
        return self.devices[0].device.kind is DeviceKind.CPU


def allowed_kinds(engine: EngineKind) -> set[DeviceKind]:
    """Real vLLM runs on real GPUs and CPU nodes; the sim engine runs anywhere."""
    if engine is EngineKind.VLLM:
        return {DeviceKind.GPU, DeviceKind.CPU}
    return {DeviceKind.GPU, DeviceKind.SIM_GPU, DeviceKind.CPU}


def capacity(dc: DeviceCapacity, *, budget_is_applied: bool = True) -> int:
    """The largest footprint (memory.total) a new engine may plan on this device.

    Bounded by the registry's available bytes and by what is free now; on a GPU also by
    vLLM's start check, which compares free memory against util x total after util is
    rounded up by at most one step.
    """
    d = dc.device
    limit = min(dc.available_bytes, dc.free_bytes)
    if d.kind is not DeviceKind.CPU:
        limit = min(limit, dc.free_bytes - int(UTIL_STEP * d.total_bytes))
    if not budget_is_applied:
        used = d.total_bytes - dc.free_bytes
        limit = min(limit, int(DEFAULT_BUDGET_FRACTION * d.total_bytes) - used)
    return max(0, limit)


def kind_problem(dc: DeviceCapacity, engine: EngineKind) -> str | None:
    if dc.device.error:
        return f"unreadable: {dc.device.error}"
    if dc.device.kind not in allowed_kinds(engine):
        return (f"{dc.device.kind.value} device: a simulated GPU cannot run the real vLLM "
                "engine (use engine 'sim', or a real GPU / CPU node)")
    if engine is EngineKind.VLLM:  # the sim engine makes no CUDA call
        return driver_problem(dc.device)
    return None


def taint_problem(profile: ModelProfile, dc: DeviceCapacity) -> str | None:
    """Hardware the model cannot run on (an arch taint).

    fp8 weights need compute capability >= 7.5 (FP8 Marlin, weight-only) and run natively
    (W8A8) from 8.9; an fp8 KV cache is planned only from 8.9 (hive policy: below that vLLM
    can only use a slower fp8-capable attention backend such as Triton).
    """
    cc = dc.device.compute_capability
    if dc.device.kind is DeviceKind.CPU or cc is None:
        return None
    fp8_weights = bool(profile.quant and profile.quant.fp8_weights)
    if fp8_weights and tuple(cc) < FP8_MARLIN_MIN_CAPABILITY:
        return (f"fp8 weights need compute capability >= {FP8_MARLIN_MIN_CAPABILITY[0]}."
                f"{FP8_MARLIN_MIN_CAPABILITY[1]} (vLLM's FP8 Marlin weight-only kernel; native fp8 from "
                f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}), {dc.device.name} has {cc[0]}.{cc[1]}")
    if profile.fp8_kv and tuple(cc) < FP8_MIN_CAPABILITY:
        return (f"an fp8 KV cache (kv_cache_dtype={profile.kv_cache_dtype}) needs compute capability >= "
                f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}, {dc.device.name} has {cc[0]}.{cc[1]}")
    return None


def fp8_fallback_note(profile: ModelProfile, dc: DeviceCapacity) -> str | None:
    """fp8 weights on 7.5 <= cc < 8.9: vLLM runs them weight-only through FP8 Marlin."""
    cc = dc.device.compute_capability
    if dc.device.kind is DeviceKind.CPU or cc is None or not (profile.quant and profile.quant.fp8_weights):
        return None
    if FP8_MARLIN_MIN_CAPABILITY <= tuple(cc) < FP8_MIN_CAPABILITY:
        return (f"{dc.device.id}: {dc.device.name} (compute capability {cc[0]}.{cc[1]}) has no fp8 tensor cores "
                f"(>= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}); vLLM falls back to the FP8 Marlin "
                "weight-only kernel (W8A16): weights stay 1 byte each, matmuls run in 16 bits")
    return None


def dtype_note(profile: ModelProfile, dc: DeviceCapacity) -> str | None:
    cc = dc.device.compute_capability
    if profile.dtype == "bfloat16" and cc is not None and dc.device.kind is not DeviceKind.CPU \
            and tuple(cc) < BF16_MIN_CAPABILITY:
        return (f"{dc.device.id}: bf16 needs compute capability >= 8.0 ({dc.device.name} has "
                f"{cc[0]}.{cc[1]}); vLLM falls back to float16")
    return None


def policy_key(dc: DeviceCapacity, allocation: Allocation, speed: SpeedFn | None = None, *,
               pack: bool = False) -> tuple[Any, ...]:
    """Sort key, best first.

    performance: the planner's expected tokens/s of *this model* on the device (``speed``: a
    roofline over bandwidth and compute, so an H100 ranks above an A100-80GB above an L40S for
    decode-heavy work, where raw TFLOPS would put the L40S first), then bandwidth, then room;
    without ``speed``: fp16 TFLOPS, then bandwidth. conserve_tdp: low TDP, then SMs. ``pack``: the
    least room last instead of the most (best fit among equals).
    """
    d = dc.device
    room = dc.available_bytes if pack else -dc.available_bytes
    if allocation is Allocation.CONSERVE_TDP:
        return (d.tdp_w if d.tdp_w is not None else 10_000, -(d.sm_count or 0), room)
    first = -speed(dc) if speed is not None else -(d.fp16_tflops or 0.0)
    return (first, -(d.memory_bandwidth_gbps or 0.0), room)


_POLICY_HELP = ("give an importable 'package.module.ClassName' whose ClassName() (no arguments) has "
                "rank(candidates: list[DeviceCapacity], profile) -> list[DeviceCapacity], best first")


class UserPolicy:
    """A placement policy named by class path (``vllm_kwargs["hive_placement_policy"]``)."""

    def __init__(self, path: Any) -> None:
        if not isinstance(path, str) or "." not in path.strip(".") or not all(path.split(".")):
            raise PlanningError(f"vllm_kwargs.{PLACEMENT_POLICY_KEY}={path!r} is not a class path; "
                                + _POLICY_HELP, 422)
        self.path = path
        module_name, _, cls_name = path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise PlanningError(f"{PLACEMENT_POLICY_KEY} {path!r}: module {module_name!r} cannot be imported "
                                f"({type(exc).__name__}: {exc}); " + _POLICY_HELP, 422) from exc
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise PlanningError(f"{PLACEMENT_POLICY_KEY} {path!r}: module {module_name!r} has no attribute "
                                f"{cls_name!r}; " + _POLICY_HELP, 422)
        try:
            self.instance = cls()
        except Exception as exc:
            raise PlanningError(f"{PLACEMENT_POLICY_KEY} {path!r} cannot be constructed with no arguments "
                                f"({type(exc).__name__}: {exc}); " + _POLICY_HELP, 422) from exc
        if not callable(getattr(self.instance, "rank", None)):
            raise PlanningError(f"{PLACEMENT_POLICY_KEY} {path!r} has no rank(candidates, profile) method; "
                                + _POLICY_HELP, 422)

    def order(self, candidates: list[DeviceCapacity], profile: ModelProfile) -> dict[str, int]:
        """Position of each device the policy keeps (0 = best); left-out devices are absent."""
        try:
            ranked = self.instance.rank(list(candidates), profile)
        except Exception as exc:
            raise PlanningError(f"{PLACEMENT_POLICY_KEY} {self.path!r}: rank() failed "
                                f"({type(exc).__name__}: {exc})", 422) from exc
        if not isinstance(ranked, (list, tuple)):
            raise PlanningError(f"{PLACEMENT_POLICY_KEY} {self.path!r}: rank() returned "
                                f"{type(ranked).__name__}, expected a list of the candidate devices", 422)
        known = {dc.device.id for dc in candidates}
        positions: dict[str, int] = {}
        for item in ranked:
            dev_id = getattr(getattr(item, "device", None), "id", None)
            if dev_id not in known:
                raise PlanningError(f"{PLACEMENT_POLICY_KEY} {self.path!r}: rank() returned {item!r:.80}, which "
                                    "is not one of the candidate devices; return a subset of the candidates, "
                                    "best first", 422)
            if dev_id in positions:
                raise PlanningError(f"{PLACEMENT_POLICY_KEY} {self.path!r}: rank() returned {dev_id} twice; "
                                    "name each device once", 422)
            positions[dev_id] = len(positions)
        return positions


def _known(devices: list[DeviceCapacity]) -> str:
    ids = [dc.device.id for dc in devices]
    shown = ", ".join(ids[:MAX_LISTED_DEVICES])
    more = len(ids) - MAX_LISTED_DEVICES
    return shown + (f" and {more} more (GET /admin/gpus)" if more > 0 else "") if ids else "none"


def _short(need: int, cap: int, share: int = 1) -> str:
    per = f" (split {share} ways)" if share > 1 else ""
    return (f"needs {human_bytes(need)}, can give {human_bytes(cap // share)}{per}: "
            f"short by {human_bytes(need - cap // share)} ({need - cap // share} bytes)")


# ---------------------------------------------------------------------------------------
# pins


def place_pinned(spec: ModelSpec, devices: list[DeviceCapacity], profile: ModelProfile,
                 tp_override: int | None) -> list[Placement]:
    """Resolve ``gpu=`` pins; memory is checked by the planner when it sizes each replica."""
    by_id = {dc.device.id: dc for dc in devices}
    pins = spec.pins
    unknown = [p for p in pins if p not in by_id]
    if unknown:
        raise PlanningError(f"unknown device(s) {unknown}; known devices: {_known(devices)}", 404)
    chosen = [by_id[p] for p in pins]
    rejected = []
    for dc in chosen:
        reason = kind_problem(dc, spec.engine) or taint_problem(profile, dc)
        if reason:
            rejected.append(Rejection(device=dc.device.id, reason=reason))
    if rejected:
        raise PlanningError("; ".join(f"pinned {r.device}: {r.reason}" for r in rejected), 422, rejected)

    if len(chosen) > 1 and spec.replicas == 1:  # one tensor-parallel replica over all pins
        tp = len(chosen)
        if tp_override is not None and tp_override != tp:
            raise PlanningError(f"vllm_kwargs.tensor_parallel_size={tp_override} but gpu pins {tp} devices "
                                "for one replica; pin as many devices as tensor-parallel ranks", 422)
        if any(dc.device.kind is DeviceKind.CPU for dc in chosen):
            raise PlanningError("a tensor-parallel group cannot include a CPU device; pin GPUs only, "
                                "or pin the CPU device alone", 422)
        nodes = {dc.device.node_id for dc in chosen}
        if len(nodes) > 1:
            raise PlanningError(f"tensor-parallel pins must share one node, got devices on "
                                f"{sorted({dc.device.node_name for dc in chosen})}", 422)
        problem = profile.tp_problem(tp)
        if problem:
            raise PlanningError(f"cannot shard over the {tp} pinned devices: {problem}", 422)
        return [Placement(devices=chosen, tp=tp)]

    tp = tp_override or 1
    out = []
    for dc in chosen:
        if tp > 1 and dc.device.kind is not DeviceKind.CPU:
            raise PlanningError(f"vllm_kwargs.tensor_parallel_size={tp} needs {tp} GPUs per replica; "
                                f"pin a list of {tp} devices with replicas=1", 422)
        problem = profile.tp_problem(tp)
        if problem:
            raise PlanningError(problem, 422)
        out.append(Placement(devices=[dc], tp=tp))
    return out


# ---------------------------------------------------------------------------------------
# automatic placement


def place_auto(spec: ModelSpec, devices: list[DeviceCapacity], profile: ModelProfile, need: NeedFn,
               tp_override: int | None, *, budget_is_applied: bool = True,
               speed: SpeedFn | None = None,
               policy: UserPolicy | None = None, pack: bool = False,
               single_gpu: bool = False) -> tuple[list[Placement], list[Rejection]]:
    """Choose devices for ``spec.replicas`` replicas (or every eligible device for -1).

    ``policy`` (a user policy) orders the devices instead of ``spec.allocation``. ``pack`` (a
    deploy sized for its demand, built-in policies only): other models' replicas do not push a
    device down, and among equally ranked devices the one with the least room that holds the
    replica wins, so the largest holes stay whole for the models that need them. ``single_gpu``: no
    tensor parallelism and no CPU (a demand worth asking for before those).
    """
    pack = pack and policy is None
    reasons: dict[str, str] = {}
    gpus: list[DeviceCapacity] = []
    cpus: list[DeviceCapacity] = []
    for dc in devices:
        reason = kind_problem(dc, spec.engine) or taint_problem(profile, dc)
        if reason:
            reasons[dc.device.id] = reason
        elif dc.device.kind is DeviceKind.CPU:
            cpus.append(dc)
        else:
            gpus.append(dc)

    if policy is not None and (gpus or cpus):
        rank_of = policy.order(gpus + cpus, profile)
        for dc in gpus + cpus:
            if dc.device.id not in rank_of:
                reasons[dc.device.id] = f"left out by placement policy {policy.path}"
        gpus = [dc for dc in gpus if dc.device.id in rank_of]
        cpus = [dc for dc in cpus if dc.device.id in rank_of]

        def key(dc: DeviceCapacity) -> tuple[Any, ...]:
            return (rank_of[dc.device.id],)
    else:
        def key(dc: DeviceCapacity) -> tuple[Any, ...]:
            return policy_key(dc, spec.allocation, speed, pack=pack)

    want_all = spec.replicas == -1
    tp1 = tp_override in (None, 1)
    placements: list[Placement] = []

    if tp1:
        placements = _single(gpus, spec, need(False, 1), reasons, budget_is_applied, tp=1, key=key, pack=pack)
    if not placements and gpus and not single_gpu:
        placements = _tensor_parallel(gpus, spec, profile, need, tp_override, reasons, budget_is_applied, key)
    if not placements and cpus and not single_gpu:
        tp = tp_override or 1
        problem = profile.tp_problem(tp)
        if problem:
            for dc in cpus:
                reasons[dc.device.id] = problem
        else:
            placements = _single(cpus, spec, need(True, tp), reasons, budget_is_applied, tp=tp, key=key, pack=pack)
            note = ("no GPU can hold a replica; placed on CPU" if gpus else "no GPU in the registry; placed on CPU")
            for p in placements:
                p.notes.append(note)

    used = {dc.device.id for p in placements for dc in p.devices}
    rejected = [Rejection(device=i, reason=r) for i, r in reasons.items() if i not in used]
    if not placements:
        raise PlanningError(_nothing_fits(spec, devices, rejected), 422, rejected)
    if not want_all and len(placements) < spec.replicas:
        raise PlanningError(f"only {len(placements)} of replicas={spec.replicas} fit on the eligible devices; "
                            f"lower replicas, free memory, or add devices", 422, rejected)
    return placements, rejected


def _nothing_fits(spec: ModelSpec, devices: list[DeviceCapacity], rejected: list[Rejection]) -> str:
    if not devices:
        return "the registry lists no devices; start a GPU or CPU worker first"
    lines = "; ".join(f"{r.device}: {r.reason}" for r in rejected[:MAX_LISTED_DEVICES])
    more = len(rejected) - MAX_LISTED_DEVICES
    return (f"no device or same-node tensor-parallel group can hold a replica of {spec.model_id!r}: {lines}"
            + (f"; and {more} more" if more > 0 else ""))


def _single(pool: list[DeviceCapacity], spec: ModelSpec, need: int, reasons: dict[str, str],
            budget_is_applied: bool, *, tp: int, key: KeyFn, pack: bool = False) -> list[Placement]:
    """One replica per chosen device; free devices first (``pack``: devices without this plan's replicas),
    then co-location where memory allows."""
    fitting: list[tuple[tuple[Any, ...], int, DeviceCapacity, int]] = []
    for i, dc in enumerate(pool):
        cap = capacity(dc, budget_is_applied=budget_is_applied)
        if need > cap:
            reasons[dc.device.id] = _short(need, cap) + (f" at tensor_parallel_size={tp}" if tp > 1 else "")
            continue
        fitting.append((key(dc), i, dc, cap))
    if not fitting:
        return []
    if spec.replicas == -1:
        fitting.sort(key=lambda f: (len(f[2].hive_replicas), f[0], f[1]))
        return [Placement(devices=[f[2]], tp=tp) for f in fitting]

    # heap of (replicas already on the device, policy, index): spread first, then co-locate
    heap = [(0 if pack else len(dc.hive_replicas), k, i) for k, i, dc, _ in fitting]
    heapq.heapify(heap)
    by_index = {i: (dc, cap) for _, i, dc, cap in fitting}
    shares: dict[int, int] = defaultdict(int)
    order: list[int] = []
    while heap and len(order) < spec.replicas:
        count, k, i = heapq.heappop(heap)
        dc, cap = by_index[i]
        if need * (shares[i] + 1) > cap:
            continue  # full: drop it from the heap
        shares[i] += 1
        order.append(i)
        heapq.heappush(heap, (count + 1, k, i))
    return [Placement(devices=[by_index[i][0]], tp=tp, share=shares[i]) for i in order]


def _tensor_parallel(gpus: list[DeviceCapacity], spec: ModelSpec, profile: ModelProfile, need: NeedFn,
                     tp_override: int | None, reasons: dict[str, str], budget_is_applied: bool,
                     key: KeyFn) -> list[Placement]:
    """The smallest TP size for which same-node groups exist; identical cards preferred."""
    by_node: dict[str, list[DeviceCapacity]] = defaultdict(list)
    for dc in gpus:
        by_node[dc.device.node_id].append(dc)
    biggest = max(len(v) for v in by_node.values())
    sizes = [tp_override] if tp_override and tp_override > 1 else range(2, biggest + 1)
    for tp in sizes:
        if profile.tp_problem(tp):
            continue
        per_device = need(False, tp)
        groups: list[tuple[tuple[Any, ...], list[DeviceCapacity]]] = []
        usable: list[DeviceCapacity] = []
        for node_devices in by_node.values():
            fitting = [dc for dc in node_devices if capacity(dc, budget_is_applied=budget_is_applied) >= per_device]
            node_groups = _node_groups(fitting, tp, key)
            groups.extend(node_groups)
            usable.extend(dc for _, g in node_groups for dc in g)
        if not groups:
            continue
        for dc in usable:  # fine as a rank of a group, whatever it could not do alone
            reasons.pop(dc.device.id, None)
        groups.sort(key=lambda g: g[0])
        if spec.replicas != -1:
            groups = groups[: spec.replicas]
        return [Placement(devices=g, tp=tp) for _, g in groups]
    if tp_override and tp_override > 1:
        for dc in gpus:
            reasons.setdefault(dc.device.id, f"no same-node group of {tp_override} GPUs with room for a rank")
    return []


def _node_groups(devices: list[DeviceCapacity], tp: int, key: KeyFn) -> list[tuple[tuple[Any, ...], list[DeviceCapacity]]]:
    """Non-overlapping groups of ``tp`` devices on one node: identical cards first, then mixed leftovers."""
    if len(devices) < tp:
        return []
    ordered = sorted(devices, key=lambda dc: (len(dc.hive_replicas), key(dc)))
    by_card: dict[tuple[Any, ...], list[DeviceCapacity]] = defaultdict(list)
    for dc in ordered:
        by_card[(dc.device.name, dc.device.total_bytes)].append(dc)
    groups: list[tuple[tuple[Any, ...], list[DeviceCapacity]]] = []
    leftovers: list[DeviceCapacity] = []
    for cards in by_card.values():
        whole = len(cards) // tp * tp
        for k in range(0, whole, tp):
            groups.append((_group_key(cards[k:k + tp], key, identical=True), cards[k:k + tp]))
        leftovers.extend(cards[whole:])
    leftovers.sort(key=lambda dc: -dc.available_bytes)
    for k in range(0, len(leftovers) // tp * tp, tp):
        group = leftovers[k:k + tp]
        groups.append((_group_key(group, key, identical=False), group))
    return groups


def _group_key(group: list[DeviceCapacity], key: KeyFn, *, identical: bool) -> tuple[Any, ...]:
    weakest = max(key(dc) for dc in group)
    busiest = max(len(dc.hive_replicas) for dc in group)
    return (busiest, not identical, weakest, -min(dc.available_bytes for dc in group),
            group[0].device.id)
