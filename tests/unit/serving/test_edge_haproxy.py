"""The edge's HAProxy and Lua, run for real (the binary Serve uses) between an httpx client and
aiohttp stand-ins for the gateway's decision port, an engine port and Serve's ingress."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from aiohttp import web

from hive_apps.serving.edge.config import BUFSIZE, EdgeConfig
from hive_apps.serving.edge.process import EdgeProcess, EdgeUnavailable, haproxy_binary

try:
    haproxy_binary()
except EdgeUnavailable:  # pragma: no cover - ray[serve] on Linux brings one
    pytest.skip("no haproxy binary", allow_module_level=True)

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stage:
    """The three servers behind the edge, recording what reached each."""

    def __init__(self):
        self.decisions: list[dict] = []
        self.engine_seen: list[dict] = []
        self.serve_seen: list[str] = []
        self.route = True  # the decision names the engine (else: not mine)
        self.engine_left = asyncio.Event()
        self.chunks = 3
        self.chunk_gap_s = 0.0

    async def decide(self, request: web.Request) -> web.Response:
        self.decisions.append({"headers": {k.lower(): v for k, v in request.headers.items()}, "body": await request.read()})
        if not self.route:
            return web.Response(status=204)
        return web.Response(status=200, headers={
            "x-hive-dst": "127.0.0.1", "x-hive-dst-port": str(self.engine_port), "x-hive-dst-token": "tok",
            "x-hive-dst-path": "/v1/chat/completions", "x-hive-replica": "r1", "x-hive-route": "least-loaded"})

    async def engine(self, request: web.Request) -> web.StreamResponse:
        self.engine_seen.append({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()}, "body": await request.read()})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(self.chunk_gap_s)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.engine_left.set()
            raise
        return resp

    async def serve(self, request: web.Request) -> web.Response:
        self.serve_seen.append(request.path)
        return web.json_response({"answered_by": "serve"})


async def _site(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture
async def edge():
    stage = Stage()
    ports = {name: free_port() for name in ("decide", "engine", "serve", "edge")}
    stage.engine_port = ports["engine"]
    runners = []
    for name, handler, path in (("decide", stage.decide, "/hive/route"), ("engine", stage.engine, "/{tail:.*}"),
                                ("serve", stage.serve, "/{tail:.*}")):
        app = web.Application()
        app.router.add_route("*", path, handler)
        runners.append(await _site(app, ports[name]))
    proc = EdgeProcess(EdgeConfig(port=ports["edge"], serve_addr=f"127.0.0.1:{ports['serve']}",
                                  read_timeout_s=30), ports["decide"], "tok")
    proc.spawn()
    await asyncio.to_thread(proc.wait_listening)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['edge']}", timeout=10) as client:
        yield stage, client, proc
    proc.stop()
    for r in runners:
        await r.cleanup()


async def test_a_routed_request_reaches_the_engine_port_without_client_secrets(edge):
    stage, client, _ = edge
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={
        "authorization": "Bearer client-key", "cookie": "s=1", "x-hive-engine-token": "forged",
        "x-hive-adapter": "forged", "x-request-id": "abc-123"})
    assert resp.status_code == 200
    assert resp.text == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert resp.headers["x-hive-replica"] == "r1" and resp.headers["x-hive-route"] == "least-loaded"
    assert resp.headers["x-hive-edge"] == "1"
    assert resp.headers["x-request-id"] == "abc-123"
    decision = stage.decisions[0]
    assert decision["headers"]["authorization"] == "Bearer client-key"  # the gateway checks the key
    assert decision["headers"]["x-hive-edge-token"] == "tok"
    assert decision["headers"]["x-hive-path"] == "/v1/chat/completions"
    assert json.loads(decision["body"]) == CHAT
    seen = stage.engine_seen[0]
    assert json.loads(seen["body"]) == CHAT
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["x-hive-engine-token"] == "tok"  # the decision's, never the client's
    assert headers["x-request-id"] == "abc-123"
    for secret in ("authorization", "cookie", "x-hive-adapter"):
        assert secret not in headers
    assert stage.serve_seen == []


async def test_the_per_model_route_is_rewritten_to_the_engine_path(edge):
    stage, client, _ = edge
    resp = await client.post("/m/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    assert stage.decisions[0]["headers"]["x-hive-path"] == "/m/v1/chat/completions"
    assert stage.engine_seen[0]["path"] == "/v1/chat/completions"
    assert stage.engine_seen[0]["headers"]["x-request-id"]  # HAProxy's own id when the client sent none


@pytest.mark.parametrize("case", ["declined", "admin", "not json", "too large", "bad request id"])
async def test_what_the_edge_does_not_route_goes_to_serve_unchanged(edge, case):
    stage, client, _ = edge
    stage.route = case != "declined"
    if case == "admin":
        resp = await client.get("/admin/models")
    elif case == "not json":
        resp = await client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")})
    elif case == "too large":
        resp = await client.post("/v1/chat/completions", json={**CHAT, "pad": "x" * BUFSIZE})
    else:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers={"x-request-id": "bad id!"})
    if case == "bad request id":  # routed, with HAProxy's id in place of the malformed one
        assert resp.status_code == 200 and stage.engine_seen[0]["headers"]["x-request-id"] != "bad id!"
        assert resp.headers["x-request-id"] == stage.engine_seen[0]["headers"]["x-request-id"]
        return
    assert resp.json() == {"answered_by": "serve"} and "x-hive-edge" not in resp.headers
    assert stage.engine_seen == []
    assert len(stage.decisions) == (1 if case == "declined" else 0)


async def test_a_client_that_leaves_mid_stream_closes_the_engine_connection(edge):
    stage, client, _ = edge
    stage.chunks, stage.chunk_gap_s = 1000, 0.02
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        async for _ in resp.aiter_bytes():
            break  # first chunk, then gone
    await asyncio.wait_for(stage.engine_left.wait(), 5)


async def test_chunks_arrive_as_the_engine_sends_them(edge):
    stage, client, _ = edge
    stage.chunks, stage.chunk_gap_s = 3, 0.3
    loop = asyncio.get_running_loop()
    arrivals = []
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        async for _ in resp.aiter_raw():
            arrivals.append(loop.time())
    assert len(arrivals) >= 3 and arrivals[-1] - arrivals[0] >= 0.5  # streamed, not buffered whole


def test_the_edge_dies_with_the_process_that_started_it():
    """A killed gateway replica leaves no HAProxy behind answering for it (PR_SET_PDEATHSIG)."""
    script = (
        "import sys, time\n"
        "from hive_apps.serving.edge.config import EdgeConfig\n"
        "from hive_apps.serving.edge.process import EdgeProcess\n"
        f"p = EdgeProcess(EdgeConfig(port={free_port()}, serve_addr='127.0.0.1:1', read_timeout_s=5), 1, 't')\n"
        "p.spawn(); p.wait_listening(); print(p.proc.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    haproxy = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{haproxy}")
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{haproxy}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{haproxy}"), "haproxy outlived its parent"


async def test_a_config_haproxy_refuses_is_reported():
    bad = EdgeProcess(EdgeConfig(port=free_port(), serve_addr="not-an-address", read_timeout_s=30), 1, "tok")
    bad.spawn()
    with pytest.raises(EdgeUnavailable, match="haproxy exited"):
        await asyncio.to_thread(bad.wait_listening)


async def test_an_engine_gone_since_the_last_poll_is_a_503_the_client_retries(edge):
    stage, client, _ = edge
    stage.engine_port = free_port()  # nothing listens there any more
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == 503 and "retry" in resp.json()["error"]["message"]


async def test_a_soft_stop_finishes_the_answer_in_flight_and_takes_no_new_connection(edge):
    stage, client, proc = edge
    stage.chunks, stage.chunk_gap_s = 8, 0.1
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        stopping = asyncio.create_task(asyncio.to_thread(proc.stop, 10.0))
        await asyncio.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no longer listening
            await httpx.AsyncClient().post(str(client.base_url) + "/v1/chat/completions", json=CHAT)
        text = b"".join([chunk async for chunk in resp.aiter_raw()]).decode()
    assert text.endswith("data: [DONE]\n\n") and text.count("data: ") == 9  # every chunk, to the end
    t0 = asyncio.get_running_loop().time()
    await stopping
    assert proc.proc.returncode is not None
    assert asyncio.get_running_loop().time() - t0 < 3  # idle keep-alive connections closed, not waited out
