"""Routers and the gateway route only to the replicas a model still has."""

import asyncio

from hive_apps.control.cluster import set_cluster
from hive_apps.serving.routing.follow import ModelReplicas, live_plan
from tests.unit.control.test_controller import Hive
from tests.unit.fake_cluster import FakeCluster
from tests.unit.helpers import routing


async def test_a_lost_replica_leaves_the_replica_set_and_a_moved_one_is_rebuilt():
    h = Hive(FakeCluster({"node-a": "H100-80GB", "node-b": "H100-80GB"}))
    try:
        await h.start_registry()
        await h.sample()
        await h.deploy("m", replicas=2)
        rec = await h.settle("m")
        sets = ModelReplicas(**routing())
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


async def test_a_router_that_just_started_waits_for_its_models_record(monkeypatch):
    """A request that reaches a new router before the registry's first answer waited for nothing:
    the router answered 404 for its own model (seen once in the cluster tier, right after a
    deploy). It now waits for that answer."""
    import httpx
    from starlette.requests import Request

    from hive_apps.serving.routing import router as router_module
    from tests.unit.control.test_controller import SETTINGS

    h = Hive(FakeCluster({"node-a": "H100-80GB"}))
    try:
        await h.start_registry()
        await h.sample()
        await h.deploy("m")
        rec = await h.settle("m")
        watch = h.registry.watch

        async def slow_first_watch(after, timeout_s):
            if after == -1:
                await asyncio.sleep(0.3)
            return await watch(after, timeout_s)

        monkeypatch.setattr(h.registry, "watch", slow_first_watch)
        monkeypatch.setattr(router_module, "get_settings", lambda: SETTINGS)
        router = router_module.Router("m", [h.cluster.engine_handle("m", 0)], rec.plan.replicas, 8)

        async def app(scope, receive, send):
            await (await router.answer(Request(scope, receive)))(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hive") as client:
            r = await client.get("/v1/models/m")
        assert r.status_code == 200 and r.json()["id"] == "m"
        router._follower.cancel()
        router.replicas.close()
        await asyncio.sleep(0)
    finally:
        set_cluster(None)


async def test_a_router_whose_view_still_says_deploying_asks_the_registry(monkeypatch):
    """The deploy answered ready and the gateway served, but this router's long-poll had not brought
    the change yet: it answered 404 "deploying and not ready yet" (seen in the cluster tier, a chat on
    /<id>/v1 right after one on /v1). It now asks the registry once and serves."""
    import httpx
    from starlette.requests import Request
    from starlette.responses import Response

    from hive_apps.core.state.records import ModelStatus
    from hive_apps.serving.routing import router as router_module
    from tests.unit.control.test_controller import SETTINGS

    h = Hive(FakeCluster({"node-a": "H100-80GB"}))
    try:
        await h.start_registry()
        await h.sample()
        deploying = await h.deploy("m")
        rec = await h.settle("m")
        assert rec.status is ModelStatus.READY
        monkeypatch.setattr(router_module, "get_settings", lambda: SETTINGS)
        router = router_module.Router("m", [h.cluster.engine_handle("m", 0)], rec.plan.replicas, 8)
        router._follower.cancel()
        router._on_models([deploying])  # its long-poll is one change behind

        async def app(scope, receive, send):
            await (await router.answer(Request(scope, receive)))(scope, receive, send)

        answered_for = []

        async def respond_for(rec, *_):
            answered_for.append(rec.status)
            return Response(status_code=200)

        from hive_apps.serving.routing import pipeline

        monkeypatch.setattr(pipeline, "respond_for", respond_for)  # the pipeline the router shares with the gateway
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hive") as client:
            await client.post("/v1/chat/completions", json=body)
        assert answered_for == [ModelStatus.READY]  # served as the registry has it, not as the stale view
        if router.replicas is not None:
            router.replicas.close()
        await asyncio.sleep(0)
    finally:
        set_cluster(None)
