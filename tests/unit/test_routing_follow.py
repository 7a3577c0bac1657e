"""Routers and the gateway route only to the replicas a model still has."""

import asyncio

from hive_apps.cluster import set_cluster
from hive_apps.routing.follow import ModelReplicas, live_plan
from tests.unit.test_controller import Hive
from tests.unit.fake_cluster import FakeCluster


async def test_a_lost_replica_leaves_the_replica_set_and_a_moved_one_is_rebuilt():
    h = Hive(FakeCluster({"node-a": "H100-80GB", "node-b": "H100-80GB"}))
    try:
        await h.start_registry()
        await h.sample()
        await h.deploy("m", replicas=2)
        rec = await h.settle("m")
        sets = ModelReplicas()
        first = sets.of(rec)
        assert sorted(first.handles) == [0, 1] and sets.of(rec) is first  # unchanged: the same set
        h.cluster.kill_node(rec.plan.replicas[1].node_name)
        await h.sample()
        degraded = await h.registry.get_model("m")
        assert [rp.index for rp in live_plan(degraded).replicas] == [0]
        second = sets.of(degraded)
        assert second is not first and sorted(second.handles) == [0]
        sets.keep_only(set())
        await asyncio.sleep(0)
    finally:
        set_cluster(None)
