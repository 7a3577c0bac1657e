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


def test_a_deploys_env_reaches_its_engines_and_the_hives_own_variables_win():
    from hive_apps.control.admin.model_app import ENGINE_ENV
    from hive_apps.core.engine_env import denied_reason

    rp = replica_plan().model_copy(update={"device_kind": DeviceKind.GPU, "device_indices": [3], "node_id": "abc"})
    # what an older hive might have stored: the pin and a blanked secret are the hive's whatever the record says
    env = replica_actor_options(rp, {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0", "HF_TOKEN": "leak"})
    env = env["runtime_env"]["env_vars"]
    assert (env["NCCL_DEBUG"], env["CUDA_VISIBLE_DEVICES"], env["HF_TOKEN"]) == ("INFO", "3", "")
    # and a deploy may set none of the variables the hive sets
    assert [n for n in [*ENGINE_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"] if denied_reason(n) is None] == []


def test_a_change_of_env_is_a_new_version_of_every_replica():
    from hive_apps.control.admin.model_app import replica_version
    from tests.unit.core.test_planning_placement import plan
    from tests.unit.planning_fixtures import gpu

    p = plan("Qwen__Qwen3-0.6B", [gpu("L4", "a", 0)], replicas=1)
    r0 = p.replicas[0]
    assert replica_version("m", p, r0, 0, {}) == replica_version("m", p, r0, 0, None) == replica_version("m", p, r0)
    info = replica_version("m", p, r0, 0, {"NCCL_DEBUG": "INFO"})
    assert info != replica_version("m", p, r0) and info != replica_version("m", p, r0, 0, {"NCCL_DEBUG": "WARN"})
    assert replica_version("m", p, r0, 0, {"A": "1", "B": "2"}) == replica_version("m", p, r0, 0, {"B": "2", "A": "1"})


def test_the_built_app_gives_every_engine_the_deploys_env():
    from hive_apps.control.admin.model_app import build_model_app, replica_version
    from tests.unit.core.test_planning_placement import plan
    from tests.unit.planning_fixtures import gpu

    p = plan("Qwen__Qwen3-0.6B", [gpu("L4", "a", 0), gpu("L4", "a", 1)], replicas=2)
    app = build_model_app("m", p, model_env={"NCCL_DEBUG": "INFO"})
    engines = app._bound_deployment.init_args[1]
    assert len(engines) == 2
    for rp, engine in zip(p.replicas, engines):
        dep = engine._bound_deployment
        assert dep.ray_actor_options["runtime_env"]["env_vars"]["NCCL_DEBUG"] == "INFO"
        assert dep._version == replica_version("m", p, rp, 0, {"NCCL_DEBUG": "INFO"})
