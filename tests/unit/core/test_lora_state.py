"""LoRA adapters in the registry: typed records, their two transitions, a base's deletion with adapters on
it, and a registry restart that loses none of them (``core/state/book.py``, ``control/registry/deployment.py``)."""

from __future__ import annotations

import pytest

from hive_apps.control.cluster import set_cluster
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import AdapterDeletion, AdapterRecord, ModelStatus
from hive_apps.core.weights.source import parse_source
from hive_apps.core.weights.types import Manifest, RemoteFile
from tests.unit.control.test_controller import Hive
from tests.unit.fake_cluster import FakeCluster


def adapter_record(name: str, base: str = "base", folder: str = "/adapters/a") -> AdapterRecord:
    files = [RemoteFile(path="adapter_config.json", size=100), RemoteFile(path="adapter_model.safetensors", size=999)]
    return AdapterRecord(model_id=name, base=base, source=folder, rank=8, alpha=16, target_modules=["q_proj", "v_proj"],
                         weights=Manifest(source=parse_source(folder), revision="local", files=files), bytes=999)


@pytest.fixture
async def hive():
    h = Hive(FakeCluster({"node-a": "L4"}))
    await h.start_registry()
    await h.sample()
    await h.deploy("base", lora={"max_loras": 2, "max_lora_rank": 8})
    await h.deploy("plain")
    yield h
    set_cluster(None)


async def create(h: Hive, name: str, base: str = "base"):
    return await h.registry.transition(t.CreateAdapter(model_id=name, record=adapter_record(name, base)))


async def test_an_adapter_is_created_listed_announced_and_deleted(hive):
    before = hive.registry.book.version
    out = await create(hive, "a1")
    assert out.ok and out.adapter is not None and out.adapter.created_at == hive.clock() and out.record is None
    assert hive.registry.book.version > before  # followers (gateway, routers) see it
    view = await hive.registry.watch(before, 0)
    assert [a.model_id for a in view.adapters] == ["a1"] and (await hive.registry.get_adapter("a1")).base == "base"
    assert hive.cluster.kv_get("ray-hive", "adapter/a1") is not None
    gone = await hive.registry.transition(t.DeleteAdapter(model_id="a1"))
    assert gone.ok and await hive.registry.list_adapters() == []
    assert hive.cluster.kv_get("ray-hive", "adapter/a1") is None
    again = await hive.registry.transition(t.DeleteAdapter(model_id="a1"))
    assert not again.ok and again.status_code == 404 and "GET /admin/adapters" in again.message


async def test_names_are_one_namespace_and_the_base_must_serve_lora(hive):
    assert (await create(hive, "a1")).ok
    dup = await create(hive, "a1")
    assert dup.status_code == 409 and "already an adapter" in dup.message
    model_name = await create(hive, "plain", base="base")
    assert model_name.status_code == 409 and "a model's name" in model_name.message
    no_base = await create(hive, "a2", base="ghost")
    assert no_base.status_code == 404 and "no model 'ghost'" in no_base.message
    no_lora = await create(hive, "a3", base="plain")
    assert no_lora.status_code == 422 and "without lora" in no_lora.message
    taken = await hive.registry.transition(t.Create(model_id="a1", record=(await hive.registry.get_model("plain"))
                                                    .model_copy(update={"model_id": "a1"}), reservations=[]))
    assert taken.status_code == 409 and "LoRA adapter's name" in taken.message


async def test_a_base_with_adapters_is_deleted_only_with_them_or_keeping_them(hive):
    for name in ("a1", "a2"):
        assert (await create(hive, name)).ok
    refused = await hive.registry.transition(t.Delete(model_id="base"))
    assert refused.status_code == 409 and "['a1', 'a2']" in refused.message and "?cascade=true" in refused.message
    assert (await hive.registry.get_model("base")).status is ModelStatus.DEPLOYING  # untouched
    kept = await hive.registry.transition(t.Delete(model_id="base", adapters=AdapterDeletion.KEEP))
    assert kept.ok and kept.record.status is ModelStatus.DELETING and len(await hive.registry.list_adapters()) == 2
    cascade = await hive.registry.transition(t.Delete(model_id="base", adapters=AdapterDeletion.CASCADE))
    assert cascade.ok and await hive.registry.list_adapters() == []  # deleting twice is one delete: adapters go
    assert hive.cluster.kv_keys("ray-hive", "adapter/") == []


async def test_a_new_registry_reads_every_adapter_back(hive):
    assert (await create(hive, "a1")).ok
    assert (await create(hive, "a2")).ok
    first = await hive.registry.get_adapter("a2")
    await hive.start_registry()  # a restarted replica: everything from the KV
    assert [a.model_id for a in await hive.registry.list_adapters()] == ["a1", "a2"]
    assert await hive.registry.get_adapter("a2") == first
    assert (await create(hive, "a1")).status_code == 409  # and it still knows the names


def test_an_adapters_revision_key_changes_with_a_new_deploy():
    a, b = adapter_record("a1"), adapter_record("a1")
    b.version = a.version + 1  # the book's version at each create
    assert a.revision_key != b.revision_key and a.weights.key in a.revision_key



async def respec(h: Hive, model_id: str, **update):
    rec = await h.registry.get_model(model_id)
    return await h.registry.transition(t.Respec(model_id=model_id, version=rec.version, origin=rec.origin,
                                                spec=rec.spec.model_copy(update=update)))


async def test_the_registry_keeps_aliases_in_the_namespace_whoever_asks(hive):
    """The admin checks names first; the registry checks again at each transition that adds one, so two
    admins (or a declared model and a POST) cannot both take a name."""
    from hive_apps.core.state.records import ModelRecord, Reservation

    assert (await respec(hive, "plain", aliases=["chat"])).ok  # in place
    assert (await create(hive, "a1")).ok
    taken = await create(hive, "chat")
    assert taken.status_code == 409 and "'chat' is taken by model 'plain' (an alias of it)" in taken.message
    for alias, holder in (("chat", "model 'plain' (an alias of it)"), ("a1", "LoRA adapter 'a1' (on 'base')"),
                          ("plain", "model 'plain'")):
        out = await respec(hive, "base", aliases=[alias])
        assert out.status_code == 409 and f"alias {alias!r} is taken by {holder}" in out.message, out.message
    rec = await hive.registry.get_model("plain")
    spec = rec.spec.model_copy(update={"model_id": "chat", "aliases": []})
    out = await hive.registry.transition(t.Create(model_id="chat", record=ModelRecord(
        model_id="chat", spec=spec, plan=rec.plan), reservations=[Reservation.for_replica("chat", rp)
                                                                   for rp in rec.plan.replicas]))
    assert out.status_code == 409 and "model_id 'chat' is an alias of model 'plain'" in out.message
    assert (await hive.registry.get_model("base")).spec.aliases == []
