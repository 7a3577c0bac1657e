"""What one client can cost the hive: a flood of made-up model names is not a flood of registry
calls (``serving/routing/follow.py`` ``NewModelLookup``), and one API key cannot take every hold slot of
a sleeping model (``serving/routing/hold.py``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from hive_apps.control.cluster import set_cluster
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import ModelRecord, ModelStatus
from hive_apps.serving.gateway.ingress import make_gateway_app
from hive_apps.serving.routing.follow import NewModelLookup
from hive_apps.serving.routing.hold import HoldRefused, WakeHold, client_of, client_slots, replica_slots
from tests.unit.control.test_controller import Hive
from tests.unit.core.test_lifecycle import idle_for, ready
from tests.unit.fake_cluster import FakeCluster
from tests.unit.helpers import recorded_publisher

KEYS = ["key-a", "key-b"]
SETTINGS = HiveSettings(api_keys=KEYS, deploy_timeout_s=30, min_residency_s=0, drain_grace_s=0.2,
                        hold_timeout_s=5, hold_max_per_model=4)


def record(status: ModelStatus) -> ModelRecord:
    return ModelRecord.model_construct(model_id="m", status=status, message="")


# --- unknown model names ------------------------------------------------------------------
async def test_a_name_found_missing_is_not_asked_about_again_for_a_while():
    asked: list[str] = []

    async def registry(model_id):
        asked.append(model_id)

    lookup = NewModelLookup(registry, missing_ttl_s=0.1)
    assert await lookup.find("nope") is None and await lookup.find("nope") is None
    assert asked == ["nope"]
    await asyncio.sleep(0.15)
    assert await lookup.find("nope") is None and asked == ["nope", "nope"]


async def test_a_slow_registry_costs_a_short_timeout_and_the_missing_names_are_bounded():
    async def hangs(model_id):
        await asyncio.sleep(3600)

    lookup = NewModelLookup(hangs, timeout_s=0.05, max_missing=3, per_s=100)
    began = time.monotonic()
    assert await lookup.find("slow") is None and time.monotonic() - began < 1
    for name in "abcde":
        await lookup.find(name)
    assert list(lookup.missing) == ["c", "d", "e"]


async def test_a_listed_model_is_found_and_a_failed_one_is_not():
    records = {"up": record(ModelStatus.SLEEPING), "broken": record(ModelStatus.FAILED)}

    async def registry(model_id):
        return records.get(model_id)

    lookup = NewModelLookup(registry)
    assert await lookup.find("up") is records["up"] and await lookup.find("broken") is None


@pytest.fixture
async def gateway(monkeypatch):
    """A gateway in front of a registry on the in-memory cluster, and a client of it."""
    h = Hive(FakeCluster({"node-a": "L4"}))
    await h.start_registry()
    await h.sample()
    gw = make_gateway_app(h.cluster, SETTINGS, publisher=recorded_publisher())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://hive") as client:
        yield h, client
    gw.close()
    await asyncio.sleep(0)
    set_cluster(None)


def chat(client: httpx.AsyncClient, model: str, key: str = KEYS[0]):
    return client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


async def test_a_flood_of_made_up_names_is_not_a_flood_of_registry_calls(gateway):
    h, client = gateway
    asked: list[str] = []
    get_model = h.registry.get_model

    async def counted(model_id):
        asked.append(model_id)
        return await get_model(model_id)

    h.registry.get_model = counted
    started = time.monotonic()
    answers = [await chat(client, f"made-up-{uuid.uuid4().hex}") for _ in range(60)]
    answers += [await chat(client, "the-same-typo") for _ in range(20)]
    took = time.monotonic() - started
    assert {r.status_code for r in answers} == {404}
    # the lookup budget: 20 at once and 20 a second after (LOOKUPS_PER_S), not one per request
    assert len(asked) <= 21 + int(took * 20) < 80, (len(asked), took)


async def test_an_unknown_name_is_a_quick_404_when_the_registry_hangs(gateway):
    h, client = gateway

    async def hangs(model_id):
        await asyncio.sleep(3600)

    h.registry.get_model = hangs
    answer = await asyncio.wait_for(chat(client, "nobody"), 5)
    assert answer.status_code == 404


# --- the hold's per-client share ----------------------------------------------------------
def test_clients_are_told_apart_by_a_digest_of_their_key():
    a = client_of("Bearer key-a")
    assert a == client_of("Bearer key-a") != client_of("Bearer key-b") and "key-a" not in a
    assert client_of(None) is None and client_slots(64) == 32 and client_slots(1) == 1


async def test_one_key_holds_at_most_its_share_and_others_still_get_in():
    async def no_wake(model_id):
        return None

    hold = WakeHold(SETTINGS, no_wake, publisher=recorded_publisher())
    await hold.update({"m": record(ModelStatus.WAKING)})
    greedy, other = client_of("Bearer key-a"), client_of("Bearer key-b")
    held = [asyncio.create_task(hold.wait("m", client=greedy)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(HoldRefused) as refused:
        await hold.wait("m", client=greedy)
    answer = refused.value.response
    assert answer.status_code == 429 and answer.headers["retry-after"]
    assert "HIVE_HOLD_MAX_PER_MODEL=4" in json.loads(answer.body)["error"]["message"]
    held.append(asyncio.create_task(hold.wait("m", client=other)))
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in held) and hold.held["m"] == 3
    await hold.update({"m": record(ModelStatus.READY)})
    await asyncio.gather(*held)
    assert hold.held_by == {}


async def test_through_the_gateway_one_key_cannot_fill_a_sleeping_models_hold(gateway):
    h, client = gateway
    h.lifecycle = h.reconciler.lifecycle
    await ready(h, "m", sleep_timeout=5)
    idle_for(h, "m", 6)
    await h.lifecycle.tick(await h.registry.list_models())
    assert (await h.settle("m")).status is ModelStatus.SLEEPING
    await asyncio.sleep(0.05)  # the gateway's long-poll brings the sleeping record
    greedy = [asyncio.create_task(chat(client, "m")) for _ in range(2)]
    await asyncio.sleep(0.1)
    third = await chat(client, "m")
    assert third.status_code == 429 and third.headers["retry-after"] and "your requests" in third.json()["error"]["message"]
    other = asyncio.create_task(chat(client, "m", key=KEYS[1]))
    await asyncio.sleep(0.1)
    assert not other.done() and not any(t.done() for t in greedy)
    for task in (*greedy, other):
        task.cancel()


def test_gateway_replicas_share_the_hold_bound():
    assert [replica_slots(64, n) for n in (1, 2, 3)] == [64, 32, 22]
    assert replica_slots(1, 2) == 1 and replica_slots(0, 2) == 0  # 0 = hold nothing, anywhere


async def test_each_gateway_replica_holds_its_part_of_a_models_bound():
    async def no_wake(model_id):
        return None

    hold = WakeHold(SETTINGS, no_wake, entry="gateway", replicas=2, publisher=recorded_publisher())  # SETTINGS: 4 per model, so 2 here
    await hold.update({"m": record(ModelStatus.WAKING)})
    held = [asyncio.create_task(hold.wait("m")) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(HoldRefused) as refused:
        await hold.wait("m")
    assert refused.value.response.status_code == 429 and refused.value.response.headers["retry-after"]
    assert hold.held["m"] == 2
    await hold.update({"m": record(ModelStatus.READY)})
    await asyncio.gather(*held)


def test_the_gateway_app_args_are_checked():
    from hive_apps.serving.gateway.app import GatewayArgs

    assert GatewayArgs().replicas == 2
    with pytest.raises(ValueError, match="replicas"):
        GatewayArgs.model_validate({"replicas": 0})
    with pytest.raises(ValueError, match="replica"):
        GatewayArgs.model_validate({"replica": 3})  # a typo is refused, not ignored
