"""Turn a Starlette request into a ``ForwardedRequest`` and an engine's reply stream back into a response."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from hive_apps.core.openai_errors import openai_error, sse_error
from hive_apps.core.state.records import DORMANT, SERVING, ModelRecord
from hive_apps.serving import request_ids
from hive_apps.serving.engine.protocol import ForwardedRequest, ResponseStart
from hive_apps.serving.routing.hold import HoldRefused, WakeHold, gone_message, held_stream
from hive_apps.serving.routing.media import remote_media_problem
from hive_apps.serving.routing.paths import RESPONSES_ROUTE, body_problem

if TYPE_CHECKING:
    from hive_apps.serving.routing.replica_set import ReplicaSet

log = logging.getLogger("ray.serve")

MAX_BODY_BYTES = 16 * 2**20
"""The largest OpenAI request body the gateway and the routers take (413 above it). A body is held
whole and parsed once: 16 MiB fits a long context, many prompts or a few inline images, and bounds
what one request costs the router's memory and CPU (the engines' cores)."""
PARSE_OFF_LOOP_BYTES = 2**20
"""Bodies above this are parsed and checked in a worker thread: parsing megabytes of JSON on the
event loop would stall every other request of the replica meanwhile."""
# Never authorization (the engine's port has its own token) nor any other credential.
PASSED_HEADERS = {"content-type", "accept"}
# Set again by whoever sends the response on; passing them on would duplicate them (the Serve
# proxy sends the request's x-request-id back itself).
HOP_HEADERS = {"content-length", "content-type", "transfer-encoding", "connection", "keep-alive", "date", "server",
               request_ids.HEADER}


class BodyTooLarge(Exception):
    pass


async def read_forwarded(request: Request, path: str) -> ForwardedRequest:
    """The request as it goes on to an engine. Raises ``BodyTooLarge`` before reading a body whose
    Content-Length is over ``MAX_BODY_BYTES``, and as soon as a chunked one grows past it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge()
        chunks.append(chunk)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() in PASSED_HEADERS]
    # the proxy's id (hive_apps/serving/request_ids.py), cleaned again in case it ran without the hive's callback
    headers.append((request_ids.HEADER, request_ids.ensure(request.headers.get(request_ids.HEADER))))
    return ForwardedRequest(method=request.method, path=path, query=request.url.query, headers=headers, body=b"".join(chunks))


class BodyFields(NamedTuple):
    model: str | None  # the OpenAI ``model`` field: of a JSON body, a multipart form, or ``?model=`` of a response id
    stream: bool  # the request asks for a streamed (SSE) answer
    body: dict[str, Any] | None  # the parsed body, when it is a JSON object (for splitting)


async def parse_fields(req: ForwardedRequest) -> BodyFields:
    """``body_fields``, off the event loop for a large body."""
    if len(req.body) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(body_fields, req)
    return body_fields(req)


def body_fields(req: ForwardedRequest) -> BodyFields:
    """What routing needs from an OpenAI request, parsed once per request."""
    if req.path.startswith(RESPONSES_ROUTE + "/"):  # a response id: no body, the model (gateway) in the query
        query = {k: v[0] for k, v in parse_qs(req.query).items()}
        return BodyFields(query.get("model") or None, query.get("stream", "").lower() == "true", None)
    if not req.body:
        return BodyFields(None, False, None)
    content_type = next((v for k, v in req.headers if k.lower() == "content-type"), "")
    if content_type.lower().startswith("multipart/form-data"):
        form = form_fields(content_type, req.body, FORM_FIELDS)
        return BodyFields(form.get("model") or None, form.get("stream", "").lower() == "true", None)
    try:
        body = json.loads(req.body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's limit
        return BodyFields(None, False, None)
    if not isinstance(body, dict):
        return BodyFields(None, False, None)
    model = body.get("model")
    return BodyFields(model if isinstance(model, str) else None, body.get("stream") is True, body)


FORM_FIELDS = frozenset({"model", "stream"})
MAX_FORM_FIELD_BYTES = 1024
"""A wanted form field longer than this is not read (a model id or a boolean is a few bytes)."""


Span = tuple[int, int]


def _text_parts(content_type: str, body: bytes, wanted: frozenset[str]) -> list[tuple[str, str, Span | None]] | None:
    """Each ``wanted`` text part of a multipart form, in order: its name, its value, and where that
    value lies in ``body`` (None when it did not come in one piece of it). Read in place from the body
    already held for forwarding: file parts (the audio) are skipped, never copied. None for a
    malformed form."""
    boundary = parse_options_header(content_type)[1].get(b"boundary")
    if not boundary:
        return None
    found: list[tuple[str, str, Span | None]] = []
    part: dict[str, Any] = {}

    def on_part_begin() -> None:
        part.clear()
        part.update(headers={}, field=b"", value=b"", data=bytearray(), spans=[], keep=False)

    def on_header_field(data: bytes, start: int, end: int) -> None:
        if len(part["field"]) < MAX_FORM_FIELD_BYTES:
            part["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        if len(part["value"]) < MAX_FORM_FIELD_BYTES:
            part["value"] += data[start:end]

    def on_header_end() -> None:
        part["headers"][part["field"].lower()] = part["value"]
        part["field"] = part["value"] = b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(part["headers"].get(b"content-disposition"))
        name = options.get(b"name", b"").decode("latin-1")
        part.update(name=name, keep=name in wanted and b"filename" not in options)

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part["keep"]:
            part["data"] += data[start:end]
            part["spans"].append((start, end) if data is body else None)
            part["keep"] = len(part["data"]) <= MAX_FORM_FIELD_BYTES

    def on_part_end() -> None:
        if part["keep"]:
            found.append((part["name"], part["data"].decode("utf-8", "replace").strip(), _joined(part["spans"])))

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
        "on_part_data": on_part_data, "on_part_end": on_part_end})
    try:
        parser.write(body)
        parser.finalize()
    except (MultipartParseError, ValueError):
        return None
    return found


def _joined(pieces: list[Span | None]) -> Span | None:
    """One span for a value that came in these pieces of the body, if they are all of it and adjacent."""
    if not pieces or any(p is None for p in pieces):
        return None
    spans = [p for p in pieces if p is not None]
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return None
    return spans[0][0], spans[-1][1]


def form_fields(content_type: str, body: bytes, wanted: frozenset[str]) -> dict[str, str]:
    """The ``wanted`` text fields of a multipart form (the last of a repeated one); ``{}`` for a malformed form."""
    return {name: value for name, value, _ in _text_parts(content_type, body, wanted) or []}


def form_field_span(content_type: str, body: bytes, wanted: str) -> Span | None:
    """Where the value of the text field ``wanted`` lies in a multipart body, as ``body[start:end]``;
    None when the form has no such field, has it twice, or its value did not come in one piece of ``body``."""
    parts = _text_parts(content_type, body, frozenset({wanted})) or []
    return parts[0][2] if len(parts) == 1 else None


def _named(req: ForwardedRequest, fields: BodyFields, model_id: str) -> None:
    if fields.body is not None:
        fields.body["model"] = model_id  # the split of a request into several reads this dict again
        req.body = json.dumps(fields.body).encode()
        return
    content_type = next((v for k, v in req.headers if k.lower() == "content-type"), "")
    if content_type.lower().startswith("multipart/form-data"):
        span = form_field_span(content_type, req.body, "model")
        if span is not None:
            req.body = req.body[:span[0]] + model_id.encode() + req.body[span[1]:]


async def serve_as(req: ForwardedRequest, fields: BodyFields, model_id: str) -> None:
    """Name ``model_id`` in a request that named one of its aliases (a JSON body or a multipart form;
    a GET names no model to an engine): the engines know the model by its id only. Their answers name
    the id, as vLLM's do for a model served under several names (it answers with the first)."""
    if len(req.body) > PARSE_OFF_LOOP_BYTES:
        await asyncio.to_thread(_named, req, fields, model_id)
    else:
        _named(req, fields, model_id)


async def request_problem(path: str, req: ForwardedRequest, fields: BodyFields,
                          media_hosts: list[str]) -> tuple[str, str] | None:
    """What the hive answers with a 400 before any engine sees the request: ``(message, param)``."""
    return body_problem(path.rstrip("/"), fields.body) or await remote_media_problem(
        fields.body, media_hosts, off_loop=len(req.body) > PARSE_OFF_LOOP_BYTES)


async def respond(replicas: ReplicaSet, req: ForwardedRequest, fields: BodyFields) -> Response:
    """Answer through a model's replicas: a unary call, or a stream when the body asks for one."""
    if fields.stream:
        return await to_response(replicas.stream(req, fields.body))
    start, body = await replicas.call(req, fields.body)
    return Response(body, status_code=start.status, headers=_passed_headers(start), media_type=start.content_type)


async def respond_for(rec: ModelRecord, replicas_of: Callable[[ModelRecord], ReplicaSet], hold: WakeHold,
                      req: ForwardedRequest, fields: BodyFields, client: str | None = None) -> Response:
    """Answer for a model in any state: served now, held while it wakes, or refused with why.
    ``client``: who sent it (``serving/routing/hold.py`` ``client_of``), for its share of the hold."""
    if rec.status in SERVING:
        return await respond(replicas_of(rec), req, fields)
    request_id = request_ids.of_headers(req.headers)
    gone = gone_message(rec, rec.model_id, request_id)
    if gone or rec.status not in DORMANT:
        return openai_error(404, gone or f"The model `{rec.model_id}` is {rec.status.value} and not ready yet.", "model")
    if fields.stream:
        return await held_stream(hold, rec.model_id, hold.settings.hold_keepalive_s,
                                 lambda woke: replicas_of(woke).stream(req, fields.body), request_id, client)
    try:
        woke = await hold.wait(rec.model_id, request_id, client)
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
    assert isinstance(start, ResponseStart)  # an engine reply starts with its headers
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
    return openai_error(413, f"the request body is larger than the hive's cap of {MAX_BODY_BYTES // 2**20} MiB "
                             "(MAX_BODY_BYTES); send fewer prompts or smaller inline media per request")
