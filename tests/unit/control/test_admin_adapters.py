"""``/admin/adapters`` in-process (``control/admin/adapters.py``): a sim base deployed with ``lora``, tiny
random adapters built for its shape, every refusal a 4xx naming its field, deletes with and without
``cascade``, and adapters that outlive a registry restart."""

from __future__ import annotations

import json

import pytest

from hive_apps.models.tiny import build_tiny_lora
from hive_apps.serving.engine.protocol import EngineLoad
from tests.unit.control.test_admin_app import NODES, SETTINGS, SIM_MODEL, admin_on, registry_on, sim_spec
from tests.unit.fake_cluster import FakeCluster
from tests.unit.planning_fixtures import fixture_path

LORA = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}


@pytest.fixture
async def admin():
    async with admin_on(FakeCluster(NODES)) as a:
        r = await a.deploy(**sim_spec("base", gpu="node-a:gpu0", lora=LORA))
        assert r.status_code == 200, r.text
        r = await a.deploy(**sim_spec("plain", gpu="node-a:gpu1"))
        assert r.status_code == 200, r.text
        yield a


@pytest.fixture
def lora_dir(tmp_path):
    """An adapter of the base's shape (Qwen3-0.6B), rank 8, on q_proj and v_proj."""
    return build_tiny_lora(SIM_MODEL, tmp_path / "a", rank=8, base_name="Qwen/Qwen3-0.6B")


def body(source, model_id: str = "a1", base: str = "base") -> dict:
    return {"model_id": model_id, "base": base, "source": str(source)}


def error(r, status: int, field: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return err["message"]


async def test_an_adapter_is_deployed_listed_and_deleted(admin, lora_dir):
    base = (await admin.client.get("/models/base")).json()
    assert base["replicas"]["r0"]["memory"]["lora"] > 0  # the slots are booked with the base
    assert any(n.startswith("lora: 2 slots of rank 8") for n in base["notes"])
    r = await admin.client.post("/adapters", json=body(lora_dir))
    assert r.status_code == 201, r.text
    a = r.json()
    assert (a["model_id"], a["base"], a["rank"], a["target_modules"]) == ("a1", "base", 8, ["q_proj", "v_proj"])
    assert a["serving"] and a["base_status"] == "ready" and a["revision"] == "local" and a["openai_v1"] == "/v1"
    assert [x["model_id"] for x in (await admin.client.get("/adapters")).json()["adapters"]] == ["a1"]
    assert (await admin.client.get("/adapters/a1")).json()["source"] == str(lora_dir)
    r = await admin.client.delete("/adapters/a1")
    assert r.status_code == 200 and r.json() == {"deleted": "a1", "base": "base"}, r.text
    error(await admin.client.get("/adapters/a1"), 404, "model_id")
    assert "GET /admin/adapters" in error(await admin.client.delete("/adapters/a1"), 404, "model_id")


async def test_where_an_adapter_is_loaded_is_read_from_the_engines(admin, lora_dir):
    """``loaded_on``: the base's replicas whose engine reports the adapter loaded (their load report,
    what routing prefers them by); nothing is stored, so no restart can lose or stale it."""
    assert (await admin.client.post("/adapters", json=body(lora_dir))).status_code == 201
    assert (await admin.client.get("/adapters/a1")).json()["loaded_on"] == []
    admin.cluster.loads["base"] = EngineLoad(adapters=["a1"])
    assert (await admin.client.get("/adapters/a1")).json()["loaded_on"] == ["r0"]
    listed = (await admin.client.get("/adapters")).json()["adapters"]
    assert [(a["model_id"], a["loaded_on"]) for a in listed] == [("a1", ["r0"])]
    admin.cluster.loads["base"] = EngineLoad(adapters=["other"])  # evicted by the engine's LRU
    assert (await admin.client.get("/adapters/a1")).json()["loaded_on"] == []


async def test_every_bad_adapter_is_a_4xx_that_names_the_problem(admin, lora_dir, tmp_path):
    msg = error(await admin.client.post("/adapters", json=body(lora_dir, base="ghost")), 404, "base")
    assert "unknown base 'ghost'" in msg
    msg = error(await admin.client.post("/adapters", json=body(lora_dir, base="plain")), 422, "base")
    assert "deployed without lora" in msg and "recreate=true" in msg
    high = build_tiny_lora(SIM_MODEL, tmp_path / "r16", rank=16, base_name="Qwen/Qwen3-0.6B")
    msg = error(await admin.client.post("/adapters", json=body(high)), 422, "source")
    assert "rank 16 is above the base's max_lora_rank=8" in msg
    other = build_tiny_lora(fixture_path("tiny-qwen2"), tmp_path / "tiny", rank=8)
    msg = error(await admin.client.post("/adapters", json=body(other)), 422, "source")
    assert "hidden_size=1024" in msg and "made for another base" in msg
    llama = build_tiny_lora(SIM_MODEL, tmp_path / "llama", rank=8, base_name="meta-llama/Llama-3.2-1B")
    assert "(llama)" in error(await admin.client.post("/adapters", json=body(llama)), 422, "source")
    (lora_dir / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "fc_in"]}))
    msg = error(await admin.client.post("/adapters", json=body(lora_dir)), 422, "source")
    assert "target modules ['fc_in'] are not modules of the base" in msg
    (lora_dir / "adapter_config.json").write_text("{broken")
    assert "adapter_config.json is malformed" in error(await admin.client.post("/adapters", json=body(lora_dir)), 422,
                                                       "source")
    msg = error(await admin.client.post("/adapters", json=body(tmp_path / "nowhere")), 422, "source")
    assert "does not exist" in msg
    assert error(await admin.client.post("/adapters", json={**body(high), "rank": 4}), 422, "rank")
    assert "reserved" in error(await admin.client.post("/adapters", json=body(high, model_id="admin")), 422, "model_id")
    assert await admin.client.get("/adapters") and (await admin.client.get("/adapters")).json()["adapters"] == []


async def test_names_are_shared_by_models_and_adapters(admin, lora_dir):
    assert (await admin.client.post("/adapters", json=body(lora_dir))).status_code == 201
    msg = error(await admin.client.post("/adapters", json=body(lora_dir)), 409, "model_id")
    assert "adapter 'a1' exists" in msg
    assert "a model's name" in error(await admin.client.post("/adapters", json=body(lora_dir, "plain")), 409, "model_id")
    r = await admin.deploy(**sim_spec("a1", gpu="node-b:gpu0"))
    assert "LoRA adapter's name" in error(r, 409, "model_id")


async def test_a_base_with_adapters_is_deleted_only_with_cascade(admin, lora_dir, tmp_path):
    second = build_tiny_lora(SIM_MODEL, tmp_path / "b", rank=8, seed=2, base_name="Qwen/Qwen3-0.6B")
    for name, folder in (("a1", lora_dir), ("a2", second)):
        assert (await admin.client.post("/adapters", json=body(folder, name))).status_code == 201
    msg = error(await admin.client.delete("/models/base"), 409, "model_id")
    assert "['a1', 'a2']" in msg and "?cascade=true" in msg
    assert (await admin.client.get("/models/base")).json()["status"] == "ready"
    r = await admin.client.delete("/models/base", params={"cascade": "true"})
    assert r.status_code == 200 and r.json() == {"deleted": "base", "adapters_deleted": ["a1", "a2"]}, r.text
    assert (await admin.client.get("/adapters")).json()["adapters"] == []


async def test_adapters_survive_a_registry_restart(admin, lora_dir):
    assert (await admin.client.post("/adapters", json=body(lora_dir))).status_code == 201
    await registry_on(admin.cluster, SETTINGS)  # a new registry replica reads the KV back
    listed = (await admin.client.get("/adapters")).json()["adapters"]
    assert [(a["model_id"], a["base"], a["serving"]) for a in listed] == [("a1", "base", True)]


async def test_an_adapter_outside_the_model_root_is_refused(lora_dir, tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    async with admin_on(FakeCluster(NODES), SETTINGS.model_copy(update={"model_root": root})) as a:
        msg = error(await a.client.post("/adapters", json=body(lora_dir)), 422, "source")
        assert "HIVE_MODEL_ROOT" in msg
