from hive_apps.admin.model_app import replica_actor_options
from hive_apps.registry.devices import DeviceKind

from .helpers import replica_plan


def test_engine_replicas_are_pinned_and_get_no_secrets():
    rp = replica_plan().model_copy(update={"device_kind": DeviceKind.GPU, "device_indices": [1, 2], "node_id": "abc"})
    opts = replica_actor_options(rp)
    env = opts["runtime_env"]["env_vars"]
    assert opts["num_gpus"] == 0 and opts["label_selector"] == {"ray.io/node-id": "abc"}
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["HF_HUB_OFFLINE"] == "1"
    for secret in ("HIVE_ADMIN_TOKEN", "HIVE_API_KEYS", "HIVE_API_KEYS_FILE", "HIVE_MONITOR_TOKEN"):
        assert env[secret] == "", secret
    sim = replica_actor_options(replica_plan())  # a simulated GPU: no CUDA pin, still no secrets
    assert "CUDA_VISIBLE_DEVICES" not in sim["runtime_env"]["env_vars"]
    assert sim["runtime_env"]["env_vars"]["HIVE_API_KEYS"] == ""


def test_a_replica_placed_again_is_a_new_version_and_the_others_keep_theirs():
    from hive_apps.admin.model_app import replica_version

    from .planning_fixtures import gpu
    from .test_planning_placement import plan

    p = plan("Qwen__Qwen3-0.6B", [gpu("L4", "a", 0), gpu("L4", "a", 1)], replicas=2)
    r0, r1 = p.replicas
    assert replica_version("m", p, r0) == replica_version("m", p, r0, 0)  # stable
    assert replica_version("m", p, r0, 3) != replica_version("m", p, r0, 2)  # placed again, same device
    assert replica_version("m", p, r1) != replica_version("m", p, r0)
