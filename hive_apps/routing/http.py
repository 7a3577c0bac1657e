"""Turn a Starlette request into a ``ForwardedRequest`` and an engine's reply stream back into a response."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from hive_apps import request_ids
from hive_apps.engine.protocol import ForwardedRequest, ResponseStart
from hive_apps.openai_errors import openai_error, sse_error
from hive_apps.registry.records import DORMANT, SERVING, ModelRecord
from hive_apps.routing.hold import HoldRefused, WakeHold, gone_message, held_stream

if TYPE_CHECKING:
    from hive_apps.routing.replica_set import ReplicaSet

log = logging.getLogger("ray.serve")

MAX_BODY_BYTES = 64 * 1024 * 1024
# Never authorization (the engine's port has its own token) nor any other credential.
PASSED_HEADERS = {"content-type", "accept"}
# Set again by whoever sends the response on; passing them on would duplicate them (the Serve
# proxy sends the request's x-request-id back itself).
HOP_HEADERS = {"content-length", "content-type", "transfer-encoding", "connection", "keep-alive", "date", "server",
               request_ids.HEADER}


class BodyTooLarge(Exception):
    pass


async def read_forwarded(request: Request, path: str) -> ForwardedRequest:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge()
        chunks.append(chunk)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() in PASSED_HEADERS]
    # the proxy's id (hive_apps/request_ids.py), cleaned again in case it ran without the hive's callback
    headers.append((request_ids.HEADER, request_ids.ensure(request.headers.get(request_ids.HEADER))))
    return ForwardedRequest(method=request.method, path=path, query=request.url.query, headers=headers, body=b"".join(chunks))


class BodyFields(NamedTuple):
    model: str | None  # the OpenAI ``model`` field, if the body is JSON and has one
    stream: bool  # the body asks for a streamed (SSE) answer
    body: dict[str, Any] | None  # the parsed body, when it is a JSON object (for splitting)


def body_fields(req: ForwardedRequest) -> BodyFields:
    """What routing needs from an OpenAI body, parsed once per request."""
    if not req.body:
        return BodyFields(None, False, None)
    try:
        body = json.loads(req.body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's limit
        return BodyFields(None, False, None)
    if not isinstance(body, dict):
        return BodyFields(None, False, None)
    model = body.get("model")
    return BodyFields(model if isinstance(model, str) else None, body.get("stream") is True, body)


async def respond(replicas: "ReplicaSet", req: ForwardedRequest, fields: BodyFields) -> Response:
    """Answer through a model's replicas: a unary call, or a stream when the body asks for one."""
    if fields.stream:
        return await to_response(replicas.stream(req))
    start, body = await replicas.call(req, fields.body)
    return Response(body, status_code=start.status, headers=_passed_headers(start), media_type=start.content_type)


async def respond_for(rec: ModelRecord, replicas_of: Callable[[ModelRecord], "ReplicaSet"], hold: WakeHold,
                      req: ForwardedRequest, fields: BodyFields) -> Response:
    """Answer for a model in any state: served now, held while it wakes, or refused with why."""
    if rec.status in SERVING:
        return await respond(replicas_of(rec), req, fields)
    gone = gone_message(rec, rec.model_id)
    if gone or rec.status not in DORMANT:
        return openai_error(404, gone or f"The model `{rec.model_id}` is {rec.status.value} and not ready yet.", "model")
    if fields.stream:
        return await held_stream(hold, rec.model_id, hold.settings.hold_keepalive_s,
                                 lambda woke: replicas_of(woke).stream(req))
    try:
        woke = await hold.wait(rec.model_id)
    except HoldRefused as e:
        return e.response
    return await respond(replicas_of(woke), req, fields)


def _passed_headers(start: ResponseStart) -> dict[str, str]:
    return {k: v for k, v in start.headers if k.lower() not in HOP_HEADERS}


async def to_response(rest: AsyncIterator[bytes | ResponseStart]) -> Response:
    """Answer with an engine's reply: its ``ResponseStart``, then the body as it streams in.

    A stream broken midway ends with an SSE error event.
    """
    start = await rest.__anext__()
    is_sse = start.content_type.startswith("text/event-stream")

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in rest:
                if isinstance(chunk, bytes):
                    yield chunk
        except Exception as e:  # the replica died mid-stream
            log.warning("stream broken: %s", e)
            if is_sse:
                yield sse_error(503, f"the model replica failed mid-stream: {type(e).__name__}")

    return StreamingResponse(body(), status_code=start.status, media_type=start.content_type, headers=_passed_headers(start))


def too_large() -> Response:
    return openai_error(413, f"request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
