from hive_apps.control.admin.model_app import replica_actor_options
from hive_apps.core.devices import DeviceKind
from tests.unit.helpers import replica_plan


def test_engine_replicas_are_pinned_and_get_no_secrets():
    rp = replica_plan().model_copy(update={"device_kind": DeviceKind.GPU, "device_indices": [1, 2], "node_id": "abc"})
    opts = replica_actor_options(rp)
    env = opts["runtime_env"]["env_vars"]
    assert opts["num_gpus"] == 0 and opts["label_selector"] == {"ray.io/node-id": "abc"}
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["HF_HUB_OFFLINE"] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA counts as NVML does, whose indices the plan names
    for secret in ("HIVE_ADMIN_TOKEN", "HIVE_API_KEYS", "HIVE_API_KEYS_FILE", "HIVE_MONITOR_TOKEN",
                   "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert env[secret] == "", secret  # the node's fetcher has the source credentials; engines never do
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"  # an allowed media host cannot redirect elsewhere
    sim = replica_actor_options(replica_plan())  # a simulated GPU: no CUDA pin, still no secrets
    assert "CUDA_VISIBLE_DEVICES" not in sim["runtime_env"]["env_vars"]
    assert "CUDA_DEVICE_ORDER" not in sim["runtime_env"]["env_vars"]
    assert sim["runtime_env"]["env_vars"]["HIVE_API_KEYS"] == ""


def test_a_replica_placed_again_is_a_new_version_and_the_others_keep_theirs():
    from hive_apps.control.admin.model_app import replica_version
    from tests.unit.core.test_planning_placement import plan
    from tests.unit.planning_fixtures import gpu

    p = plan("Qwen__Qwen3-0.6B", [gpu("L4", "a", 0), gpu("L4", "a", 1)], replicas=2)
    r0, r1 = p.replicas
    assert replica_version("m", p, r0) == replica_version("m", p, r0, 0)  # stable
    assert replica_version("m", p, r0, 3) != replica_version("m", p, r0, 2)  # placed again, same device
    assert replica_version("m", p, r1) != replica_version("m", p, r0)


async def test_each_engine_deployment_carries_its_plan_for_the_dashboard():
    from hive_apps.control.admin.model_app import plan_summary
    from hive_apps.serving.engine.sim_engine import SimEngine

    rp = replica_plan(sim_tokens_per_s=2000)
    summary = plan_summary(rp)
    assert summary["devices"] == rp.devices and summary["max_num_seqs"] == rp.settings.max_num_seqs
    assert summary["reservation_bytes"] == rp.reservation_bytes and summary["node"] == rp.node_name
    e = SimEngine.__new__(SimEngine)
    await e.__init__("m", "", rp, use_start_lock=False)
    e.reconfigure({"plan": summary})  # what Serve does with the deployment's user_config
    assert e.info()["plan"] == summary
