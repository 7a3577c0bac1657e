"""The two ways to an engine replica behind one ``EngineTransport``, against a sim engine on its own port."""

import asyncio
import json

import pytest

from hive_apps.core.settings import HiveSettings, get_settings
from hive_apps.serving.engine import http_server
from hive_apps.serving.engine.protocol import EngineLoad, ForwardedRequest, ResponseStart
from hive_apps.serving.routing.replica_set import ReplicaSet
from hive_apps.serving.routing.transport import (
    EngineOverloaded,
    EngineTransport,
    HttpTransport,
    ServeTransport,
    make_transport,
)
from tests.unit.helpers import routing
from tests.unit.serving.test_engine_http import CHAT, FakeHandle, _raw, engine

READ_TIMEOUT_S = HiveSettings().engine_read_timeout_s


def chat(**fields) -> ForwardedRequest:
    return ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                            body=json.dumps({**CHAT, **fields}).encode())


@pytest.mark.parametrize("kind", ["http", "serve"])
async def test_each_transport_probes_calls_and_streams_an_engine(kind):
    e = await engine(sim_tokens_per_s=5000)
    h = FakeHandle(e)
    serve = ServeTransport({0: h})
    t: EngineTransport = HttpTransport(serve, READ_TIMEOUT_S) if kind == "http" else serve
    for _ in range(2):  # over HTTP: the first probe learns the port over Serve, the second uses it
        load = await t.load(0)
        assert isinstance(load, EngineLoad) and load.max_num_seqs == 4
    start, body = await t.call(0, chat())
    assert start.status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    items = [item async for item in t.stream(0, chat(stream=True))]
    assert isinstance(items[0], ResponseStart) and items[0].status == 200
    assert b"".join(items[1:]).decode().rstrip().endswith("data: [DONE]")
    over_serve = {name: h.calls.get(name, 0) for name in ("load", "forward_unary", "forward")}
    if kind == "http":
        assert t.endpoints[0] == e.endpoint()
        assert over_serve == {"load": 1, "forward_unary": 0, "forward": 0}
    else:
        assert over_serve == {"load": 2, "forward_unary": 1, "forward": 1} and "endpoint" not in h.calls
    assert e.in_flight == 0
    t.close()
    await e.http.stop()


async def test_a_full_port_is_overloaded_and_stays_known_any_other_failure_forgets_it(monkeypatch):
    monkeypatch.setattr(http_server, "MAX_CONNECTIONS", 1)
    e = await engine(sim_tokens_per_s=5000)
    monkeypatch.undo()
    h = FakeHandle(e)
    t = HttpTransport(ServeTransport({0: h}), READ_TIMEOUT_S)
    t.endpoints[0] = e.endpoint()
    holder = await _raw(e)  # takes the port's only slot
    await asyncio.sleep(0.05)
    with pytest.raises(EngineOverloaded):
        await t.call(0, chat())
    with pytest.raises(EngineOverloaded):
        [item async for item in t.stream(0, chat(stream=True))]
    t.failed(0, EngineOverloaded("full"))
    assert t.endpoints[0] == e.endpoint(), "a full port is still the replica's port"
    t.failed(0, ConnectionResetError("gone"))
    assert t.endpoints[0] is None
    start, _ = await t.call(0, chat())  # the port not known: Serve answers meanwhile
    assert start.status == 200 and h.calls["forward_unary"] == 1
    holder[1].close()
    t.close()
    await e.http.stop()


async def test_the_http_transport_closes_its_connections_once_their_requests_are_answered():
    e = await engine(sim_tokens_per_s=40)
    t = HttpTransport(ServeTransport({0: FakeHandle(e)}), READ_TIMEOUT_S)
    await t.load(0)
    await t.load(0)  # over the port: the connections are open
    replies = t.stream(0, chat(max_tokens=20, stream=True))  # half a second
    assert (await replies.__anext__()).status == 200
    t.close()
    rest = b"".join([item async for item in replies]).decode()
    assert rest.rstrip().endswith("data: [DONE]"), "closing waits for the stream on it"
    for _ in range(40):
        if t._http.closed:
            break
        await asyncio.sleep(0.05)
    assert t._http.closed
    await e.http.stop()


def test_the_setting_chooses_the_transport(monkeypatch):
    class Handle:
        def options(self, **_):
            return self

    try:
        for value, kind in (("1", HttpTransport), ("0", ServeTransport)):
            monkeypatch.setenv("HIVE_ENGINE_HTTP", value)
            get_settings.cache_clear()
            assert type(make_transport({0: Handle()}, HiveSettings())) is kind
    finally:
        get_settings.cache_clear()


async def test_with_engine_http_off_a_replica_set_calls_over_serve_only(monkeypatch):
    monkeypatch.setenv("HIVE_ENGINE_HTTP", "0")
    get_settings.cache_clear()
    try:
        e = await engine(sim_tokens_per_s=5000)
        assert e.endpoint() is None, "the engine opens no port either"
        h = FakeHandle(e)
        rs = ReplicaSet("sim-model", {0: h}, [e.replica], queue_bound=8, **routing())
        start, body = await rs.call(chat(), CHAT)
        items = [item async for item in rs.stream(chat(stream=True))]
        assert start.status == 200 and items[0].status == 200
        assert ("x-hive-replica", "r0") in start.headers and ("x-hive-replica", "r0") in items[0].headers
        assert rs.endpoints == {} and "endpoint" not in h.calls
        assert h.calls["forward_unary"] == 1 and h.calls["forward"] == 1
        rs.close()
    finally:
        get_settings.cache_clear()
