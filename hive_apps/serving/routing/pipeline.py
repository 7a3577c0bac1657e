"""The one request pipeline of the hive's OpenAI entries: the gateway at ``/v1`` (every model) and
each model's router at ``/<model_id>`` (its own model).

auth -> (answers of the entry's own: model objects, unknown routes) -> body -> checks -> route ->
hold / forward, and one ``hive_requests`` count per answer. An entry says only what differs: the
path it sees, what it answers without an engine, and which model record a request goes to.
CORS (``HIVE_CORS_ORIGINS``, off when unset) wraps the whole pipeline: preflights are answered
before auth (browsers send them without credentials), and every answer to a listed origin says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from hive_apps.core.auth import check_api_key
from hive_apps.core.openai_errors import openai_error
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import ModelRecord
from hive_apps.ops import metrics
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.routing.hold import WakeHold, client_of
from hive_apps.serving.routing.http import (
    BodyFields,
    BodyTooLarge,
    parse_fields,
    read_forwarded,
    request_problem,
    respond_for,
    too_large,
)
from hive_apps.serving.routing.paths import engine_route, missing_model

if TYPE_CHECKING:
    from hive_apps.serving.routing.replica_set import ReplicaSet


class OpenAIEntry:
    """Subclasses set ``entry``, ``settings``, ``publisher``, ``hold`` and ``replicas_of`` and answer ``route``."""

    entry: str  # "gateway" | "router": the tag of its requests' metrics
    requires_model: bool = False  # a body without a 'model' field is a 400 before anything else is checked
    settings: HiveSettings
    publisher: metrics.Publisher  # ``hive_requests``, and what the hold and replica sets count
    hold: WakeHold
    replicas_of: Callable[[ModelRecord], ReplicaSet]

    async def answer(self, request: Request) -> Response:
        early = preflight(self.settings.cors_origins, request)
        if early is not None:
            return early
        response = await self._pipeline(request)
        self.publisher.count("hive_requests", model=self.model_tag(request), entry=self.entry,
                                  code=str(response.status_code))
        if self.settings.cors_origins:  # answers differ by origin: caches keep them apart
            response.headers.update(cors_headers(self.settings.cors_origins, request))
            response.headers.add_vary_header("Origin")
        return response

    async def _pipeline(self, request: Request) -> Response:
        reason = check_api_key(self.settings, request.headers.get("authorization"))
        if reason:
            return openai_error(401, reason)
        path = self.path_of(request)
        early = await self.before_body(request, path)
        if early is not None:
            return early
        try:  # the vLLM route the path names (GET /v1/models on a model's route: its engine's list)
            req = await read_forwarded(request, engine_route(request.method, path) or path)
        except BodyTooLarge:
            return too_large()
        fields = await parse_fields(req)
        if self.requires_model and fields.model is None:
            return openai_error(400, missing_model(request.method, path), "model")
        if request.method == "POST":
            problem = await request_problem(req.path, req, fields, self.settings.media_hosts)
            if problem is not None:
                return openai_error(400, *problem)
        target = await self.route(request, req, fields)
        if isinstance(target, Response):
            return target
        return await respond_for(target, self.replicas_of, self.hold, req, fields,
                                 client_of(request.headers.get("authorization")))

    # --- what an entry says for itself ------------------------------------------------------
    def path_of(self, request: Request) -> str:
        """The path an engine sees (an entry mounted under a prefix cuts it)."""
        return request.url.path

    def model_tag(self, request: Request) -> str:
        """The ``model`` tag of the request's count: only a model the hive serves, never a client's made-up name."""
        return getattr(request.state, "model", "")

    async def before_body(self, request: Request, path: str) -> Response | None:
        """An answer that needs no body and no engine (model objects, routes the hive does not serve), or None."""
        return None

    async def route(self, request: Request, req: ForwardedRequest, fields: BodyFields) -> ModelRecord | Response:
        """The record of the model the request goes to (then served, held while it wakes, or refused
        with why), or an answer of the entry's own."""
        raise NotImplementedError


CORS_EXPOSED = "x-hive-replica, x-request-id, retry-after"
"""Answer headers a browser client may read besides the safelisted ones."""


def _cors_origin(origins: list[str], request: Request) -> str | None:
    origin = request.headers.get("origin")
    if not origins or not origin:
        return None
    return origin if "*" in origins or origin.rstrip("/").lower() in origins else None


def preflight(origins: list[str], request: Request) -> Response | None:
    """The answer to a CORS preflight when CORS is on (None otherwise: the request goes on as any other).
    Requested headers are allowed as asked: the API key is a header, not a cookie, and is checked anyway."""
    if not origins or request.method != "OPTIONS" or "access-control-request-method" not in request.headers:
        return None
    origin = _cors_origin(origins, request)
    if origin is None:
        return openai_error(403, f"origin {request.headers.get('origin')!r} is not in HIVE_CORS_ORIGINS")
    return Response(status_code=204, headers={
        "access-control-allow-origin": origin, "vary": "Origin", "access-control-allow-methods": "GET, POST",
        "access-control-allow-headers": request.headers.get("access-control-request-headers", "authorization, content-type"),
        "access-control-max-age": "600"})


def cors_headers(origins: list[str], request: Request) -> dict[str, str]:
    """What every answer to a listed origin carries (errors too, so a browser client can read them)."""
    origin = _cors_origin(origins, request)
    if origin is None:
        return {}
    return {"access-control-allow-origin": origin, "access-control-expose-headers": CORS_EXPOSED}


async def asgi(entry: OpenAIEntry, scope, receive, send) -> None:
    """Serve an entry as a plain ASGI app (tests drive it with ``httpx.ASGITransport``)."""
    if scope["type"] == "lifespan":  # nothing to start or stop: the registry follower starts with the app
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    response = await entry.answer(Request(scope, receive))
    await response(scope, receive, send)
