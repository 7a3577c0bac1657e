"""Request ids: one id per request, kept by the Serve proxy, the hive's routers and the engines.

Ray Serve's proxy already takes a client's ``x-request-id`` (or makes one), puts it in the
replica log lines of every deployment the request crosses (handle calls carry it on) and
sends it back in the response. It keeps whatever the client sent, though: a megabyte of
text, or a newline that forges a log line. ``CleanRequestId`` runs in front of Serve's own
middleware in the proxy (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
hive_apps.serving.request_ids.proxy_middlewares``) and replaces an id that is not well formed, so
the id in the logs is the id in the response. The routers pass the id on to the engine in
the same header (vLLM takes it as its own request id), cleaned again in case the proxy ran
without the callback.

Well formed: 1 to 128 characters of ``A-Z a-z 0-9 . _ : -`` (uuids, ULIDs, trace ids, and
``<service>:<n>`` style ids fit; spaces, quotes, control characters and slashes do not).
"""

from __future__ import annotations

import re
import uuid

HEADER = "x-request-id"
_HEADER_B = HEADER.encode()
MAX_LEN = 128
PATTERN = rf"[A-Za-z0-9._:-]{{1,{MAX_LEN}}}"  # a client's own id, as kept (also the edge's HAProxy rule)
_WELL_FORMED = re.compile(PATTERN)


def well_formed(value: str | bytes | None) -> bool:
    if value is None:
        return False
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return False
    return _WELL_FORMED.fullmatch(value) is not None


def new_id() -> str:
    return uuid.uuid4().hex


def ensure(value: str | bytes | None) -> str:
    """The id to use: the given one when well formed, else a new one."""
    if value is not None and well_formed(value):
        return value.decode("ascii") if isinstance(value, bytes) else value
    return new_id()


def of_headers(headers: list[tuple[str, str]] | dict[str, str]) -> str | None:
    """The request id among plain (name, value) headers, if any."""
    items = headers.items() if isinstance(headers, dict) else headers
    return next((v for k, v in items if k.lower() == HEADER), None)


def with_id(headers: list[tuple[str, str]], request_id: str) -> list[tuple[str, str]]:
    """``headers`` with exactly one request id header: this one."""
    return [(k, v) for k, v in headers if k.lower() != HEADER] + [(HEADER, request_id)]


class CleanRequestId:
    """ASGI middleware: a request keeps a well-formed ``x-request-id``; any other is replaced.

    Only one id header survives (a client sending two gets the first, if well formed).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            given = [v for k, v in scope.get("headers", []) if k.lower() == _HEADER_B]
            if given and not (len(given) == 1 and well_formed(given[0])):
                kept = ensure(given[0]).encode()
                scope = dict(scope)
                scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != _HEADER_B] + [(_HEADER_B, kept)]
        await self.app(scope, receive, send)


def proxy_middlewares() -> list:
    """For ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: the Serve proxy applies these outside its own."""
    from starlette.middleware import Middleware

    return [Middleware(CleanRequestId)]
