"""Idle destroy: requests held for a sleeping model are activity, so a model that clients keep
asking for while it cannot wake is not destroyed under them."""

from __future__ import annotations

import asyncio

import pytest

from hive_apps.control.cluster import set_cluster
from hive_apps.core.lifecycle import destroy_due, idle_since
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import ModelStatus
from hive_apps.serving.routing.hold import HoldRefused, WakeHold
from tests.unit.core.test_lifecycle import LIFE, idle_for, life_on, ready
from tests.unit.helpers import recorded_publisher


@pytest.fixture
async def life():
    yield await life_on("L4")
    set_cluster(None)


def test_the_last_wake_asked_restarts_the_idle_clock():
    since = idle_since(last_request_at=100.0, ready_at=50.0, wake_requested_at=900.0)
    assert since == 900.0 and not destroy_due(600, since, 0, now=1000.0)
    assert idle_since(100.0, 50.0) == 100.0


async def test_a_model_held_for_while_it_cannot_wake_is_not_destroyed(life):
    await ready(life, "m", sleep_timeout=5, idle_timeout=60)
    idle_for(life, "m", 6)
    await life.lifecycle.tick(await life.registry.list_models())
    assert (await life.settle("m")).status is ModelStatus.SLEEPING
    life.clock.advance(55)  # its engines' last request: 61 s ago, past its idle_timeout

    hold = WakeHold(LIFE, lambda model_id: life.registry.transition(t.Wake(model_id=model_id)), clock=life.clock,
                    publisher=recorded_publisher())
    await hold.update({"m": await life.registry.get_model("m")})
    held = asyncio.create_task(hold.wait("m"))  # a client asks for it now: the hold asks for a wake
    await asyncio.sleep(0.05)
    rec = await life.registry.get_model("m")
    assert rec.status is ModelStatus.WAKING
    assert (await life.registry.transition(t.WakeFailed(model_id="m", version=rec.version, reason="no room"))).ok
    await hold.update({"m": await life.registry.get_model("m")})
    with pytest.raises(HoldRefused):
        await held

    assert await life.lifecycle.tick(await life.registry.list_models()) == []
    assert (await life.registry.get_model("m")).status is ModelStatus.SLEEPING
    life.clock.advance(61)  # nobody asked since
    assert await life.lifecycle.tick(await life.registry.list_models()) == ["m"]
