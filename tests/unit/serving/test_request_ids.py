"""Request ids: kept when well formed, replaced otherwise, passed to the engine, logged without secrets."""

import logging

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from hive_apps.serving import request_ids
from hive_apps.serving.engine.http_server import TOKEN_HEADER
from hive_apps.serving.routing.http import HOP_HEADERS, read_forwarded
from tests.unit.serving.test_engine_http import CHAT, engine


@pytest.mark.parametrize("value, ok", [
    ("7f3c2a9e-1b2c-4d5e-8f90-123456789abc", True), ("trace:42.a_b-c", True), ("x" * 128, True),
    ("", False), ("x" * 129, False), ("has space", False), ("a/b", False), ("line\nforged", False),
    ("é", False), ('quote"', False), (None, False), (b"\xff", False), (b"abc", True),
])
def test_well_formed(value, ok):
    assert request_ids.well_formed(value) is ok
    kept = request_ids.ensure(value)
    assert request_ids.well_formed(kept)
    assert (kept == (value.decode(errors="replace") if isinstance(value, bytes) else value)) is ok


def proxy_app():
    """A Starlette app behind the Serve proxy's own middleware stack, with the hive's callback in front."""
    from ray.serve._private.http_util import _apply_middlewares

    async def echo(request: Request):
        return JSONResponse({"seen": request.headers.getlist("x-request-id")})

    return _apply_middlewares(Starlette(routes=[Route("/", echo)]), request_ids.proxy_middlewares())


@pytest.mark.parametrize("sent, kept", [("client-id:1", True), ("bad id with spaces", False),
                                         ("x" * 500, False), (None, False)])
def test_the_proxy_keeps_a_well_formed_id_and_answers_with_the_id_the_app_saw(sent, kept):
    client = TestClient(proxy_app())
    r = client.get("/", headers={"x-request-id": sent} if sent else {})
    seen = r.json()["seen"]
    assert len(seen) == 1 and r.headers.get_list("x-request-id") == seen
    assert (seen[0] == sent) is kept
    assert request_ids.well_formed(seen[0])


async def test_the_router_forwards_one_clean_id_and_no_credentials():
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"authorization", b"Bearer sk-secret"), (b"x-request-id", b"bad id"),
                         (b"content-type", b"application/json"), (b"cookie", b"s=1")]}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    fwd = await read_forwarded(Request(scope, receive), "/v1/completions")
    names = [k.lower() for k, _ in fwd.headers]
    assert "authorization" not in names and "cookie" not in names
    ids = [v for k, v in fwd.headers if k == "x-request-id"]
    assert len(ids) == 1 and ids[0] != "bad id" and request_ids.well_formed(ids[0])
    assert "x-request-id" in HOP_HEADERS, "the proxy echoes the id; the engine's copy must not duplicate it"


async def test_the_engine_logs_the_request_id_and_never_the_prompt_or_a_key(caplog):
    e = await engine(sim_tokens_per_s=5000)
    prompt = "PROMPT-TEXT-4711 tell me a secret"
    body = {**CHAT, "messages": [{"role": "user", "content": prompt}]}
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as s:
        async with s.post(e.endpoint().url + "/v1/chat/completions?api_key=sk-query", json=body,
                          headers={TOKEN_HEADER: e.endpoint().token, "x-request-id": "rid-77",
                                   "authorization": "Bearer sk-header"}) as r:
            assert r.status == 200
    await e.http.stop()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "request_id=rid-77" in text and " 200 " in text
    for secret in ("PROMPT-TEXT-4711", "sk-query", "sk-header", e.endpoint().token):
        assert secret not in text
