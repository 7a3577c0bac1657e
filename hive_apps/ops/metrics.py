"""Every Prometheus metric the hive exports, defined once, and the pure functions that compute them.

Metrics go through Ray's metrics API (``ray.util.metrics``): each Ray node's metrics agent
serves them on its metrics port, prefixed ``ray_`` (a counter also gets ``_total``; a
histogram ``_bucket``, ``_sum`` and ``_count``). ``manifests/grafana-dashboard.json`` draws them.

Who sets what, so nothing goes stale:
- the registry, after every device sample (HIVE_MONITOR_INTERVAL_S): per-GPU memory and each
  model's status and planned capacity (``publish_registry``), and on each lifecycle
  transition the deploy/wake/start durations and sleep/eviction/swap counts (``on_transition``);
- each model's router, after every load poll of its replicas (250 ms busy, 2 s idle): per
  replica running, waiting, KV usage, health and planned capacity (``replica_samples``);
- the gateway and routers as requests pass: requests by status code, retries, failovers,
  rejections (429/503 by reason) and held requests.

A gauge series whose subject went away (a model deleted, a replica moved, a GPU gone) is set to
0 on the next refresh by its publisher (Ray cannot unregister a series). Values are computed by
plain functions over the registry's records, so unit tests check them without Ray.

There is no process-wide publisher: each composition root (the registry's, a router's, the
gateway's and an engine replica's Serve constructor) builds one ``Publisher`` and passes it to
what it composes. Unit tests pass one over a recording backend (``Publisher(backend=...)``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hive_apps.serving.routing.liveness import is_live

if TYPE_CHECKING:
    from hive_apps.core.state.ledger import DeviceState
    from hive_apps.core.state.records import ModelRecord, Reservation
    from hive_apps.serving.engine.protocol import EngineLoad
    from hive_apps.serving.routing.policy import ReplicaView

log = logging.getLogger("ray.serve")

Kind = Literal["gauge", "counter", "histogram"]
Tags = tuple[tuple[str, str], ...]  # sorted (key, value) pairs: hashable, for "which series did I set"

DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    description: str
    tags: tuple[str, ...]
    boundaries: tuple[float, ...] = ()

    def exported(self) -> set[str]:
        """The names Prometheus sees for this metric."""
        base = "ray_" + self.name
        if self.kind == "counter":
            return {base + "_total", base}  # Ray also exports a counter as a gauge unless RAY_EXPORT_COUNTER_AS_GAUGE=0
        if self.kind == "histogram":
            return {base + "_bucket", base + "_sum", base + "_count"}
        return {base}


MEMORY_KINDS = ("total", "used", "reserved", "resident", "foreign", "dormant", "free", "available")

DEFS: dict[str, MetricDef] = {d.name: d for d in [
    # --- devices (registry) ---
    MetricDef("hive_gpu_memory_bytes", "gauge",
              "Device memory by kind: total; used (measured); reserved (held by hive reservations, starting "
              "engines included); resident (held by running hive engines); foreign (used, not explained by the "
              "hive); dormant (what sleeping models placed here would need to wake); free; available (to plan)",
              ("node", "device", "gpu", "kind")),
    # --- models (registry) ---
    MetricDef("hive_model_status", "gauge", "1 for the model's current status, 0 for every other",
              ("model", "status")),
    MetricDef("hive_model_planned_seqs", "gauge",
              "Planned capacity of the model: the sum of max_num_seqs over its live replicas (0 while asleep)",
              ("model",)),
    MetricDef("hive_model_replicas", "gauge", "Replicas the model's plan runs now (0 while asleep)", ("model",)),
    # --- replicas (the model's router, from its load polls) ---
    MetricDef("hive_replica_planned_seqs", "gauge", "Planned capacity (max_num_seqs) of the replica",
              ("model", "replica", "devices")),
    MetricDef("hive_replica_running", "gauge", "Requests the replica's engine is running", ("model", "replica", "devices")),
    MetricDef("hive_replica_waiting", "gauge", "Requests waiting in the replica's engine", ("model", "replica", "devices")),
    MetricDef("hive_replica_kv_usage", "gauge", "Share of the replica's KV cache in use (0..1)",
              ("model", "replica", "devices")),
    MetricDef("hive_replica_healthy", "gauge", "1 if the replica answered its last load poll", ("model", "replica", "devices")),
    # --- tokens (each engine replica, from its own scheduler: vLLM's stat logger, the sim's decode loop) ---
    MetricDef("hive_tokens", "counter", "Tokens processed by a replica: direction in (prompt) or out (generated)",
              ("model", "replica", "direction")),
    # --- requests (gateway and routers) ---
    MetricDef("hive_requests", "counter", "Requests answered, by model, entry (gateway or router) and HTTP status code",
              ("model", "entry", "code")),
    MetricDef("hive_edge_routed", "counter", "Requests the edge sent straight to an engine replica, by model and why "
              "that replica (prefix, adapter, least-loaded); their answers bypass the gateway", ("model", "route")),
    MetricDef("hive_retries", "counter", "Attempts sent to another replica after one failed before answering",
              ("model",)),
    MetricDef("hive_failovers", "counter", "Requests answered by another replica after the first one failed",
              ("model",)),
    MetricDef("hive_replica_failures", "counter", "Requests a replica failed before answering", ("model", "replica")),
    MetricDef("hive_rejected", "counter",
              "Requests refused by the hive itself: 429 queue_full, hold_full or client_share, 503 no_replica, "
              "hold_timeout or wake_failed, 504 engine_hung", ("model", "code", "reason")),
    MetricDef("hive_held_requests", "gauge", "Requests held while their model wakes", ("model", "entry")),
    # --- lifecycle (registry transitions) ---
    MetricDef("hive_deploy_seconds", "histogram", "From a deploy's request to its model serving", ("model",),
              DURATION_BUCKETS),
    MetricDef("hive_wake_seconds", "histogram",
              "From the first held request to the model serving again, by how it slept (level1, level2 or parked)",
              ("model", "how"), DURATION_BUCKETS),
    MetricDef("hive_engine_start_seconds", "histogram", "One engine replica's own start (deploy, heal or wake)",
              ("model",), DURATION_BUCKETS),
    MetricDef("hive_sleeps", "counter", "Models put to sleep, by reason (idle or evicted)", ("model", "reason")),
    MetricDef("hive_evictions", "counter", "Models put to sleep to make room for another", ("model",)),
    MetricDef("hive_swaps", "counter", "Wakes that evicted other models to make room", ("model",)),
    MetricDef("hive_wakes", "counter",
              "Wakes finished, by outcome (ok or failed) and how the model slept (level1, level2 or parked)",
              ("model", "outcome", "how")),
    MetricDef("hive_destroys", "counter", "Models destroyed for idleness", ("model",)),
    MetricDef("hive_deploy_failures", "counter", "Deploys or wakes that failed", ("model",)),
    # --- LoRA adapters (each engine replica, serving/engine/adapters.py) ---
    MetricDef("hive_adapter_loads", "counter",
              "LoRA adapters an engine replica loaded on demand, by outcome (ok or failed)",
              ("model", "replica", "adapter", "outcome")),
    MetricDef("hive_adapter_load_seconds", "histogram",
              "What a request waited for its adapter to load (fetch onto the node and vLLM's load)",
              ("model", "replica"), (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)),
    MetricDef("hive_adapter_evictions", "counter",
              "LoRA adapters an engine replica unloaded to keep at most max_cpu_loras loaded", ("model", "replica")),
    MetricDef("hive_adapter_slot_waits", "counter", "Adapter loads that waited for one of max_cpu_loras loaded adapters to have no request in flight", ("model", "replica")),
]}


def exported_names() -> set[str]:
    return {n for d in DEFS.values() for n in d.exported()}


@dataclass(frozen=True)
class Sample:
    metric: str
    tags: Tags
    value: float


def sample(metric: str, value: float, **tags: str) -> Sample:
    d = DEFS[metric]
    if set(tags) != set(d.tags):
        raise ValueError(f"{metric} takes tags {d.tags}, got {tuple(tags)}")
    return Sample(metric, tuple(sorted(tags.items())), float(value))


# --- pure values ----------------------------------------------------------------------------

def device_samples(states: Iterable[DeviceState], reservations: Iterable[Reservation]) -> list[Sample]:
    """Per device: every kind of ``hive_gpu_memory_bytes``; resident counts active reservations only."""
    from hive_apps.core.state.records import ReservationState

    active = [r for r in reservations if r.state is ReservationState.ACTIVE]
    out = []
    for s in states:
        dev = s.device
        resident = sum(r.held_bytes for r in active if dev.id in r.devices)
        values = {"total": s.total_bytes, "used": s.used_bytes, "reserved": s.reserved_bytes, "resident": resident,
                  "foreign": s.foreign_bytes, "dormant": s.dormant_bytes, "free": s.free_bytes,
                  "available": s.available_bytes}
        out += [sample("hive_gpu_memory_bytes", v, node=dev.node_name, device=dev.id, gpu=dev.name, kind=k)
                for k, v in values.items()]
    return out


def model_samples(records: Iterable[ModelRecord]) -> list[Sample]:
    from hive_apps.core.state.records import ModelStatus

    out = []
    for rec in records:
        for st in ModelStatus:
            out.append(sample("hive_model_status", 1 if rec.status is st else 0, model=rec.model_id, status=st.value))
        live = rec.live_replicas if rec.holds_memory else []
        out.append(sample("hive_model_planned_seqs", sum(rp.settings.max_num_seqs for rp in live), model=rec.model_id))
        out.append(sample("hive_model_replicas", len(live), model=rec.model_id))
    return out


def replica_samples(model_id: str, views: Iterable[ReplicaView], loads: dict[int, EngineLoad],
                    devices: dict[int, list[str]]) -> list[Sample]:
    """Per replica of one model, from its router's last load poll."""
    out = []
    for v in views:
        tags = {"model": model_id, "replica": f"r{v.index}", "devices": ",".join(devices.get(v.index, []))}
        load = loads.get(v.index)
        out += [sample("hive_replica_planned_seqs", v.capacity, **tags),
                sample("hive_replica_running", v.engine_running, **tags),
                sample("hive_replica_waiting", v.engine_waiting, **tags),
                sample("hive_replica_kv_usage", load.kv_cache_usage if load is not None else 0.0, **tags),
                sample("hive_replica_healthy", 1 if is_live(v) else 0, **tags)]
    return out


@dataclass(frozen=True)
class Event:
    """One counter increment or histogram observation."""

    metric: str
    tags: Tags
    value: float = 1.0


def event(metric: str, value: float = 1.0, **tags: str) -> Event:
    s = sample(metric, value, **tags)
    return Event(s.metric, s.tags, s.value)


def _slept(rec: ModelRecord) -> str:
    """How a waking model slept: in place (level1/level2) or parked (a cold start)."""
    return rec.sleep_mode.value if rec.sleep_mode is not None else "parked"


def transition_events(name: str, before: ModelRecord | None, after: ModelRecord | None,
                      kwargs: dict[str, Any]) -> list[Event]:
    """What one registry transition adds to the lifecycle metrics."""
    from hive_apps.core.state.records import ModelStatus

    if after is None:
        return []
    m = after.model_id
    out: list[Event] = []
    if name == "started" and before is not None:
        if before.status is ModelStatus.DEPLOYING and after.ready_at is not None:
            out.append(event("hive_deploy_seconds", max(0.0, after.ready_at - after.created_at), model=m))
        if before.status is ModelStatus.WAKING:
            how = _slept(before)
            out.append(event("hive_wakes", model=m, outcome="ok", how=how))
            if after.last_wake is not None and after.last_wake != before.last_wake:
                out.append(event("hive_wake_seconds", after.last_wake.total_s, model=m, how=how))
        out += [event("hive_engine_start_seconds", s, model=m) for s in (kwargs.get("engine_start_s") or {}).values()]
    elif name == "sleep":
        evicted = str(kwargs.get("reason", "")).startswith("evicted")
        out.append(event("hive_sleeps", model=m, reason="evicted" if evicted else "idle"))
        if evicted:
            out.append(event("hive_evictions", model=m))
    elif name == "placed" and kwargs.get("evicted"):
        out.append(event("hive_swaps", model=m))
    elif name == "wake_failed":
        out.append(event("hive_wakes", model=m, outcome="failed", how=_slept(before or after)))
        out.append(event("hive_deploy_failures", model=m))
    elif name == "fail":
        out.append(event("hive_deploy_failures", model=m))
    elif name == "destroy":
        out.append(event("hive_destroys", model=m))
    return out


# --- the thin Ray layer -------------------------------------------------------------------------

class RayBackend:
    """Creates each ``ray.util.metrics`` object on first use, in the process that records."""

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}

    def _get(self, metric: str) -> Any:
        obj = self._objects.get(metric)
        if obj is None:
            from ray.util import metrics as rm

            d = DEFS[metric]
            if d.kind == "gauge":
                obj = rm.Gauge(d.name, d.description, d.tags)
            elif d.kind == "counter":
                obj = rm.Counter(d.name, d.description, d.tags)
            else:
                obj = rm.Histogram(d.name, d.description, list(d.boundaries), d.tags)
            self._objects[metric] = obj
        return obj

    def record(self, metric: str, tags: Tags, value: float) -> None:
        obj, kind = self._get(metric), DEFS[metric].kind
        t = dict(tags)
        if kind == "gauge":
            obj.set(value, t)
        elif kind == "counter":
            obj.inc(value, t)
        else:
            obj.observe(value, t)


@dataclass
class Publisher:
    """Records samples and events; remembers which gauge series each group set, to zero the gone."""

    backend: Any = field(default_factory=RayBackend)
    _set: dict[str, set[tuple[str, Tags]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gauges(self, group: str, samples: list[Sample]) -> None:
        """Set every sample; a series this group set last time and not now goes to 0."""
        try:
            with self._lock:
                now = {(s.metric, s.tags) for s in samples}
                for metric, tags in self._set.get(group, set()) - now:
                    self.backend.record(metric, tags, 0.0)
                for s in samples:
                    self.backend.record(s.metric, s.tags, s.value)
                self._set[group] = now
        except Exception:  # metrics never break serving
            log.exception("publishing metrics failed")

    def events(self, events: list[Event]) -> None:
        try:
            for e in events:
                self.backend.record(e.metric, e.tags, e.value)
        except Exception:
            log.exception("publishing metrics failed")

    def count(self, metric: str, value: float = 1.0, **tags: str) -> None:
        self.events([event(metric, value, **tags)])

    def publish_registry(self, states: list[DeviceState], reservations: Iterable[Reservation],
                         records: Iterable[ModelRecord]) -> None:
        """The registry's gauges after a device sample: per-GPU memory, each model's status and capacity."""
        self.gauges("devices", device_samples(states, reservations))
        self.gauges("models", model_samples(records))

    def on_transition(self, name: str, before: ModelRecord | None, after: ModelRecord | None,
                      kwargs: dict[str, Any]) -> None:
        """The lifecycle counters and durations one registry transition adds."""
        try:
            self.events(transition_events(name, before, after, kwargs))
        except Exception:
            log.exception("lifecycle metrics failed")


class TokenCount:
    """Tokens of one engine replica, added up locally and sent to Ray at most once a second
    (vLLM reports every scheduler step); ``flush`` on each load poll keeps the last ones from waiting."""

    FLUSH_S = 1.0

    def __init__(self, model_id: str, replica: int, publisher: Publisher):
        self.tags = {"model": model_id, "replica": f"r{replica}"}
        self.publisher = publisher
        self.pending = {"in": 0, "out": 0}
        self._flushed_at = time.monotonic()

    def add(self, prompt: int, generated: int) -> None:
        self.pending["in"] += prompt
        self.pending["out"] += generated
        if time.monotonic() - self._flushed_at >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._flushed_at = time.monotonic()
        pending, self.pending = self.pending, {"in": 0, "out": 0}
        self.publisher.events([event("hive_tokens", n, direction=d, **self.tags) for d, n in pending.items() if n])

