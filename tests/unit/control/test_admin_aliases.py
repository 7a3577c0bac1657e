"""A model's ``aliases`` and ``env`` in the admin, in-process on the fake cluster: aliases share one
namespace with model ids and adapter names (a collision is a 409 naming who holds the name) and change
in place; ``env`` is held to the operator's allow-list, needs new engines to change, and a stored record
that today's list refuses keeps running."""

from __future__ import annotations

import pytest

from hive_apps.models.tiny import build_tiny_lora
from tests.unit.control.test_admin_app import NODES, SETTINGS, SIM_MODEL, admin_on, registry_on, sim_spec
from tests.unit.fake_cluster import FakeCluster

LORA = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}


@pytest.fixture
async def admin():
    async with admin_on(FakeCluster(NODES)) as a:
        r = await a.deploy(**sim_spec("qwen", gpu="node-a:gpu0", aliases=["chat", "default"], lora=LORA))
        assert r.status_code == 200, r.text
        yield a


def error(r, status: int, field: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return err["message"]


async def test_aliases_are_recorded_and_shown(admin):
    assert (await admin.client.get("/models/qwen")).json()["aliases"] == ["chat", "default"]
    assert admin.registry.book.records["qwen"].spec.aliases == ["chat", "default"]


async def test_a_name_held_as_an_alias_or_an_id_is_refused_with_its_holder(admin):
    msg = error(await admin.deploy(**sim_spec("other", gpu="node-a:gpu1", aliases=["chat"])), 409, "aliases")
    assert "alias 'chat' is taken by model 'qwen' (an alias of it)" in msg
    msg = error(await admin.deploy(**sim_spec("other", gpu="node-a:gpu1", aliases=["qwen"])), 409, "aliases")
    assert "alias 'qwen' is taken by model 'qwen';" in msg
    msg = error(await admin.deploy(**sim_spec("default", gpu="node-a:gpu1")), 409, "model_id")
    assert "model_id 'default' is an alias of model 'qwen'" in msg and "PUT /admin/models/qwen" in msg
    assert set(admin.registry.book.records) == {"qwen"}  # nothing planned or reserved for them
    # a dry run checks the body only, so a taken name plans
    assert (await admin.client.post("/plan", json=sim_spec("default"))).status_code == 200


async def test_the_spec_refuses_its_own_id_duplicates_and_reserved_names(admin):
    for aliases, words in ((["x", "other"], "lists the model_id 'other'"), (["dup", "dup"], "same alias twice"),
                           (["admin"], "'admin' is reserved"), (["Chat"], "alias 'Chat': must be a lowercase slug"),
                           ([f"a{i}" for i in range(17)], "lists 17 aliases; at most 16")):
        r = await admin.deploy(**sim_spec("other", gpu="node-a:gpu1", aliases=aliases))
        assert words in error(r, 422, "aliases")


async def test_adapters_and_aliases_share_the_namespace(admin, tmp_path):
    lora = build_tiny_lora(SIM_MODEL, tmp_path / "a", rank=8, base_name="Qwen/Qwen3-0.6B")
    r = await admin.client.post("/adapters", json={"model_id": "chat", "base": "qwen", "source": str(lora)})
    assert "'chat' is taken by model 'qwen' (an alias of it)" in error(r, 409, "model_id")
    r = await admin.client.post("/adapters", json={"model_id": "tuned", "base": "qwen", "source": str(lora)})
    assert r.status_code == 201, r.text
    r = await admin.deploy(**sim_spec("other", gpu="node-a:gpu1", aliases=["tuned"]))
    assert "alias 'tuned' is taken by LoRA adapter 'tuned' (on 'qwen')" in error(r, 409, "aliases")
    body = sim_spec("qwen", gpu="node-a:gpu0", aliases=["chat", "tuned"], lora=LORA)
    assert "LoRA adapter 'tuned'" in error(await admin.client.put("/models/qwen", json=body), 409, "aliases")


async def test_aliases_change_in_place_and_move_between_models(admin):
    assert (await admin.deploy(**sim_spec("small", gpu="node-a:gpu1"))).status_code == 200
    before = admin.registry.book.records["qwen"]
    builds = admin.cluster.apps["qwen"].builds

    r = await admin.client.put("/models/qwen", json=sim_spec("qwen", gpu="node-a:gpu0", aliases=["chat"], lora=LORA))
    assert r.status_code == 200 and r.json()["applied"] == "in_place" and r.json()["changed"] == ["aliases"], r.text
    assert r.json()["aliases"] == ["chat"]
    now = admin.registry.book.records["qwen"]
    assert now.plan == before.plan and now.plan_generation == before.plan_generation
    assert admin.cluster.apps["qwen"].builds == builds  # no new engines

    # "default" is free now: another model takes it in place too; "chat" is still qwen's
    r = await admin.client.put("/models/small", json=sim_spec("small", gpu="node-a:gpu1", aliases=["default"]))
    assert r.status_code == 200 and r.json()["applied"] == "in_place", r.text
    r = await admin.client.put("/models/small", json=sim_spec("small", gpu="node-a:gpu1", aliases=["chat"]))
    assert "alias 'chat' is taken by model 'qwen' (an alias of it)" in error(r, 409, "aliases")
    assert admin.registry.book.records["small"].spec.aliases == ["default"]  # refused: nothing changed
    # with recreate too the name is checked before the model is deleted
    r = await admin.client.put("/models/small", params={"recreate": "true"},
                               json=sim_spec("small", gpu="node-a:gpu1", aliases=["chat"], max_input_prompt_length=256))
    assert r.status_code == 409 and admin.registry.book.records["small"].status.value == "ready", r.text


async def test_a_deleted_models_aliases_are_free_again(admin):
    assert (await admin.client.delete("/models/qwen")).status_code == 200
    r = await admin.deploy(**sim_spec("other", gpu="node-a:gpu1", aliases=["chat"]))
    assert r.status_code == 200, r.text


# --- env -------------------------------------------------------------------------------------------
async def test_env_is_held_to_the_allow_list_the_operator_widens():
    async with admin_on(FakeCluster(NODES)) as a:
        msg = error(await a.deploy(**sim_spec("m", env={"MY_KNOB": "1"})), 422, "env")
        assert "MY_KNOB is not among" in msg and "HIVE_ENGINE_ENV_ALLOW=MY_KNOB" in msg
        msg = error(await a.deploy(**sim_spec("m", env={"CUDA_VISIBLE_DEVICES": "3"})), 422, "env")
        assert "CUDA_VISIBLE_DEVICES is refused" in msg and "no setting allows it" in msg
        assert error(await a.deploy(**sim_spec("m", env={"NCCL_DEBUG": 1})), 422, "env.NCCL_DEBUG")
        r = await a.deploy(**sim_spec("m", gpu="node-a:gpu0", env={"NCCL_DEBUG": "WARN"}))  # built in
        assert r.status_code == 200, r.text
    widened = SETTINGS.model_copy(update={"engine_env_allow": ["MY_*", "HF_TOKEN"]})
    async with admin_on(FakeCluster(NODES), widened) as a:
        assert (await a.deploy(**sim_spec("m", gpu="node-a:gpu0", env={"MY_KNOB": "1"}))).status_code == 200
        msg = error(await a.deploy(**sim_spec("n", env={"HF_TOKEN": "x"})), 422, "env")  # the deny-list wins
        assert "HF_TOKEN is refused" in msg


async def test_changing_env_needs_new_engines():
    async with admin_on(FakeCluster(NODES)) as a:
        assert (await a.deploy(**sim_spec("m", gpu="node-a:gpu0", env={"NCCL_DEBUG": "WARN"}))).status_code == 200
        body = sim_spec("m", gpu="node-a:gpu0", env={"NCCL_DEBUG": "INFO"})
        r = await a.client.put("/models/m", json=body)
        assert error(r, 409, "env") and set(r.json()["error"]["restart_fields"]) == {"env"}
        r = await a.client.put("/models/m", params={"recreate": "true", "wait": "true"}, json=body)
        assert r.status_code == 200 and r.json()["applied"] == "recreated", r.text
        assert a.registry.book.records["m"].spec.env == {"NCCL_DEBUG": "INFO"}


async def test_a_stored_env_todays_list_refuses_keeps_running_with_a_warning():
    widened = SETTINGS.model_copy(update={"engine_env_allow": ["MY_KNOB"]})
    cluster = FakeCluster(NODES)
    async with admin_on(cluster, widened) as a:
        assert (await a.deploy(**sim_spec("m", gpu="node-a:gpu0", env={"MY_KNOB": "1"}))).status_code == 200
        await registry_on(cluster, SETTINGS)  # a new registry replica, the operator's list narrowed
        status = (await a.client.get("/models/m")).json()
        assert status["status"] == "ready", status
        assert "MY_KNOB is not among" in status["policy_warning"]
