"""Build the Serve application of one model: a router plus one pinned deployment per replica."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ray import serve

from hive_apps import __version__
from hive_apps.core import names
from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.types import Plan, ReplicaPlan
from hive_apps.serving.routing.replica_set import default_queue_bound
from hive_apps.serving.routing.router import router_deployment

HEALTH_CHECK_PERIOD_S = 5.0
# Engine replicas run third-party model code: they get none of the hive's secrets nor the source
# credentials, and never reach a model hub (their node's fetcher put the weights in its cache).
SECRETS = ("HIVE_ADMIN_TOKEN", "HIVE_API_KEYS", "HIVE_API_KEYS_FILE", "HIVE_MONITOR_TOKEN",
           "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH",
           "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
           "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE")
# A media host that answers with a redirect must not lead vLLM to another host (HIVE_MEDIA_HOSTS).
ENGINE_ENV = {**{name: "" for name in SECRETS}, "HF_HUB_OFFLINE": "1", "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}


def engine_class(engine: str) -> type:
    if engine == "sim":
        from hive_apps.serving.engine.sim_engine import SimEngine

        return SimEngine
    from hive_apps.serving.engine.vllm_engine import VLLMEngine

    return VLLMEngine


def replica_actor_options(rp: ReplicaPlan, model_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Pin to the node by its id label, and to physical GPUs by CUDA_VISIBLE_DEVICES (never num_gpus).

    The indices are NVML's, which count GPUs in PCI bus order; CUDA counts fastest first unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so without it "1" can open another card on a mixed node. The
    engine checks the UUIDs it opened (serving/engine/cuda_devices.py).

    ``model_env``: the deploy's ``env`` (``core/engine_env.py`` refuses the names the hive sets), set
    first so the hive's own variables win even over a record an older hive stored."""
    env: dict[str, str] = {**(model_env or {}), **ENGINE_ENV}
    if rp.device_kind is DeviceKind.GPU:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in rp.device_indices)
    return {
        "num_cpus": 0,
        "num_gpus": 0,
        "label_selector": {"ray.io/node-id": rp.node_id},
        "runtime_env": {"env_vars": env},
    }


def replica_version(model_id: str, plan: Plan, rp: ReplicaPlan, generation: int = 0,
                    model_env: dict[str, str] | None = None) -> str:
    """Stable while the replica's plan and environment are; new when it moved, was placed again after a
    failed start (Serve 2.60 stops a rolling update after a failed start and keeps that version failed
    until a different version is deployed), or its ``env`` changed (a process's environment is fixed)."""
    weights = plan.weights.key if plan.weights is not None else plan.profile.path
    env = json.dumps(model_env or {}, sort_keys=True)
    key = f"{__version__}|{plan.engine}|{model_id}|{weights}|{rp.model_dump_json()}|{generation}|{env}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def plan_summary(rp: ReplicaPlan) -> dict[str, Any]:
    """What the Ray dashboard shows as each engine deployment's config: where it runs and what
    the planner gave it (the full plan is in ``GET /admin/models/{id}``)."""
    st = rp.settings
    return {"node": rp.node_name, "devices": rp.devices, "device_kind": rp.device_kind.value,
            "tensor_parallel_size": st.tensor_parallel_size, "max_num_seqs": st.max_num_seqs,
            "max_model_len": st.max_model_len, "max_num_batched_tokens": st.max_num_batched_tokens,
            "kv_cache_memory_bytes": st.kv_cache_memory_bytes, "reservation_bytes": rp.reservation_bytes,
            "expected_tokens_per_s": rp.expected_tokens_per_s}


def build_model_app(model_id: str, plan: Plan, max_queued_requests: int | None = None,
                    generations: dict[int, int] | None = None, *, model_env: dict[str, str] | None = None):
    """``generations``: replica index -> the plan generation it was (last) placed at; ``model_env``: the
    deploy's ``env`` for every engine process."""
    cls = engine_class(plan.engine)
    engines = []
    for rp in plan.replicas:
        dep = serve.deployment(cls).options(  # type: ignore[attr-defined]
            name=names.engine_deployment(rp.index),
            num_replicas=1,
            max_ongoing_requests=max(64, rp.settings.max_num_seqs * 4),
            max_constructor_retry_count=1,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=30,
            graceful_shutdown_timeout_s=5,
            ray_actor_options=replica_actor_options(rp, model_env),
            user_config={"plan": plan_summary(rp)},
        )
        # A stable version per replica plan: redeploying the app (self-healing) replaces only the
        # replicas whose plan changed; Serve would otherwise restart every engine. Serve 2.60
        # removed the public `version` option but still honours the attribute.
        dep._version = replica_version(model_id, plan, rp, (generations or {}).get(rp.index, 0), model_env)
        # the manifest, never a path: each engine finds the weights in its own node's cache
        engines.append(dep.bind(model_id, plan.weights or plan.profile.path, rp))
    router = router_deployment()
    # One version for the router's whole life: parking and waking rebuild the app without engines
    # and with them again, and the router (holding requests that wait for the wake) must stay.
    router._version = hashlib.sha256(f"{__version__}|router|{model_id}".encode()).hexdigest()[:16]
    return router.bind(model_id, engines, plan.replicas, default_queue_bound(plan, max_queued_requests))
