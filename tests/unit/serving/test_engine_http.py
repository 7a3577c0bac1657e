"""The short path: engines serve their own token-guarded port and a ReplicaSet routes over it."""

import asyncio
import json

import aiohttp

from hive_apps.serving.engine.http_server import TOKEN_HEADER, EngineEndpoint
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.engine.sim_engine import SimEngine
from hive_apps.serving.routing.liveness import is_live
from hive_apps.serving.routing.replica_set import ReplicaSet
from tests.unit.helpers import replica_plan, routing

CHAT = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


async def engine(index: int = 0, **kw) -> SimEngine:
    e = SimEngine.__new__(SimEngine)
    await e.__init__("sim-model", "", replica_plan(**kw).model_copy(update={"index": index}), use_start_lock=False)
    return e


class Call:
    """Stands in for a Serve handle method: ``.remote(...)`` runs the engine's method in-process."""

    def __init__(self, fn, counter: dict, name: str):
        self.fn, self.counter, self.name = fn, counter, name

    def remote(self, *args):
        self.counter[self.name] = self.counter.get(self.name, 0) + 1
        result = self.fn(*args)
        if asyncio.iscoroutine(result) or hasattr(result, "__anext__"):
            return result
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class FakeHandle:
    def __init__(self, e: SimEngine):
        self.calls: dict[str, int] = {}
        for name in ("load", "endpoint", "forward", "forward_unary", "prefix_keys"):
            setattr(self, name, Call(getattr(e, name), self.calls, name))

    def options(self, **_):
        return self


async def test_engine_port_answers_only_with_the_replica_token():
    e = await engine(sim_tokens_per_s=5000)
    url = e.endpoint().url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=CHAT) as r:
            assert r.status == 403
        async with s.post(url, json=CHAT, headers={TOKEN_HEADER: "guess"}) as r:
            assert r.status == 403
        async with s.post(url, json=CHAT, headers={TOKEN_HEADER: e.endpoint().token}) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 2
    assert e.in_flight == 0


async def test_replica_set_routes_over_http_and_fails_over_when_a_port_dies():
    engines = [await engine(i, max_num_seqs=4, sim_tokens_per_s=20) for i in range(2)]
    handles = {i: FakeHandle(e) for i, e in enumerate(engines)}
    rs = ReplicaSet("sim-model", handles, [e.replica for e in engines], queue_bound=8, **routing())
    rs.start()
    for _ in range(100):
        if all(rs.endpoints.values()):
            break
        await asyncio.sleep(0.05)
    assert all(rs.endpoints.values()), "the load poll learns every replica's port"

    slow = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                            body=json.dumps({**CHAT, "max_tokens": 40}).encode())  # 2 s each
    calls = [asyncio.create_task(rs.call(slow, json.loads(slow.body))) for _ in range(2)]
    for _ in range(30):
        if [e.in_flight for e in engines] == [1, 1]:
            break
        await asyncio.sleep(0.05)
    assert [e.in_flight for e in engines] == [1, 1], "two requests spread over two idle replicas"
    assert [s.status for s, _ in await asyncio.gather(*calls)] == [200, 200]
    assert all(h.calls.get("forward_unary", 0) == 0 for h in handles.values()), "the HTTP path, not the handle"

    rs._poller.cancel()  # no poll between here and the call: r0 still looks healthy with its old port
    for view in rs.views.values():  # both idle, as the engines are now: the tie goes to r0
        view.engine_running = view.engine_waiting = 0
    await engines[0].http.stop()
    quick = slow.model_copy(update={"body": json.dumps(CHAT).encode()})
    start, body = await rs.call(quick, json.loads(quick.body))
    assert start.status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    assert ("x-hive-replica", "r1") in start.headers, "r0 (the tie-break pick) refused; r1 answered"
    assert rs.endpoints[0] is None and not rs.views[0].healthy, "a refused port is forgotten until the next poll"
    rs.close()
    await asyncio.sleep(0)


async def test_load_is_polled_over_the_port_once_it_is_known():
    e = await engine(sim_tokens_per_s=5000)
    h = FakeHandle(e)
    rs = ReplicaSet("sim-model", {0: h}, [e.replica], queue_bound=8, **routing())
    rs.start()
    await asyncio.sleep(1.2)  # about five polls
    rs.close()
    await asyncio.sleep(0)
    # about five polls; all but the first (or a retry after a slow moment) went over the port
    assert h.calls["endpoint"] <= 2 and h.calls["load"] <= 2, h.calls
    assert rs.views[0].healthy


async def test_a_late_load_answer_keeps_the_port_once_then_serve_is_asked_where_the_replica_is():
    """A busy engine answers its load poll late now and then (a long prefill on few cores): its port
    is kept through one late poll (forgetting it sent requests the slow way, and the edge declined
    them); late twice in a row, Serve is asked again, as the replica may have moved."""

    async def silent(reader, writer):  # takes the poll, never answers
        await reader.read(65536)
        await asyncio.sleep(30)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        e = await engine(sim_tokens_per_s=5000)
        h = FakeHandle(e)
        rs = ReplicaSet("sim-model", {0: h}, [e.replica], queue_bound=8, **routing())
        hung = EngineEndpoint(url=f"http://127.0.0.1:{port}", token="t")
        rs.endpoints[0] = hung
        await rs._refresh()
        assert rs.endpoints[0] == hung and is_live(rs.views[0]), "one late answer: still live, same port"
        assert h.calls.get("endpoint", 0) == 0
        await rs._refresh()
        assert h.calls.get("endpoint") == 1, "late twice: Serve is asked where the replica is"
        assert rs.endpoints[0] == e.endpoint() and is_live(rs.views[0])
        await rs._refresh()
        assert h.calls.get("endpoint") == 1 and h.calls.get("load", 0) == 1, "then polled over its port again"
        rs.close()
        await e.http.stop()
    finally:
        server.close()


async def test_streams_over_the_port_and_release_their_queued_tokens():
    from hive_apps.serving.engine.protocol import ResponseStart

    e = await engine(sim_tokens_per_s=200)
    rs = ReplicaSet("sim-model", {0: FakeHandle(e)}, [e.replica], queue_bound=8, **routing())
    rs.start()
    for _ in range(100):
        if rs.endpoints[0]:
            break
        await asyncio.sleep(0.05)
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                           body=json.dumps({**CHAT, "max_tokens": 4, "stream": True}).encode())
    items, queued_while_waiting = [], None
    async for item in rs.stream(req):
        if not items:
            queued_while_waiting = rs.views[0].queued_tokens
        items.append(item)
    start, body = items[0], b"".join(items[1:]).decode()
    assert isinstance(start, ResponseStart) and ("x-hive-replica", "r0") in start.headers
    assert body.rstrip().endswith("data: [DONE]") and body.count("data: ") == 4 + 1 + 1
    assert queued_while_waiting == len(req.body) // 4 and rs.views[0].queued_tokens == 0
    assert rs.views[0].in_flight == 0
    rs.close()
    await asyncio.sleep(0)


async def test_a_hung_engine_fails_the_request_instead_of_holding_it(monkeypatch):
    from hive_apps.core.settings import get_settings

    async def silent(reader, writer):  # reads the request, never answers
        await reader.read(65536)
        await asyncio.sleep(30)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HIVE_ENGINE_READ_TIMEOUT_S", "0.5")
    get_settings.cache_clear()
    try:
        e = await engine(sim_tokens_per_s=5000)
        rs = ReplicaSet("sim-model", {0: FakeHandle(e)}, [e.replica], queue_bound=8, **routing())
        rs.endpoints[0] = EngineEndpoint(url=f"http://127.0.0.1:{port}", token="t")
        req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                               body=json.dumps(CHAT).encode())
        t0 = asyncio.get_running_loop().time()
        start, body = await asyncio.wait_for(rs.call(req, CHAT), 10)
        assert asyncio.get_running_loop().time() - t0 < 5
        assert start.status == 504 and b"does not answer its load probe" in body, body
        assert e.requests_total == 0, "a hung engine's request is not run again on another replica"
        rs.close()
    finally:
        server.close()
        get_settings.cache_clear()


async def test_a_non_streaming_answer_longer_than_the_idle_limit_is_waited_for_and_runs_once(monkeypatch):
    """A unary answer comes whole at the end of its generation: an idle limit on it failed every
    generation longer than HIVE_ENGINE_READ_TIMEOUT_S and ran it again on another replica."""
    from hive_apps.core.settings import get_settings

    monkeypatch.setenv("HIVE_ENGINE_READ_TIMEOUT_S", "0.5")
    get_settings.cache_clear()
    try:
        slow, other = await engine(0, sim_tokens_per_s=10), await engine(1, sim_tokens_per_s=10)
        rs = ReplicaSet("sim-model", {0: FakeHandle(slow), 1: FakeHandle(other)}, [slow.replica, other.replica],
                        queue_bound=8, **routing())
        rs.endpoints = {0: slow.endpoint(), 1: other.endpoint()}
        body = {**CHAT, "max_tokens": 20}  # 2 s of generation: four idle limits
        req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                               body=json.dumps(body).encode())
        before = slow.requests_total + other.requests_total
        start, answer = await asyncio.wait_for(rs.call(req, body), 20)
        assert start.status == 200, answer
        assert json.loads(answer)["usage"]["completion_tokens"] == 20
        assert slow.requests_total + other.requests_total - before == 1, "it ran once"
        assert all(v.healthy for v in rs.views.values())
        rs.close()
        for e in (slow, other):
            await e.http.stop()
    finally:
        get_settings.cache_clear()


async def test_the_engine_port_listens_on_the_nodes_address_only():
    import socket
    from urllib.parse import urlparse

    e = await engine(sim_tokens_per_s=5000)
    url = urlparse(e.endpoint().url)
    bound = e.http.server.servers[0].sockets[0].getsockname()
    assert bound[0] == url.hostname and bound[0] != "0.0.0.0"
    assert e.http.server.config.limit_concurrency is not None
    if url.hostname != "127.0.0.1":  # loopback is another interface: nothing listens there
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", url.port)) != 0
    await e.http.stop()


async def test_an_idle_replica_set_polls_rarely_and_at_once_when_a_request_comes(monkeypatch):
    from hive_apps.serving.routing import liveness

    monkeypatch.setattr(liveness, "IDLE_AFTER_S", 0.3)
    e = await engine(sim_tokens_per_s=5000)
    rs = ReplicaSet("sim-model", {0: FakeHandle(e)}, [e.replica], queue_bound=8, **routing())
    polls = []
    poll_one = rs._poll_one

    async def counted(i):
        polls.append(asyncio.get_running_loop().time())
        return await poll_one(i)

    rs._poll_one = counted
    rs.start()
    await asyncio.sleep(0.8)  # idle since the start: fast polls for 0.3 s, then every 2 s
    idle_from = len(polls)
    await asyncio.sleep(1.5)
    assert len(polls) - idle_from <= 1, "idle: at most one poll in 1.5 s (every 250 ms would be six)"
    before = len(polls)
    start, _ = await rs.call(ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                                              body=json.dumps(CHAT).encode()), CHAT)
    assert start.status == 200
    await asyncio.sleep(0.1)
    assert len(polls) > before, "a request wakes the poller at once"
    woke = len(polls)
    await asyncio.sleep(0.2 + liveness.LOAD_POLL_S)
    assert len(polls) > woke, "used recently: back to every 250 ms"
    rs.close()
    await asyncio.sleep(0)


async def test_a_replica_that_came_up_after_the_last_poll_is_asked_again_not_refused():
    e = await engine(sim_tokens_per_s=5000)
    rs = ReplicaSet("sim-model", {0: FakeHandle(e)}, [e.replica], queue_bound=8, **routing())
    rs.views[0].healthy = False  # the last poll ran while the engine was still starting
    start, body = await rs.call(ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                                                 body=json.dumps(CHAT).encode()), CHAT)
    assert start.status == 200, body
    assert rs.views[0].healthy
    rs.close()
    await asyncio.sleep(0)


async def test_requests_arriving_together_while_no_replica_looks_healthy_still_meet_the_queue_bound():
    e = await engine(max_num_seqs=1, sim_tokens_per_s=20)
    rs = ReplicaSet("sim-model", {0: FakeHandle(e)}, [e.replica], queue_bound=1, **routing())
    rs.views[0].healthy = False  # the last poll ran while the engine was still starting
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                           body=json.dumps({**CHAT, "max_tokens": 10}).encode())
    replies = await asyncio.gather(*(rs.call(req, CHAT) for _ in range(6)))
    codes = sorted(start.status for start, _ in replies)
    assert codes.count(429) >= 3 and codes.count(200) >= 1, codes  # one running, one queued, the rest refused
    rs.close()
    await asyncio.sleep(0)


async def test_starting_the_engine_port_leaves_the_replicas_log_handlers_open(tmp_path):
    """Serve writes a replica's log file through a MemoryHandler on the "ray.serve" logger; uvicorn's
    default logging set-up (dictConfig) closes every handler in the process, and the engine
    replica's log file went silent from its HTTP server's start on."""
    import logging
    import logging.handlers

    file_handler = logging.FileHandler(tmp_path / "replica.log")
    handler = logging.handlers.MemoryHandler(1, target=file_handler)
    serve_log = logging.getLogger("ray.serve")
    serve_log.addHandler(handler)
    try:
        e = await engine(sim_tokens_per_s=5000)
        serve_log.warning("after the engine port opened")
        await e.http.stop()
    finally:
        serve_log.removeHandler(handler)
        file_handler.close()
    assert handler.target is file_handler
    assert "after the engine port opened" in (tmp_path / "replica.log").read_text()


async def _read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when; fails if it stays open."""
    loop = asyncio.get_running_loop()
    t0, data = loop.time(), b""
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=limit_s - (loop.time() - t0))
        except (ConnectionResetError, BrokenPipeError):
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"still open after {limit_s}s; got {data[:80]!r}") from None
        if not chunk:
            return data, loop.time() - t0
        data += chunk


async def _raw(e: SimEngine) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    from urllib.parse import urlparse

    url = urlparse(e.endpoint().url)
    return await asyncio.open_connection(url.hostname, url.port)


def _head(e: SimEngine, path: str = "/hive/load", extra: bytes = b"", method: str = "GET") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nhost: x\r\n{TOKEN_HEADER}: {e.endpoint().token}\r\n").encode() + extra + b"\r\n"


async def test_the_engine_port_refuses_a_header_flood_with_431():
    """httptools ignores h11_max_incomplete_event_size: 24 MB of headers were read and kept."""
    e = await engine(sim_tokens_per_s=5000)
    flood = b"".join(b"x-flood-%d: %s\r\n" % (i, b"a" * 1000) for i in range(64))  # 64 KiB
    reader, writer = await _raw(e)
    writer.write(_head(e, extra=flood))  # a whole head, too large
    data, _ = await _read_until_closed(reader, 5)
    assert data.startswith(b"HTTP/1.1 431 "), data[:80]
    reader, writer = await _raw(e)
    writer.write(_head(e)[:-2] + b"x-endless: ")
    for _ in range(64):  # one header that never ends: llhttp never hands it to a callback
        writer.write(b"a" * 1024)
        await writer.drain()
    data, _ = await _read_until_closed(reader, 5)
    assert data.startswith(b"HTTP/1.1 431 "), data[:80]
    await e.http.stop()


async def test_the_engine_port_closes_unfinished_heads_idle_connections_and_slow_bodies(monkeypatch):
    """2,048 connections that sent nothing (or half a request) held every slot of the port's
    connection limit, and its 503 then answered everyone, the hive's own requests included."""
    from hive_apps.serving.engine import http_server

    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_server, "BODY_TIMEOUT_S", 0.5)
    e = await engine(sim_tokens_per_s=5000)
    idle = await _raw(e)
    half = await _raw(e)
    half[1].write(b"GET /hive/lo")
    trickle = await _raw(e)
    trickle[1].write(b"GET /hive/load HTTP/1.1\r\n")
    slow_body = await _raw(e)
    slow_body[1].write(_head(e, "/v1/chat/completions", b"content-type: application/json\r\ncontent-length: 100\r\n", "POST") + b"{")
    for _ in range(3):  # a header line every 0.3 s: never idle for long, never done
        await asyncio.sleep(0.3)
        trickle[1].write(b"x-slow: 1\r\n")
    for name, (reader, _) in {"idle": idle, "half": half, "trickle": trickle, "slow body": slow_body}.items():
        data, _ = await _read_until_closed(reader, 3)
        assert b"200" not in data, (name, data)

    reader, writer = await _raw(e)  # a well-behaved client keeps its connection across requests
    for _ in range(2):
        writer.write(_head(e))
        assert (await reader.readline()).startswith(b"HTTP/1.1 200"), "a request with the token is answered"
        await reader.readuntil(b"\r\n0\r\n\r\n")  # the rest of the (chunked) answer
        await asyncio.sleep(0.8)  # idle between requests: uvicorn's keep-alive (75 s), not the head timer
    writer.close()
    await e.http.stop()


async def test_the_router_fails_over_when_an_engine_port_is_at_its_connection_limit(monkeypatch):
    """uvicorn's own 503 at limit_concurrency was passed on to the client as the model's answer."""
    from hive_apps.serving.engine import http_server

    monkeypatch.setattr(http_server, "MAX_CONNECTIONS", 1)
    full = await engine(0, sim_tokens_per_s=5000)
    monkeypatch.undo()
    free = await engine(1, sim_tokens_per_s=5000)
    rs = ReplicaSet("sim-model", {0: FakeHandle(full), 1: FakeHandle(free)}, [full.replica, free.replica], queue_bound=8, **routing())
    rs.endpoints.update({0: full.endpoint(), 1: free.endpoint()})
    holder = await _raw(full)  # takes r0's only slot
    await asyncio.sleep(0.05)
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                           body=json.dumps(CHAT).encode())
    start, body = await rs.call(req, CHAT)  # both idle: the tie goes to r0
    assert start.status == 200 and ("x-hive-replica", "r1") in start.headers, (start, body)
    assert rs.endpoints[0] is not None, "a full port is still the replica's port"
    rs.views[0].healthy = True
    items = [item async for item in rs.stream(req.model_copy(update={"body": json.dumps({**CHAT, "stream": True}).encode()}))]
    assert items[0].status == 200 and ("x-hive-replica", "r1") in items[0].headers
    holder[1].close()
    rs.close()
    await asyncio.gather(full.http.stop(), free.http.stop())
