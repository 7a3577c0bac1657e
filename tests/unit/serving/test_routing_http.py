"""What the gateway and the routers do with a request before an engine sees it (``serving/routing/http.py``):
bodies are capped before they are buffered, large ones are parsed off the event loop, and a
model's failure text stays with the operator."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from starlette.requests import Request

from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import ModelRecord, ModelStatus
from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.routing import http
from hive_apps.serving.routing.hold import HoldRefused, WakeHold
from hive_apps.serving.routing.http import (
    MAX_BODY_BYTES,
    BodyFields,
    BodyTooLarge,
    read_forwarded,
    respond_for,
    too_large,
)
from tests.unit.helpers import recorded_publisher

MiB = 2**20


def posted(headers: dict[str, str], chunks: list[bytes] | None = None,
           endless: bytes = b"") -> tuple[Request, list[int]]:
    """A POST whose body arrives in ``chunks`` (or ``endless`` ones); the list counts the reads."""
    reads: list[int] = []

    async def receive():
        reads.append(1)
        if chunks is not None:
            i = len(reads) - 1
            return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}
        return {"type": "http.request", "body": endless, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive), reads


# --- the body cap ---------------------------------------------------------------------------
async def test_a_body_declared_over_the_cap_is_refused_before_a_byte_is_read():
    request, reads = posted({"content-length": str(MAX_BODY_BYTES + 1)}, [b"{}"])
    with pytest.raises(BodyTooLarge):
        await read_forwarded(request, "/v1/completions")
    assert reads == []
    answer = too_large()
    assert answer.status_code == 413 and MAX_BODY_BYTES == 16 * MiB
    assert "16 MiB" in json.loads(answer.body)["error"]["message"]


async def test_a_chunked_body_is_cut_off_as_soon_as_it_passes_the_cap():
    request, reads = posted({"transfer-encoding": "chunked"}, endless=b" " * MiB)
    with pytest.raises(BodyTooLarge):
        await read_forwarded(request, "/v1/completions")
    assert len(reads) == 16 + 1  # 16 MiB, then the chunk that passes it: never the rest
    request, _ = posted({"content-length": "2"}, [b"{}"])
    assert (await read_forwarded(request, "/v1/completions")).body == b"{}"


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    parsed_on: list[int] = []
    loads = json.loads

    def spy(text, *args, **kwargs):
        parsed_on.append(threading.get_ident())
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(http.json, "loads", spy)
    small = ForwardedRequest(path="/v1/completions", body=json.dumps({"model": "m", "prompt": "hi"}).encode())
    large = ForwardedRequest(path="/v1/completions", body=json.dumps({"model": "m", "prompt": "x" * 2 * MiB}).encode())
    assert (await http.parse_fields(small)).model == "m"
    assert (await http.parse_fields(large)).model == "m"
    assert len(parsed_on) == 2 and parsed_on[0] == threading.get_ident() != parsed_on[1]


# --- multipart forms (audio) and response ids ---------------------------------------------------
def audio_form(fields: dict[str, str], audio: bytes = b"RIFF" + bytes(1000)) -> ForwardedRequest:
    """A transcription request as the OpenAI SDK sends it: text fields and the file in one multipart body."""
    import httpx

    sent = httpx.Request("POST", "http://hive/v1/audio/transcriptions", data=fields,
                         files={"file": ("a.wav", audio, "audio/wav")})
    return ForwardedRequest(path="/v1/audio/transcriptions", headers=[("content-type", sent.headers["content-type"])],
                            body=sent.read())


def test_the_model_of_a_multipart_form_is_found_without_copying_the_file():
    import tracemalloc

    req = audio_form({"model": "whisper", "stream": "true", "language": "en"})
    assert http.body_fields(req) == BodyFields("whisper", True, None)
    assert http.body_fields(audio_form({"model": "whisper"})) == BodyFields("whisper", False, None)
    assert http.body_fields(audio_form({"language": "en"})).model is None
    big = audio_form({"model": "whisper"}, audio=bytes(8 * MiB))
    tracemalloc.start()
    try:
        assert http.body_fields(big).model == "whisper"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB, peak  # the 8 MiB file is read in place, never buffered a second time


def test_a_malformed_or_odd_form_names_no_model():
    req = audio_form({"model": "whisper"})
    ct = dict(req.headers)["content-type"]
    assert http.form_fields("multipart/form-data", req.body, http.FORM_FIELDS) == {}  # no boundary
    assert http.form_fields(ct, b"not a form at all", http.FORM_FIELDS) == {}
    assert http.body_fields(audio_form({"model": "m" * (http.MAX_FORM_FIELD_BYTES + 1)})).model is None
    sent_as_file = audio_form({}, audio=b"whisper")  # a file part named 'file' is never read as a field
    assert http.form_fields(dict(sent_as_file.headers)["content-type"], sent_as_file.body, frozenset({"file"})) == {}


async def test_a_large_form_is_parsed_off_the_event_loop(monkeypatch):
    on: list[int] = []
    fields = http.form_fields

    def spy(*args):
        on.append(threading.get_ident())
        return fields(*args)

    monkeypatch.setattr(http, "form_fields", spy)
    assert (await http.parse_fields(audio_form({"model": "w"}, audio=bytes(2 * MiB)))).model == "w"
    assert on and on[0] != threading.get_ident()


def test_a_response_id_names_its_model_in_the_query():
    get = ForwardedRequest(method="GET", path="/v1/responses/resp_1", query="model=m&stream=true&starting_after=3")
    assert http.body_fields(get) == BodyFields("m", True, None)
    assert http.body_fields(ForwardedRequest(method="GET", path="/v1/responses/resp_1")) == BodyFields(None, False, None)


# --- failure text -------------------------------------------------------------------------------
TRACEBACK = ("an engine failed to start: RuntimeError: CUDA out of memory | details: Traceback (most recent call "
             "last):\n  File \"/home/ray/anaconda3/lib/python3.11/site-packages/vllm/engine.py\", line 88\n"
             "ray.exceptions.RayTaskError: actor on node 10.0.3.7 died")


def record(status: ModelStatus, **fields) -> ModelRecord:
    return ModelRecord.model_construct(model_id="m", status=status, message=TRACEBACK, **fields)


def client_message(answer) -> str:
    message = json.loads(answer.body)["error"]["message"]
    assert "Traceback" not in message and "10.0.3.7" not in message and "/home/ray" not in message
    assert "CUDA" not in message and "GET /admin/models/m" in message
    return message


async def test_clients_of_a_failed_model_get_where_the_details_are_not_the_traceback(caplog):
    caplog.set_level(logging.INFO, logger="ray.serve")
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("x-request-id", "rid-42")], body=b"{}")
    answer = await respond_for(record(ModelStatus.FAILED), lambda rec: None, WakeHold(HiveSettings(), publisher=recorded_publisher()), req,
                               BodyFields("m", False, {}))
    assert answer.status_code == 404 and "rid-42" in client_message(answer)
    assert any("rid-42" in r.getMessage() and "CUDA out of memory" in r.getMessage() for r in caplog.records)


async def test_held_requests_learn_the_wake_failed_or_timed_out_but_not_why():
    async def no_wake(model_id):
        return None

    hold = WakeHold(HiveSettings(hold_timeout_s=5), no_wake, publisher=recorded_publisher())
    await hold.update({"m": record(ModelStatus.SLEEPING, wake_failed_at=time.time() + 60)})
    with pytest.raises(HoldRefused) as failed:
        await hold.wait("m", "rid-43")
    assert failed.value.response.status_code == 503
    message = client_message(failed.value.response)
    assert "could not wake" in message and "rid-43" in message
    hold = WakeHold(HiveSettings(hold_timeout_s=0.05), no_wake, publisher=recorded_publisher())
    await hold.update({"m": record(ModelStatus.WAKING)})
    with pytest.raises(HoldRefused) as late:
        await hold.wait("m", "rid-44")
    assert late.value.response.status_code == 503 and "did not wake" in client_message(late.value.response)


async def test_every_503_the_hive_makes_says_when_to_retry():
    """OpenAI SDKs and proxies retry a 503 that carries Retry-After; one without it fails the request."""
    import asyncio

    from hive_apps.core.openai_errors import openai_error
    from hive_apps.serving.engine.protocol import ForwardedRequest
    from hive_apps.serving.routing.replica_set import ReplicaSet
    from tests.unit.helpers import replica_plan, routing

    assert openai_error(503, "down").headers["retry-after"] == "1"
    assert openai_error(503, "down", headers={"Retry-After": "7"}).headers["retry-after"] == "7"
    assert "retry-after" not in openai_error(400, "bad").headers

    class Gone:
        def remote(self, *_):
            async def fail():
                raise ConnectionError("replica gone")
            return fail()

    class DeadHandle:
        load = endpoint = forward_unary = forward = Gone()

        def options(self, **_):
            return self

    rs = ReplicaSet("m", {0: DeadHandle()}, [replica_plan()], queue_bound=4, **routing())
    start, _ = await rs.call(ForwardedRequest(path="/v1/chat/completions", body=b"{}"), None)
    assert start.status == 503 and dict(start.headers)["retry-after"] == "1"
    rs.close()
    await asyncio.sleep(0)


async def test_an_alias_is_rewritten_to_the_model_id_in_json_bodies_and_forms():
    """``serve_as``: the engines know a model by its id only, so a request that named an alias names
    the id when it goes on, in a JSON body (and the parsed dict a split reads) or in a multipart form;
    every other byte of a form stays as it was."""
    import httpx

    body = {"model": "chat", "messages": [{"role": "user", "content": "é \"model\": \"chat\""}]}
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                           body=json.dumps(body).encode())
    fields = http.body_fields(req)
    await http.serve_as(req, fields, "qwen3")
    assert json.loads(req.body) == {**body, "model": "qwen3"} and fields.body["model"] == "qwen3"

    form = httpx.Request("POST", "http://x/v1/audio/transcriptions", data={"language": "en", "model": "chat"},
                         files={"file": ("a.wav", b"RIFF model chat", "audio/wav")})
    content_type, sent = form.headers["content-type"], form.read()
    req = ForwardedRequest(path="/v1/audio/transcriptions", headers=[("content-type", content_type)], body=sent)
    fields = http.body_fields(req)
    assert fields.model == "chat" and fields.body is None
    await http.serve_as(req, fields, "qwen3")
    assert http.form_fields(content_type, req.body, frozenset({"model", "language"})) == {"model": "qwen3",
                                                                                           "language": "en"}
    assert req.body == sent.replace(b"\r\n\r\nchat\r\n", b"\r\n\r\nqwen3\r\n")
    assert http.form_field_span(content_type, sent, "stream") is None  # no such field: nothing to rewrite
