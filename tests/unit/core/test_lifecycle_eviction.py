"""Making room when a victim cannot go to sleep: a model healing or scaling, or one whose record
changed between the search and the ask, is never reported as evicted; the search moves on."""

from __future__ import annotations

import pytest

from hive_apps.control.cluster import set_cluster
from hive_apps.core.lifecycle import eviction_order
from hive_apps.core.state import transitions as t
from hive_apps.core.state.records import ModelStatus
from tests.unit.core.test_lifecycle import BIG, cand, life_on, ready


@pytest.fixture
async def two_cards():
    """Two L4s, each filled by one sleepable model: ``a`` (evicted first) and ``c``."""
    h = await life_on("L4.L4")
    await ready(h, "a", sleep_timeout=600, **BIG)
    await ready(h, "c", sleep_timeout=600, **BIG)
    yield h
    set_cluster(None)


async def newcomer(hive):
    return (await hive.registry.get_model("a")).spec.model_copy(update={"model_id": "b"})


def test_a_model_healing_or_scaling_is_no_candidate():
    order, refused = eviction_order([cand("healing", status=ModelStatus.HEALING), cand("ready")], now=1000.0,
                                    min_residency_s=0)
    assert [c.model_id for c in order] == ["ready"]
    assert refused[0].model_id == "healing" and "healing" in refused[0].reason


@pytest.fixture
async def a_heals():
    """``a`` and ``c`` fill an L4 each on two nodes; ``a``'s node dies and its replacement is starting on
    a third node's L4, the last free card: ``a`` heals, and a newcomer finds no room without evicting."""
    h = await life_on("L4", node_b="L4")
    await ready(h, "a", sleep_timeout=600, **BIG)
    await ready(h, "c", sleep_timeout=600, **BIG)
    lost = (await h.registry.get_model("a")).plan.replicas[0].node_name
    assert lost != (await h.registry.get_model("c")).plan.replicas[0].node_name
    h.cluster.add_node("node-c", "L4")
    h.cluster.kill_node(lost)
    await h.sample()
    assert (await h.registry.get_model("a")).status is ModelStatus.DEGRADED
    await h.step("a")  # the reconciler places the replacement
    assert (await h.registry.get_model("a")).status is ModelStatus.HEALING
    yield h
    set_cluster(None)


async def test_a_healing_model_is_passed_over_for_one_that_can_sleep(a_heals):
    two_cards = a_heals
    room = await two_cards.lifecycle.make_room(await newcomer(two_cards))
    assert room.evicting == ["c"] == room.waiting_for
    assert (await two_cards.registry.get_model("a")).status is ModelStatus.HEALING
    assert (await two_cards.registry.get_model("c")).status is ModelStatus.SLEEPING


def change_before_its_sleep(registry, model_id: str) -> None:
    """The model's record moves on (a heal began) between the search's read and its ``sleep`` ask."""
    asked = registry.transition

    async def transition(msg: t.Transition):
        if isinstance(msg, t.Sleep) and msg.model_id == model_id:
            await asked(t.Note(model_id=model_id, version=registry.book.records[model_id].version, message="a heal began"))
        return await asked(msg)

    registry.transition = transition


async def test_a_victim_whose_sleep_is_refused_is_not_waited_for(two_cards):
    change_before_its_sleep(two_cards.registry, "a")
    room = await two_cards.lifecycle.make_room(await newcomer(two_cards))
    assert room.evicting == ["c"] == room.waiting_for
    assert (await two_cards.registry.get_model("a")).status is ModelStatus.READY


async def test_with_no_other_victim_the_refusal_is_the_answer_at_once(two_cards):
    two_cards.registry.book.records["c"].spec.keep_resident = True
    change_before_its_sleep(two_cards.registry, "a")
    room = await two_cards.lifecycle.make_room(await newcomer(two_cards))
    assert room.plan is None and not room.evicting and not room.waiting_for and room.status_code == 503
    assert "a (its sleep was refused" in room.error and "c (keep_resident)" in room.error
