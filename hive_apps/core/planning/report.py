"""A plan as plain text: what ``POST /admin/plan`` callers and the benchmark print."""

from __future__ import annotations

from collections.abc import Sequence

from hive_apps.core import names
from hive_apps.core.planning.memory import human_bytes
from hive_apps.core.planning.types import Plan

_COLUMNS = ("replica", "device(s)", "tp", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "gpu_mem_util", "kv_cache_memory_bytes", "weights", "KV cache", "activations", "overhead",
            "total/device", "tok/s (est.)")


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


def render_plan_table(plan: Plan) -> str:
    """One row per replica with settings and the per-device memory breakdown, then rejections."""
    p = plan.profile
    head = (f"{plan.model_id}: {p.architecture} ({p.model_type}, {p.runner}, {p.dtype}), "
            f"{p.num_params / 1e9:.2f}B params, weights {human_bytes(p.weight_bytes)}, "
            f"KV {human_bytes(p.kv_bytes_per_token)}/token, engine {plan.engine}")
    lora = any(r.memory.lora for r in plan.replicas)  # a LoRA column only for a base that serves adapters
    columns = _COLUMNS[:12] + ("LoRA",) + _COLUMNS[12:] if lora else _COLUMNS
    rows = []
    for r in plan.replicas:
        s, m = r.settings, r.memory
        row = (
            names.replica_label(r.index), ",".join(r.devices), str(s.tensor_parallel_size), str(s.max_num_seqs),
            str(s.max_num_batched_tokens), str(s.max_model_len), f"{s.gpu_memory_utilization:.3f}",
            f"{s.kv_cache_memory_bytes} ({human_bytes(s.kv_cache_memory_bytes)})", human_bytes(m.weights),
            human_bytes(m.kv_cache), human_bytes(m.activations), human_bytes(m.overhead), human_bytes(m.total),
            f"{r.expected_tokens_per_s:.0f}" if r.expected_tokens_per_s is not None else "-",
        )
        rows.append(row[:12] + (human_bytes(m.lora),) + row[12:] if lora else row)
    parts = [head, _table(columns, rows)]
    notes = list(plan.notes) + [f"{names.replica_label(r.index)}: {n}" for r in plan.replicas for n in r.notes
                                if not (n.startswith("lora:") and n in plan.notes)]  # said once for the model
    if notes:
        parts.append("notes:\n" + "\n".join(f"  - {n}" for n in notes))
    if plan.rejected:
        parts.append("rejected devices:\n" + _table(("device", "reason"),
                                                    [(x.device, x.reason) for x in plan.rejected]))
    return "\n\n".join(parts)
