"""What a change of a running model's spec needs: applied in place, or new engines. Pure: no Ray.

``PUT /admin/models/{id}`` and the declared models of the hive's Serve config change a model's spec.
A field that only the admin's lifecycle loop or the routers read from the record (they follow every
change of it) takes effect in place, by the registry's ``respec`` transition. A field the planner
reads (placement, engine settings, weights) or that is fixed when a model's router builds its
replica set needs new engines: the hive cannot roll a model's replicas over to another plan one at
a time (one record has one spec and one plan, and every engine of a model app loads the plan's one
weights manifest), so such a change means deleting the model and deploying it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hive_apps.core.planning.sizing import sleeps_in_place
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.records import ModelRecord

# fields read from the record while the model runs: a change takes effect in place
LIVE_FIELDS = frozenset({"sleep_timeout", "idle_timeout", "priority", "keep_resident", "routing",
                         "min_replicas", "max_replicas", "aliases"})

# why each other field needs new engines
_RESTART_WHY = {
    "model": "the weights every engine loads",
    "engine": "the engine class of every replica",
    "max_input_prompt_length": "the planner sizes max_model_len and the KV cache from it",
    "max_output_prompt_length": "the planner sizes max_model_len and the KV cache from it",
    "max_concurrency": "the planner sizes max_num_seqs and the KV cache from it",
    "vllm_kwargs": "engine arguments, fixed when an engine starts",
    "replicas": "the number of replicas is placed by the planner",
    "gpu": "where the replicas are placed",
    "allocation": "how the replicas were placed",
    "max_queued_requests": "the queue bound is fixed when the model's router builds its replica set",
    "lora": "vLLM's LoRA slots (enable_lora, max_loras, max_lora_rank, max_cpu_loras) are engine arguments",
    "env": "the environment of the engine processes, fixed when they start",
}


@dataclass(frozen=True)
class SpecChange:
    """The fields whose values differ, and of those the ones that need new engines (with why)."""

    changed: tuple[str, ...] = ()
    restart: dict[str, str] = field(default_factory=dict)

    @property
    def live(self) -> tuple[str, ...]:
        """Changed fields that take effect in place."""
        return tuple(f for f in self.changed if f not in self.restart)


def running_replicas(rec: ModelRecord) -> int:
    """Replicas its plan keeps (those draining to go are gone already, as far as bounds go)."""
    return len(rec.plan.replicas) - len(rec.retiring)


def spec_change(rec: ModelRecord, new: ModelSpec) -> SpecChange:
    """What replacing ``rec``'s spec with ``new`` (same model_id) changes, and what of it needs new engines."""
    old_values, new_values = rec.spec.model_dump(), new.model_dump()
    changed = tuple(f for f in ModelSpec.model_fields if old_values.get(f) != new_values.get(f))
    restart = {f: _RESTART_WHY.get(f, "the plan depends on it") for f in changed if f not in LIVE_FIELDS}
    if "sleep_timeout" in changed and any(
            bool(rp.engine_kwargs.get("enable_sleep_mode")) != sleeps_in_place(new, rp.device_kind)
            for rp in rec.plan.replicas):
        restart["sleep_timeout"] = ("turning sleep_timeout on or off turns vLLM's sleep mode (enable_sleep_mode) "
                                    "on or off, an engine argument of its GPU replicas")
    if {"min_replicas", "max_replicas"} & set(changed):
        count, bounds = running_replicas(rec), new.replica_bounds
        low, high = bounds if bounds is not None else (new.replicas, new.replicas)
        if not low <= count <= high:
            what = f"between {low} and {high}" if bounds is not None else f"{new.replicas} (replicas, no max_replicas)"
            why = f"it runs {count} replicas now and the new settings want {what}"
            for f in ("min_replicas", "max_replicas"):
                if f in changed:
                    restart[f] = why
    return SpecChange(changed=changed, restart=restart)
