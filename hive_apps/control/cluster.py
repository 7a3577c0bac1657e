"""The one seam between the hive's logic and Ray / Serve.

Every Ray and Serve call the control plane makes (``serve.run_many``, ``serve.delete``,
``serve.status``, handle lookups, internal KV, ``ray.nodes``, the per-node monitor and weight
fetcher actors) goes through a ``Cluster``. The registry and the admin take theirs from ``get_cluster()``;
unit tests install an in-memory fake with ``set_cluster()`` and run the same logic without
Ray, as Serve's own ``ActorReplicaWrapper`` lets its controller run against fakes.

The seam runs what it is given: a model's app is built by the builder the caller passes
(``AppBuilder``, the admin's ``build_model_app``), never imported here, so the routers and
engines that call ``get_cluster()`` are not imported by it in turn.

Methods are blocking (Ray's APIs are); async callers run them with ``off_loop``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel

from hive_apps.core import names
from hive_apps.core.devices import NodeSample
from hive_apps.core.planning.types import Plan

log = logging.getLogger("ray.serve")

PICKLE_RACE_ATTEMPTS = 4


class AppState(BaseModel):
    """What Serve says of one application and each of its deployments."""

    status: str  # RUNNING, DEPLOYING, DEPLOY_FAILED, UNHEALTHY, DELETING, or MISSING
    message: str = ""
    deployments: dict[str, str] = {}  # deployment name -> HEALTHY, UPDATING, UNHEALTHY, ...
    deployment_messages: dict[str, str] = {}


MISSING = AppState(status="MISSING", message="the app is not known to Serve")


class NodeMonitor:
    """Lives on one node (as a Ray actor) and reports what that node's devices hold right now."""

    def __init__(self, node_id: str, labels: dict[str, str]):
        self.node_id, self.labels = node_id, labels

    def sample(self) -> NodeSample:
        from hive_apps.control.registry.monitor import sample_node

        return sample_node(self.node_id, self.labels)


class NodeFetcher:
    """Lives on one node (a detached Ray actor, so a download outlives the admin that asked for it)
    and fills that node's weight cache (``hive_apps/core/weights/fetcher.py``). The cache folder and the
    source credentials are read from this node's own environment, never sent from another node."""

    def __init__(self, node_name: str):
        """A composition root: Ray builds it on its node, whose settings (HIVE_WEIGHTS_CACHE) it reads."""
        from hive_apps.core.settings import get_settings
        from hive_apps.core.weights.fetcher import WeightFetcher

        settings = get_settings()
        self.fetcher = WeightFetcher(settings.weights_cache, node_name, settings.fetch_workers)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.fetcher, method)(*args)


FETCHER_CALL_TIMEOUT_S = 30.0

# (model_id, plan, max_queued_requests, generations) -> the model's Serve application
AppBuilder = Callable[[str, Plan, int | None, dict[int, int]], Any]


class NodeInfo(BaseModel):
    node_id: str
    alive: bool
    labels: dict[str, str] = {}


class Cluster(Protocol):
    # --- Serve applications ---
    def app_states(self) -> dict[str, AppState]: ...
    def run_model_app(self, model_id: str, plan: Plan, max_queued_requests: int | None,
                      generations: dict[int, int], build: AppBuilder) -> None: ...
    def delete_app(self, name: str) -> None: ...  # asks; the app may still be listed for a while
    # --- handles (cached) ---
    def app_handle(self, name: str) -> Any: ...
    def engine_handle(self, model_id: str, index: int) -> Any: ...
    def serve_ingress(self) -> str: ...  # host:port of Serve's HTTP ingress for this node (blocking)
    # --- nodes ---
    def nodes(self) -> list[NodeInfo]: ...
    def sample_nodes(self, nodes: list[NodeInfo]) -> dict[str, NodeSample | Exception]: ...
    def reset_monitors(self) -> None: ...
    def fetcher_call(self, node_id: str, method: str, *args: Any) -> Any: ...  # ``WeightFetcher.<method>`` there
    # --- durable state (Ray internal KV) ---
    def kv_get(self, namespace: str, key: str) -> bytes | None: ...
    def kv_put(self, namespace: str, key: str, value: bytes) -> None: ...
    def kv_delete(self, namespace: str, key: str) -> None: ...
    def kv_keys(self, namespace: str, prefix: str) -> list[str]: ...


class ControlPlane:
    """The registry and planner apps, reached through the class's ``cluster`` seam (the admin, its
    reconciler and its lifecycle loop all ask them)."""

    cluster: Cluster

    @property
    def registry(self) -> Any:
        return self.cluster.app_handle(names.REGISTRY_APP)

    @property
    def planner(self) -> Any:
        return self.cluster.app_handle(names.PLANNER_APP)


async def off_loop(fn, *args, timeout: float | None = None):
    """Run a blocking seam call in a thread, so no event loop waits on Ray."""
    return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)


class RayCluster:
    """The real thing: Ray and Serve of the cluster this process belongs to."""

    def __init__(self, namespace: str | None = None) -> None:
        """``namespace``: the Ray namespace of the hive's named actors (the nodes' weight fetchers),
        HIVE_STATE_NAMESPACE; the admin's root gives it, a process that calls no fetcher need not."""
        self.namespace = namespace
        self._handles: dict[str, Any] = {}
        self._serve_lock = threading.Lock()
        self._monitors: dict[str, Any] = {}  # node id -> its monitor actor
        # the registry samples (every second) and resets in threads of its own (off_loop)
        self._monitors_lock = threading.Lock()
        self._fetchers: dict[str, Any] = {}  # node id -> its weight fetcher actor

    # --- Serve applications ---------------------------------------------------------------
    def app_states(self) -> dict[str, AppState]:
        from ray import serve

        out = {}
        for name, app in serve.status().applications.items():
            out[name] = AppState(
                status=str(getattr(app.status, "value", app.status)),
                message=app.message or "",
                deployments={d: str(getattr(s.status, "value", s.status)) for d, s in app.deployments.items()},
                deployment_messages={d: s.message for d, s in app.deployments.items() if s.message},
            )
        return out

    def run_model_app(self, model_id: str, plan: Plan, max_queued_requests: int | None,
                      generations: dict[int, int], build: AppBuilder) -> None:
        """Add or update a model's app (``build`` makes it) without waiting for it to run.

        Serve pickles apps with cloudpickle, whose by-value module registry is global and not
        thread-safe, so builds take a lock; Serve's own handle threads touch the same registry
        (every RequestRouterConfig registers and unregisters its module), which no lock of ours
        covers: that race fails the build before anything reaches the controller, so it is retried.
        """
        from ray import serve

        for attempt in range(1, PICKLE_RACE_ATTEMPTS + 1):
            try:
                with self._serve_lock:
                    app = build(model_id, plan, max_queued_requests, generations)
                    serve.run_many(
                        [serve.RunTarget(app, name=names.model_app(model_id), route_prefix=names.model_route(model_id))],
                        wait_for_ingress_deployment_creation=False,
                        wait_for_applications_running=False,
                    )
                return
            except ValueError as e:
                if "registered for pickle by value" not in str(e) or attempt == PICKLE_RACE_ATTEMPTS:
                    raise
                log.warning("building app %s raced Serve's pickle registry (attempt %d): %s", model_id, attempt, e)
                time.sleep(0.2 * attempt)

    def delete_app(self, name: str) -> None:
        """Ask Serve to remove the app; does not wait for it to go. Behind Serve's HAProxy ingress
        its ingress replica stays reachable for 30 s, and a waiting call holds one of the few
        threads every seam call runs in (``off_loop``): four deletes at once held up a deploy
        for 22 s (``benchmarks/bench_deploy_delete.py``)."""
        from ray import serve

        if name in serve.status().applications:
            serve.delete(name, _blocking=False)

    # --- handles ----------------------------------------------------------------------------
    def app_handle(self, name: str) -> Any:
        if name not in self._handles:
            from ray import serve

            self._handles[name] = serve.get_app_handle(name)
        return self._handles[name]

    def engine_handle(self, model_id: str, index: int) -> Any:
        """A new handle each time: an app deleted and made again under the same id gets fresh
        ones; callers (``ReplicaSet``) keep theirs for the life of the replica set."""
        from ray import serve

        return serve.get_deployment_handle(names.engine_deployment(index), app_name=names.model_app(model_id))

    def serve_ingress(self) -> str:
        """This node's Serve proxy when it runs one, else the head's (``proxy_location: HeadOnly``)."""
        import ray
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        if client is None:
            raise RuntimeError("Serve is not running on this cluster")
        controller = client._controller
        http = ray.get(controller.get_http_config.remote())
        here = ray.get(controller.get_proxy_details.remote(ray.get_runtime_context().get_node_id()))
        node = ray.util.get_node_ip_address() if here is not None else ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
        host = node if http.host in ("0.0.0.0", "::", "") else http.host  # a wildcard: the node's own address
        return f"{host}:{http.port}"

    # --- nodes ------------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        import ray

        return [NodeInfo(node_id=n["NodeID"], alive=bool(n.get("Alive")), labels=n.get("Labels") or {})
                for n in ray.nodes()]

    def sample_nodes(self, nodes: list[NodeInfo]) -> dict[str, NodeSample | Exception]:
        """One reading per alive node from a small monitor actor pinned there."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n.node_id: n for n in nodes if n.alive}
        with self._monitors_lock:
            for node_id in [i for i in self._monitors if i not in alive]:
                del self._monitors[node_id]
            for node_id, n in alive.items():
                if node_id not in self._monitors:
                    self._monitors[node_id] = ray.remote(num_cpus=0)(NodeMonitor).options(
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                    ).remote(node_id, n.labels)
            monitors = dict(self._monitors)
        refs = {node_id: actor.sample.remote() for node_id, actor in monitors.items()}
        out: dict[str, NodeSample | Exception] = {}
        for node_id, ref in refs.items():
            try:
                out[node_id] = ray.get(ref, timeout=30)
            except Exception as e:  # the node's monitor died or hangs: ask a new one next time
                out[node_id] = e
                with self._monitors_lock:
                    if self._monitors.get(node_id) is monitors[node_id]:  # not one made since
                        del self._monitors[node_id]
        return out

    def reset_monitors(self) -> None:
        import ray

        with self._monitors_lock:
            monitors, self._monitors = list(self._monitors.values()), {}
        for actor in monitors:
            ray.kill(actor)

    def fetcher_call(self, node_id: str, method: str, *args: Any) -> Any:
        """Call the weight fetcher of one node, made there the first time (one per node, named, so
        every admin replica and every restart of one finds the same download in progress)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from hive_apps.control.registry.monitor import node_name_of

        actor = self._fetchers.get(node_id)
        if actor is None:
            if self.namespace is None:
                raise RuntimeError("this process's cluster seam has no namespace for the weight fetchers "
                                   "(RayCluster(namespace=HIVE_STATE_NAMESPACE))")
            labels = next((n.labels for n in self.nodes() if n.node_id == node_id), None)
            if labels is None:
                raise LookupError(f"node {node_id[:12]} is not in the cluster")
            actor = ray.remote(NodeFetcher).options(
                name=f"hive-fetcher-{node_id}", namespace=self.namespace, get_if_exists=True,
                lifetime="detached", num_cpus=0, max_concurrency=16,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(node_name_of(node_id, labels))
            self._fetchers[node_id] = actor
        try:
            return ray.get(actor.call.remote(method, *args), timeout=FETCHER_CALL_TIMEOUT_S)  # type: ignore[union-attr]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self._fetchers.pop(node_id, None)  # dead or stuck: the next call looks it up again
            raise

    # --- durable state ------------------------------------------------------------------------
    def kv_get(self, namespace: str, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=namespace)

    def kv_put(self, namespace: str, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)

    def kv_delete(self, namespace: str, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=namespace)

    def kv_keys(self, namespace: str, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        return [k.decode() if isinstance(k, bytes) else k for k in internal_kv._internal_kv_list(prefix, namespace=namespace)]


_cluster: Cluster | None = None


def get_cluster() -> Cluster:
    global _cluster
    if _cluster is None:
        _cluster = RayCluster()
    return _cluster


def set_cluster(cluster: Cluster | None) -> None:
    """Install another ``Cluster`` for this process (tests: an in-memory fake)."""
    global _cluster
    _cluster = cluster
