"""Packing: how many models a small heterogeneous cluster holds, and at what planned concurrency.

Run:  python benchmarks/bench_packing.py [--write-results benchmarks/RESULTS_packing.md]

Pure Python, no Ray, no vLLM engine: the planner (``plan_deployment``) and the memory model
(``hive_apps.core.planning.memory``) on simulated devices, real model configs from
``tests/fixtures/model_configs``.

Cluster (issue 4): node A 2 x H100-80GB; node B 2 x L4 + 1 x A10; node C CPU only, 64 GiB
RAM, 16 cores. The registry's budget rule: available = 0.90 x total - reserved - foreign
(nothing foreign here). Models are deployed one after another in ``CATALOG`` order (greedy,
``replicas=1``, auto placement, engine "sim"), each with typical input/output lengths; a
model that cannot be placed is skipped and the next one is tried. Every strategy uses the
same ``max_model_len`` = input + output (pooling: input) per model: a vLLM user who leaves
``max_model_len`` at the model's full context (40k-128k tokens) would get far less.

Strategies (each also run with the catalog sorted by weight size, largest first):

hive, catalog as one batch
    The catalog submitted at once: each model is planned with ``plan_deployment(...,
    pending=<the models after it>)``, as a registry holding them as pending deploys would,
    so it is planned jointly with them (``hive_apps/core/planning/packing.py``). After each plan
    its ``reservation_bytes`` is taken from the devices' available and free bytes and the
    replica is added to ``hive_replicas``. Concurrency is the planned ``max_num_seqs``.
hive, one at a time
    The same without pending deploys, with HIVE_DEFAULT_DEMAND_SEQS=16 (``DEFAULT_SEQS``): each
    model without ``max_concurrency`` is sized for 16 sequences per replica and packed onto the
    fastest card that holds it, the fullest of equal cards (issue 33). Without that setting (the
    hive's default until a model can grow back) it is sized throughput-first for what was free
    when it arrived.
hive best-fit
    The same with a user placement policy, ``vllm_kwargs["hive_placement_policy"] =
    "<this module>.BestFit"``: the smallest card first (the hive's fit and unshared-first
    rules still apply), as the one-per-GPU baseline chooses.
one-per-GPU
    Ray Serve LLM's usual shape: each model takes a whole free GPU (best fit: the smallest
    card that holds it, so as many models as possible get one) and runs with vLLM's
    defaults for ``vllm serve``: ``gpu_memory_utilization=0.9``, max_num_seqs /
    max_num_batched_tokens 1024 / 8192 on H100-class cards (>= 70 GiB, not A100), 256 /
    2048 on the others. Its KV cache is what vLLM would give: 0.9 x total - weights -
    activation peak - CUDA graphs - runtime buffers (the same estimates the planner uses,
    at those defaults), and its concurrency is that KV divided by one full-length
    request's KV, capped at the default max_num_seqs. No CPU, no tensor parallelism.
fixed-0.45x2
    "Fixed 0.9 utilisation" taken literally lets no second engine start on a GPU (vLLM's
    start check wants util x total free), which is one-per-GPU again. The fair fixed
    baseline that does co-locate keeps the hive's 0.9 budget per GPU but splits it into
    fixed slots, as an operator would by hand: every engine gets
    ``gpu_memory_utilization=0.45`` (two per GPU, sum 0.9), or 0.9 of an empty GPU when it
    does not fit in 0.45. Placement: a half-used GPU whose free slot holds the model, else
    a slot of an empty GPU, else a whole empty GPU (each time the smallest card first).
    Concurrency as for one-per-GPU, from the slot's KV.

Columns: models placed (of N; CPU placements in brackets), planned concurrency (sum of
max_num_seqs, or the baselines' KV-limited concurrency), the sum of the planner's roofline
tokens/s estimate for each engine at its batch size (the same estimate for every strategy;
it ranks, it is not a measurement), GiB reserved on GPUs (baselines: util x total + the CUDA
context per engine), and GPUs used.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The best-fit policy below is a user code hook: this script, as the operator, allows its own module.
os.environ.setdefault("HIVE_HOOK_PACKAGES", "__main__")

from hive_apps.core.catalog import GIB, GPU_CATALOG  # noqa: E402
from hive_apps.core.devices import Device, DeviceKind  # noqa: E402
from hive_apps.core.planning import memory as mem  # noqa: E402
from hive_apps.core.planning.placement import capacity  # noqa: E402
from hive_apps.core.planning.planner import plan_deployment  # noqa: E402
from hive_apps.core.planning.profile import ModelProfile, load_profile  # noqa: E402
from hive_apps.core.planning.sizing import DEFAULT_SEQS  # noqa: E402
from hive_apps.core.planning.throughput import Throughput, device_perf  # noqa: E402
from hive_apps.core.planning.types import DeviceCapacity, PlanningError  # noqa: E402
from hive_apps.core.spec import ModelSpec  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "model_configs")
BUDGET = 0.90
COMMAND = "python benchmarks/bench_packing.py --write-results benchmarks/RESULTS_packing.md"

# (model_id, fixture folder, input tokens, output tokens): deployment order
CATALOG = [
    ("qwen3-8b", "Qwen__Qwen3-8B", 4096, 1024),
    ("llama-3-1-8b", "meta-llama__Llama-3.1-8B", 4096, 1024),
    ("qwen3-30b-a3b", "Qwen__Qwen3-30B-A3B", 2048, 512),
    ("gemma-2-9b", "google__gemma-2-9b", 2048, 512),
    ("qwen3-0-6b", "Qwen__Qwen3-0.6B", 1024, 512),
    ("llama-3-2-1b", "meta-llama__Llama-3.2-1B-Instruct", 2048, 512),
    ("gemma-3-1b", "google__gemma-3-1b-it", 1024, 512),
    ("qwen3-8b-fp8", "Qwen__Qwen3-8B-FP8", 4096, 1024),
    ("e5-mistral-7b", "intfloat__e5-mistral-7b-instruct", 512, 0),
    ("bge-m3", "BAAI__bge-m3", 1024, 0),
    ("minilm-l6", "sentence-transformers__all-MiniLM-L6-v2", 256, 0),
]


# ---- the cluster ---------------------------------------------------------------------------


def sim_gpu(key: str, node: str, index: int) -> DeviceCapacity:
    g = GPU_CATALOG[key]
    device = Device(id=f"{node}:gpu{index}", node_id=f"id-{node}", node_name=node, kind=DeviceKind.SIM_GPU,
                    index=index, name=g.name, total_bytes=g.memory_bytes, used_bytes=0,
                    compute_capability=g.compute_capability, sm_count=g.sm_count,
                    memory_bandwidth_gbps=g.memory_bandwidth_gbps, tdp_w=g.tdp_w, fp16_tflops=g.fp16_tflops)
    return DeviceCapacity(device=device, available_bytes=int(BUDGET * g.memory_bytes), free_bytes=g.memory_bytes)


def cpu_node(node: str, total_gib: float, cores: int) -> DeviceCapacity:
    total = int(total_gib * GIB)
    device = Device(id=f"{node}:cpu", node_id=f"id-{node}", node_name=node, kind=DeviceKind.CPU,
                    name="CPU", total_bytes=total, used_bytes=0, cpu_count=cores)
    return DeviceCapacity(device=device, available_bytes=int(BUDGET * total), free_bytes=total)


def cluster() -> list[DeviceCapacity]:
    return [sim_gpu("H100-80GB", "A", 0), sim_gpu("H100-80GB", "A", 1),
            sim_gpu("L4", "B", 0), sim_gpu("L4", "B", 1), sim_gpu("A10", "B", 2),
            cpu_node("C", 64, 16)]


def short(dc: DeviceCapacity) -> str:
    d = dc.device
    return f"{d.id} ({'CPU' if d.kind is DeviceKind.CPU else d.name.replace('NVIDIA ', '').split(' ')[0]})"


# ---- results -------------------------------------------------------------------------------


@dataclass
class Engine:
    model_id: str
    devices: list[str]
    where: str
    seqs: int
    tokens_per_s: float
    reserved: int  # bytes per device
    util: float
    pooling: bool
    on_cpu: bool = False


@dataclass
class Outcome:
    name: str
    order: str
    engines: list[Engine] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def gpus_used(self) -> int:
        return len({d for e in self.engines if not e.on_cpu for d in e.devices})

    @property
    def gpu_reserved_gib(self) -> float:
        return sum(e.reserved * len(e.devices) for e in self.engines if not e.on_cpu) / GIB


# ---- strategy (a): the hive ----------------------------------------------------------------


class BestFit:
    """A user placement policy (``hive_placement_policy``): the smallest card first, the faster of equals.

    The hive still skips cards the model does not fit and still prefers unshared cards, so
    this is best fit among the unshared cards that hold the model.
    """

    def rank(self, candidates: list[DeviceCapacity], profile: ModelProfile) -> list[DeviceCapacity]:
        return sorted(candidates, key=lambda dc: (dc.device.total_bytes, -(dc.device.memory_bandwidth_gbps or 0)))


def run_hive(profiles: dict[str, ModelProfile], catalog: list[tuple], order: str, *,
             policy: str | None = None, batch: bool = False) -> Outcome:
    name = ("Ray Hive, best-fit user policy" if policy else
            "Ray Hive (performance), catalog as one batch" if batch else "Ray Hive (performance), one at a time")
    out = Outcome(name, order)
    devices = cluster()
    kwargs = {"hive_placement_policy": policy} if policy else {}
    specs = [(ModelSpec(model_id=model_id, model=os.path.join(FIXTURES, folder), engine="sim",
                        max_input_prompt_length=inp, max_output_prompt_length=outp, vllm_kwargs=kwargs),
              profiles[folder]) for model_id, folder, inp, outp in catalog]
    for k, (model_id, folder, _inp, _outp) in enumerate(catalog):
        profile = profiles[folder]
        spec = specs[k][0]
        try:
            plan = plan_deployment(spec, devices, profile, pending=specs[k + 1:] if batch else (),
                                   demand_seqs=None if batch or policy else DEFAULT_SEQS)
        except PlanningError:
            gpu_room = max(capacity(dc) for dc in devices if dc.device.kind is not DeviceKind.CPU)
            cpu_room = max(capacity(dc) for dc in devices if dc.device.kind is DeviceKind.CPU)
            out.skipped.append((model_id, f"weights {profile.weight_bytes / GIB:.1f} GiB; most room left: "
                                          f"{gpu_room / GIB:.1f} GiB on a GPU, {cpu_room / GIB:.1f} GiB on CPU"))
            continue
        by_id = {dc.device.id: dc for dc in devices}
        for r in plan.replicas:
            for dev in r.devices:
                dc = by_id[dev]
                dc.available_bytes = max(0, dc.available_bytes - r.reservation_bytes)
                dc.free_bytes = max(0, dc.free_bytes - r.reservation_bytes)
                dc.hive_replicas.append(f"{model_id}/r{r.index}")
            tp = r.settings.tensor_parallel_size
            out.engines.append(Engine(
                model_id, r.devices, " + ".join(short(by_id[d]) for d in r.devices) + (f" tp={tp}" if tp > 1 else ""),
                r.settings.max_num_seqs, r.expected_tokens_per_s or 0.0, r.reservation_bytes,
                r.settings.gpu_memory_utilization, profile.runner == "pooling", r.device_kind is DeviceKind.CPU))
    return out


# ---- baselines: vLLM defaults at a fixed utilisation ----------------------------------------


def vllm_defaults(dc: DeviceCapacity) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of ``vllm serve`` (OPENAI_API_SERVER) on this card."""
    d = dc.device
    big = d.total_bytes >= 70 * GIB and "A100" not in d.name
    return (8192, 1024) if big else (2048, 256)


def default_engine(profile: ModelProfile, dc: DeviceCapacity, util: float, inp: int, outp: int) -> tuple[int, float]:
    """(KV-limited concurrency, roofline tokens/s) of a default vLLM engine at ``util``; concurrency 0: does not start."""
    pooling = profile.runner == "pooling"
    max_model_len = inp + (0 if pooling else outp)
    tokens, seqs_cap = vllm_defaults(dc)
    if pooling:  # no chunked prefill: a step must hold a whole prompt
        tokens = max(tokens, max_model_len)
    seqs_cap = min(seqs_cap, tokens)
    frame = mem.Frame(profile, tp=1, on_cpu=False, max_model_len=max_model_len, max_num_batched_tokens=tokens,
                      enforce_eager=False, block_size=profile.block_size(False, None, 1),
                      prefix_caching=not pooling)
    non_kv = frame.total(seqs_cap, kv_bytes=0) - frame.context  # weights, activations, graphs, buffers
    kv = int(util * dc.device.total_bytes) - non_kv
    if kv <= 0:
        return 0, 0.0
    seqs = min(seqs_cap, mem.seqs_for_kv(kv, frame.per_seq, frame.block))
    if seqs < 1:
        return 0, 0.0
    perf = device_perf([dc], False, 1, False, profile)
    return seqs, Throughput(profile, perf, 1, inp, 0 if pooling else outp).tokens_per_s(tokens, seqs)


def run_fixed(profiles: dict[str, ModelProfile], catalog: list[tuple], order: str, *, slots: bool) -> Outcome:
    """one-per-GPU (``slots=False``) or fixed 2 x 0.45 slots per GPU (``slots=True``)."""
    out = Outcome("fixed 0.45 x 2 per GPU" if slots else "one model per GPU (vLLM 0.9)", order)
    gpus = [dc for dc in cluster() if dc.device.kind is not DeviceKind.CPU]
    used: dict[str, list[float]] = {dc.device.id: [] for dc in gpus}  # utilisations of the engines there
    by_size = sorted(gpus, key=lambda dc: dc.device.total_bytes)  # best fit: smallest card first
    for model_id, folder, inp, outp in catalog:
        profile = profiles[folder]
        choices: list[tuple[DeviceCapacity, float]] = []
        if slots:
            choices += [(dc, 0.45) for dc in by_size if used[dc.device.id] == [0.45]]
            choices += [(dc, 0.45) for dc in by_size if not used[dc.device.id]]
        choices += [(dc, 0.9) for dc in by_size if not used[dc.device.id]]
        for dc, util in choices:
            seqs, tps = default_engine(profile, dc, util, inp, outp)
            if seqs >= 1:
                used[dc.device.id].append(util)
                out.engines.append(Engine(model_id, [dc.device.id], short(dc) + (f" @{util}" if slots else ""),
                                          seqs, tps, int(util * dc.device.total_bytes) + mem.CUDA_CONTEXT_BYTES,
                                          util, profile.runner == "pooling"))
                break
        else:
            why = "no free slot holds it at 0.45 and no GPU is free" if slots else "no free GPU holds it at 0.9"
            out.skipped.append((model_id, why))
    return out


# ---- report --------------------------------------------------------------------------------


def summary_table(outcomes: list[Outcome], n: int) -> list[str]:
    rows = [("order", "strategy", "placed on GPU", "on CPU", "not placed", "generate concurrency",
             "generate tok/s (roofline)", "pooling concurrency", "GPU GiB reserved", "GPUs used")]
    for o in outcomes:
        gen = [e for e in o.engines if not e.pooling]
        pool = [e for e in o.engines if e.pooling]
        rows.append((o.order, o.name, f"{sum(not e.on_cpu for e in o.engines)} of {n}",
                     str(sum(e.on_cpu for e in o.engines)), ", ".join(m for m, _ in o.skipped) or "-",
                     str(sum(e.seqs for e in gen)), f"{sum(e.tokens_per_s for e in gen):,.0f}",
                     str(sum(e.seqs for e in pool)), f"{o.gpu_reserved_gib:.1f}", f"{o.gpus_used} of 5"))
    return md(rows)


def md(rows: list[tuple]) -> list[str]:
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, width)) + " |"  # noqa: E731
    return [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in width) + "|"] + [line(r) for r in rows[1:]]


def listing(o: Outcome) -> list[str]:
    lengths = {m: (i, g) for m, _, i, g in CATALOG}
    rows = [("model", "in/out", "device(s)", "max_num_seqs", "util", "reserved GiB", "roofline tok/s")]
    for e in o.engines:
        i, g = lengths[e.model_id]
        unit = " (in)" if e.pooling else ""
        rows.append((e.model_id, f"{i}/{g}", e.where, str(e.seqs), f"{e.util:.3f}", f"{e.reserved / GIB:.2f}",
                     f"{e.tokens_per_s:,.0f}{unit}"))
    for m, why in o.skipped:
        rows.append((m, "/".join(map(str, lengths[m])), f"not placed: {why}", "-", "-", "-", "-"))
    return md(rows)


def target_check(outcomes: list[Outcome]) -> list[str]:
    """Issue 10's target, per order: the batch hive places every model any baseline places, with generate
    concurrency and roofline tok/s at least the best baseline's. Issue 33's: one at a time places as many
    models on GPUs as the batch."""
    lines = []
    for order in dict.fromkeys(o.order for o in outcomes):
        group = [o for o in outcomes if o.order == order]
        hive = next(o for o in group if "one batch" in o.name)
        baselines = [o for o in group if not o.name.startswith("Ray Hive")]
        placed = {e.model_id for e in hive.engines}
        wanted = {e.model_id for b in baselines for e in b.engines}
        conc = lambda o: sum(e.seqs for e in o.engines if not e.pooling)  # noqa: E731
        tps = lambda o: sum(e.tokens_per_s for e in o.engines if not e.pooling)  # noqa: E731
        best_c, best_t = max(conc(b) for b in baselines), max(tps(b) for b in baselines)
        missing = sorted(wanted - placed)
        ok = not missing and conc(hive) >= best_c and tps(hive) >= best_t
        lines.append(
            f"* Target, {order} order: {'met' if ok else 'NOT met'}. The batch hive places {len(placed)} of "
            f"{len(CATALOG)} ({'every model a baseline places' if not missing else 'missing ' + ', '.join(missing)}); "
            f"generate concurrency {conc(hive)} vs best baseline {best_c}; roofline tok/s {tps(hive):,.0f} vs "
            f"{best_t:,.0f}.")
        single = next(o for o in group if o.name.endswith("one at a time"))
        on_gpu = lambda o: sum(not e.on_cpu for e in o.engines)  # noqa: E731
        lines.append(
            f"* Target (issue 33), {order} order: {'met' if on_gpu(single) >= on_gpu(hive) else 'NOT met'}. One at "
            f"a time places {on_gpu(single)} of {len(CATALOG)} on GPUs, the batch {on_gpu(hive)}.")
    return lines


def findings(outcomes: list[Outcome], n: int) -> list[str]:
    """A few lines that read the table (numbers filled in from this run)."""
    batch, single, fit = outcomes[0], outcomes[1], outcomes[2]
    big = single.engines[0]
    return target_check(outcomes) + [
        "* One at a time (nothing pending) with HIVE_DEFAULT_DEMAND_SEQS=16, the planner sizes each model for "
        f"{DEFAULT_SEQS} sequences without max_concurrency, and packs it onto the fastest card that holds it: the "
        f"first deploy does not take the card ({big.model_id} reserves {big.reserved / GIB:.0f} GiB of an H100 for "
        f"{big.seqs} sequences), so {sum(not e.on_cpu for e in single.engines)} of {n} land on GPUs in catalog "
        "order. It plans less concurrency than the batch, which gives the spare memory to the models where it buys "
        "the most; growing a busy model into it is issue 33's resize rule"
        + (f"; {', '.join(m for m, _ in single.skipped)} finds no room" if single.skipped else "")
        + ".",
        "* As one batch (each deploy planned with the rest of the catalog pending, `hive_apps/core/planning/packing.py`), "
        f"every deploy is planned jointly with those still to come: {sum(not e.on_cpu for e in batch.engines)} of {n} "
        "land on GPUs. The price is paid by the big dense models: the joint plan gives an H100 to the 30B MoE (the "
        "only card that holds it) and to the small models that turn its bandwidth into the most tokens/s, and puts "
        "the 8B models on the L4s and the A10 at a few sequences (a deploy that needs more states max_concurrency, "
        "which the joint plan keeps). The estimate counts each co-located engine at its own roofline (its peak while its neighbours are "
        "idle), as the fixed-slot baseline's rows do.",
        "* The best-fit user policy (`hive_placement_policy`, class `BestFit` in this script) puts each model on the "
        "smallest unshared card that holds its demand (a user policy keeps the unshared-first rule): "
        f"{sum(not e.on_cpu for e in fit.engines)} of {n} on GPUs in catalog order, at the L4s' and the A10's "
        "slower rooflines.",
        "* Pooling models: encoders keep little or no KV per sequence, so the planner gives them hundreds of "
        "sequences in 1-3 GiB where a baseline gives them a whole card or slot.",
    ]


SHUFFLES = 10  # random orders (seed 33) beyond the two tabled, for issue 33's "in every order"


def order_sweep(profiles: dict[str, ModelProfile]) -> list[str]:
    """Models on GPUs one at a time vs as a batch in more orders: reverse, smallest first, random."""
    rng = random.Random(33)
    orders = {"reverse": CATALOG[::-1], "smallest first": sorted(CATALOG, key=lambda c: profiles[c[1]].weight_bytes)}
    for k in range(SHUFFLES):
        orders[f"random {k}"] = rng.sample(CATALOG, len(CATALOG))
    on_gpu = lambda o: sum(not e.on_cpu for e in o.engines)  # noqa: E731
    short_of = []
    for name, catalog in orders.items():
        one, batch = run_hive(profiles, catalog, name), run_hive(profiles, catalog, name, batch=True)
        if on_gpu(one) < on_gpu(batch):
            off = [m for m, _ in one.skipped] + [e.model_id for e in one.engines if e.on_cpu]
            short_of.append(f"{name} ({on_gpu(one)} vs {on_gpu(batch)}: {', '.join(off)} off the GPUs)")
    return [f"* More orders (reverse, smallest first, {SHUFFLES} random): one at a time places as many models on "
            f"GPUs as the batch in {len(orders) - len(short_of)} of {len(orders)}"
            + (f"; fewer in {'; '.join(short_of)}" if short_of else "") + "."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-results", metavar="PATH", help="also write the tables and command as markdown")
    args = ap.parse_args()
    t0 = time.perf_counter()
    profiles = {folder: load_profile(os.path.join(FIXTURES, folder), {}) for _, folder, _, _ in CATALOG}
    t_load = time.perf_counter() - t0
    largest = sorted(CATALOG, key=lambda c: -profiles[c[1]].weight_bytes)
    outcomes = []
    best_fit = f"{__name__}.BestFit"  # "__main__.BestFit" when run as a script
    for order, catalog in (("catalog", CATALOG), ("largest first", largest)):
        outcomes += [run_hive(profiles, catalog, order, batch=True),
                     run_hive(profiles, catalog, order),
                     run_hive(profiles, catalog, order, policy=best_fit),
                     run_fixed(profiles, catalog, order, slots=False),
                     run_fixed(profiles, catalog, order, slots=True)]
    n = len(CATALOG)
    summary = summary_table(outcomes, n)
    sections = [("Ray Hive, catalog as one batch, catalog order", listing(outcomes[0])),
                ("Ray Hive, catalog as one batch, largest first", listing(outcomes[5])),
                ("Ray Hive one at a time, catalog order", listing(outcomes[1])),
                ("Ray Hive with the best-fit user policy, catalog order", listing(outcomes[2])),
                ("One model per GPU, catalog order", listing(outcomes[3])),
                ("Fixed 0.45 x 2 per GPU, catalog order", listing(outcomes[4]))]
    notes = findings(outcomes, n) + order_sweep(profiles)
    elapsed = time.perf_counter() - t0

    print("cluster: A 2 x H100-80GB | B 2 x L4 + 1 x A10 | C CPU 64 GiB, 16 cores; budget 0.90 x total")
    print(f"catalog: {n} models deployed one after another, replicas=1, auto placement, engine sim\n")
    print("\n".join(summary))
    for title, rows in sections:
        print(f"\n{title}:")
        print("\n".join(rows))
    print()
    print("\n".join(notes))
    print(f"\n{elapsed:.1f} s ({t_load:.1f} s loading profiles)")
    print(f"command: {COMMAND}")

    if args.write_results:
        text = [
            "# Packing benchmark: Ray Hive planner vs one model per GPU vs fixed utilisation",
            "",
            "Target (issue 10): in every order, Ray Hive places every model any baseline places, with generate "
            "concurrency and roofline tok/s at least the best baseline's. The row that must meet it is "
            "\"catalog as one batch\" (every deploy planned with the rest pending). Target (issue 33): \"one at a "
            "time\" (the planner with nothing pending, as an operator deploying models one after another) places "
            "as many models on GPUs as the batch, in every order.",
            "",
            "Simulated cluster: node A 2 x H100-80GB; node B 2 x L4 + 1 x A10; node C CPU only (64 GiB, 16 cores); "
            "budget 0.90 x total per device.",
            f"{n} real model configs from `tests/fixtures/model_configs`, deployed one after another (replicas=1, "
            "auto placement, engine sim) in catalog order and largest weights first, with the input/output lengths "
            "listed below; every strategy uses the same max_model_len (input + output). Baselines run vLLM's "
            "`vllm serve` defaults (max_num_seqs 1024 on H100, 256 elsewhere) at a fixed gpu_memory_utilization "
            "(one model per GPU: 0.9 of a whole free GPU; fixed slots: 0.45, two engines per GPU, or 0.9 of an "
            "empty GPU), and their concurrency is the KV cache left by the planner's own memory estimates, "
            "divided by one full-length request, capped at max_num_seqs. tok/s: the planner's roofline estimate "
            "(it ranks, it is not a measurement); pooling rows count input tokens and are left out of the sums. "
            "Definitions: docstring of `benchmarks/bench_packing.py`.",
            "",
            *summary,
            "",
            *notes,
        ]
        for title, rows in sections:
            text += ["", f"{title}:", "", *rows]
        text += ["", f"`{COMMAND}` ({elapsed:.0f} s on a shared 2-core machine, {t_load:.0f} s of it loading "
                     "profiles).", ""]
        Path(args.write_results).write_text("\n".join(text))
        print(f"wrote {args.write_results}")


if __name__ == "__main__":
    main()
