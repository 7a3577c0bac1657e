"""An in-memory ``Cluster`` (hive_apps/control/cluster.py) for running the registry and the admin's
reconciler without Ray: nodes with simulated GPUs that can die, Serve apps whose engine
deployments start, fail or hang as a test says, handles that call objects in this process
(arguments and results copied as Ray would), and an internal KV that outlives a "restarted"
registry (and can lose the writes after a simulated crash).
"""

from __future__ import annotations

import inspect
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hive_apps.control.cluster import AppBuilder, AppState, NodeInfo
from hive_apps.control.planner import plan_or_error
from hive_apps.control.registry.monitor import NODE_NAME_LABEL, simulated_gpus
from hive_apps.core import names
from hive_apps.core.devices import NodeSample
from hive_apps.core.planning.adapter_source import adapter_or_error
from hive_apps.core.planning.source_profile import metadata_dir
from hive_apps.core.planning.types import Plan
from hive_apps.serving.engine.protocol import EngineLoad, SleepReport

HEALTHY, UPDATING, FAILED = "HEALTHY", "UPDATING", "DEPLOY_FAILED"


class _Method:
    def __init__(self, target: Any, name: str):
        self.target, self.name = target, name

    def remote(self, *args, **kwargs):
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))

        async def call():
            result = getattr(self.target, self.name)(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return pickle.loads(pickle.dumps(result))

        return call()


class LocalHandle:
    """``handle.method.remote(...)`` on an object in this process."""

    def __init__(self, target: Any):
        self.target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.target, name)

    def options(self, **_) -> LocalHandle:
        return self


class Planner:
    """The planner app, planning in this process; a Hub or S3 source's metadata goes under ``cache()``
    (the planner node's weight cache, as HIVE_WEIGHTS_CACHE is the real planner's)."""

    def __init__(self, cache: Callable[[], Path]):
        self.cache = cache

    def plan(self, spec, devices, pending=None, as_asked=False, weights=None):
        return plan_or_error(spec, devices, pending, as_asked, weights, metadata=metadata_dir(self.cache()))

    def check_adapter(self, spec, base, base_weights=None):
        return adapter_or_error(spec, base, base_weights, metadata_dir(self.cache()))


@dataclass
class FakeApp:
    plan: Plan
    builds: int = 1
    generations: dict[int, int] = field(default_factory=dict)
    deployments: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)


class FakeEngine:
    """An engine replica as the admin sees it; with ``sleep`` set (the cluster's per-model
    state, so it outlives handles) it sleeps in place like vLLM's sleep mode."""

    def __init__(self, devices: list[str], start_s: float, load: Callable[[], EngineLoad],
                 sleep: FakeSleep | None = None, loaded: list[dict] | None = None):
        self.devices, self.start_s, self._load, self._sleep, self.loaded = devices, start_s, load, sleep, loaded

    def info(self) -> dict:
        return {"devices": self.devices, "engine_start_s": self.start_s, "warm_up_s": 0.25,
                "can_sleep": self._sleep is not None and not self._sleep.warm,
                "can_rest": self._sleep is not None and self._sleep.warm, "loaded": self.loaded}

    def sleep(self, level: int) -> SleepReport:
        self._sleep.calls.append(f"sleep{level}")
        self._sleep.level = self._sleep.level or level
        return SleepReport(sleep_s=0.1, residual_bytes=self._sleep.residual)

    def rest(self) -> SleepReport:
        """Asleep warm: vLLM stopped, the process kept (``level`` WARM_LEVEL marks it here)."""
        self._sleep.calls.append("rest")
        self._sleep.level = self._sleep.level or WARM_LEVEL
        return SleepReport(sleep_s=0.5, residual_bytes=self._sleep.residual)

    def wake_up(self) -> dict:
        self._sleep.calls.append("wake_warm" if self._sleep.level == WARM_LEVEL else f"wake{self._sleep.level}")
        if self._sleep.corrupt:
            raise RuntimeError("after waking, it answers the warm-up differently than before it slept")
        wake_s = {0: 0.0, 1: 0.5, 2: 3.0, WARM_LEVEL: 12.0}[self._sleep.level]
        self._sleep.level = 0
        return {"wake_s": wake_s, "warm_up_s": 0.05}

    def load(self) -> EngineLoad:
        return self._load()


WARM_LEVEL = 3  # the fake's mark of an engine asleep warm


@dataclass
class FakeSleep:
    level: int = 0
    corrupt: bool = False  # its wake brings the weights back wrong
    residual: dict[str, int] | None = None  # what it says it still holds per device once asleep (None: unmeasured)
    warm: bool = False  # no sleep mode: it sleeps warm (its process kept, vLLM stopped)
    calls: list[str] = field(default_factory=list)


class FakeCluster:
    def __init__(self, nodes: dict[str, str]):
        """``nodes``: node name -> simulated GPUs as in the ``ray-hive/sim-gpus`` label."""
        self.node_infos: dict[str, NodeInfo] = {}
        self.gpus: dict[str, list[str]] = {}
        for name, keys in nodes.items():
            self.add_node(name, keys)
        self.apps: dict[str, FakeApp] = {}
        self.kv: dict[tuple[str, str], bytes] = {}
        self.dies_at: str | None = None  # the registry "dies" at the first KV write of a key with this prefix
        self.died = False  # ... and every write after it is lost, until a test clears both
        self.serve_addr = "127.0.0.1:8000"  # Serve's ingress, as the edge is told it
        self.writes_left: int | None = None  # or it dies once this many more KV writes landed
        # the planner's node's weight cache: metadata only (a test may point it elsewhere)
        self.planner_cache = Path(tempfile.mkdtemp(prefix="fake-cluster-planner-"))
        self.handles: dict[str, Any] = {names.PLANNER_APP: LocalHandle(Planner(lambda: self.planner_cache))}
        self.start_mode: dict[str, str] = {}  # model id -> "ok" (default) | "fail" | "hang"
        self.loaded: dict[tuple[str, int], list[dict]] = {}  # (model id, replica) -> per rank, as vLLM engines report it
        self.deleted: list[str] = []
        self.loads: dict[str, EngineLoad] = {}  # model id -> what each of its engines reports
        self.sleepy: dict[tuple[str, int], FakeSleep] = {}  # engines that can sleep in place
        self.host_used_bytes = 8 * 2**30
        # each node's weight cache is a folder of its own under this (a test may point it elsewhere)
        self.weights_root = Path(tempfile.mkdtemp(prefix="fake-cluster-weights-"))
        self.fetchers: dict[str, Any] = {}  # node id -> its WeightFetcher

    # --- test controls ---------------------------------------------------------------------
    def add_node(self, name: str, gpus: str, node_id: str | None = None) -> str:
        node_id = node_id or f"{name}-{len(self.node_infos)}"
        self.node_infos[node_id] = NodeInfo(node_id=node_id, alive=True, labels={NODE_NAME_LABEL: name})
        self.gpus[node_id] = gpus.split(".")
        return node_id

    def kill_node(self, name: str) -> None:
        for info in self.node_infos.values():
            if info.labels[NODE_NAME_LABEL] == name:
                info.alive = False

    def serve(self, app_name: str, target: Any) -> None:
        self.handles[app_name] = LocalHandle(target)

    # --- Serve applications ------------------------------------------------------------------
    def _engine_status(self, model_id: str, node_id: str) -> str:
        if not self.node_infos[node_id].alive:
            return UPDATING  # Serve cannot place a replica pinned to a dead node
        return {"fail": FAILED, "hang": UPDATING}.get(self.start_mode.get(model_id, "ok"), HEALTHY)

    def app_states(self) -> dict[str, AppState]:
        out = {}
        for name, app in self.apps.items():
            deps = {names.ROUTER_DEPLOYMENT: HEALTHY}
            deps.update({names.engine_deployment(rp.index): self._engine_status(name, rp.node_id) for rp in app.plan.replicas})
            deps.update(app.deployments)
            status = FAILED if FAILED in deps.values() else ("RUNNING" if set(deps.values()) == {HEALTHY} else "DEPLOYING")
            msgs = {d: "RuntimeError: simulated engine start failure" for d, s in deps.items() if s == FAILED}
            out[name] = AppState(status=status, deployments=deps, deployment_messages={**msgs, **app.messages})
        return out

    def run_model_app(self, model_id: str, plan: Plan, max_queued_requests: int | None,
                      generations: dict[int, int] | None = None, build: AppBuilder | None = None) -> None:
        """Records the plan; ``build`` (the admin's Serve app builder) is not called: there is no Serve."""
        app = self.apps.get(model_id)
        self.apps[model_id] = FakeApp(plan=plan, builds=(app.builds + 1) if app else 1, generations=dict(generations or {}))

    def delete_app(self, name: str) -> None:
        if self.apps.pop(name, None) is not None:
            self.deleted.append(name)

    # --- handles ------------------------------------------------------------------------------
    def app_handle(self, name: str) -> Any:
        return self.handles[name]

    def engine_handle(self, model_id: str, index: int) -> Any:
        rp = next(rp for rp in self.apps[model_id].plan.replicas if rp.index == index)
        return LocalHandle(FakeEngine(rp.devices, start_s=1.5 + index, load=lambda: self.loads.get(model_id, EngineLoad()),
                                      sleep=self.sleepy.get((model_id, index)), loaded=self.loaded.get((model_id, index))))

    def serve_ingress(self) -> str:
        return self.serve_addr

    # --- nodes --------------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        return [n.model_copy() for n in self.node_infos.values()]

    def sample_nodes(self, nodes: list[NodeInfo]) -> dict[str, NodeSample | Exception]:
        out = {}
        for n in nodes:
            if not n.alive:
                continue
            name = n.labels[NODE_NAME_LABEL]
            out[n.node_id] = NodeSample(node_id=n.node_id, node_name=name, host_total_bytes=64 * 2**30,
                                        host_used_bytes=self.host_used_bytes, cpu_count=8,
                                        devices=simulated_gpus(n.node_id, name, self.gpus[n.node_id]))
        return out

    def reset_monitors(self) -> None:
        pass

    def fetcher_call(self, node_id: str, method: str, *args: Any) -> Any:
        """Each node's own fetcher over its own cache folder (nothing shared between nodes)."""
        from hive_apps.core.weights.fetcher import WeightFetcher

        if not self.node_infos[node_id].alive:
            raise RuntimeError(f"node {node_id} is dead")
        if node_id not in self.fetchers:
            name = self.node_infos[node_id].labels[NODE_NAME_LABEL]
            self.fetchers[node_id] = WeightFetcher(self.weights_root / node_id, name, workers=4)
        args = pickle.loads(pickle.dumps(args))
        return pickle.loads(pickle.dumps(getattr(self.fetchers[node_id], method)(*args)))

    # --- durable state ------------------------------------------------------------------------
    def kv_get(self, namespace: str, key: str) -> bytes | None:
        return self.kv.get((namespace, key))

    def _lands(self, key: str) -> None:
        self.died = self.died or (self.dies_at is not None and key.startswith(self.dies_at)) or self.writes_left == 0
        if self.writes_left:
            self.writes_left -= 1
        if self.died:
            raise ConnectionError(f"the registry died before writing {key}")

    def kv_put(self, namespace: str, key: str, value: bytes) -> None:
        self._lands(key)
        self.kv[(namespace, key)] = value

    def kv_delete(self, namespace: str, key: str) -> None:
        self._lands(key)
        self.kv.pop((namespace, key), None)

    def kv_keys(self, namespace: str, prefix: str) -> list[str]:
        return [k for ns, k in self.kv if ns == namespace and k.startswith(prefix)]
