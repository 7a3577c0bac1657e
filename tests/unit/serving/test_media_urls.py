"""Remote media is fetched only from the operator's hosts, and never from private addresses."""

import json

import pytest

from hive_apps.core.settings import HiveSettings
from hive_apps.serving.routing.media import media_problem, remote_media_problem


def chat(*urls: str, kind: str = "image_url") -> dict:
    parts = [{"type": "text", "text": "what is this?"}] + [{"type": kind, kind: {"url": u}} for u in urls]
    return {"model": "vl", "messages": [{"role": "user", "content": parts}]}


def public(_host: str) -> list[str]:
    return ["93.184.215.14"]


def test_inline_media_always_passes_and_remote_media_is_off_by_default():
    assert media_problem(chat("data:image/png;base64,iVBORw0KGgo="), [], public) is None
    message, param = media_problem(chat("https://example.com/cat.png"), [], public)
    assert "remote media is off" in message and "HIVE_MEDIA_HOSTS" in message
    assert param == "messages.[0].content.[1].image_url.url"


def test_only_listed_hosts_and_only_public_addresses():
    hosts = ["media.example.com"]
    assert media_problem(chat("https://media.example.com/a.png", kind="video_url"), hosts, public) is None
    assert "not allowed" in media_problem(chat("https://evil.example.net/a.png"), hosts, public)[0]
    for private in (["10.0.0.7"], ["127.0.0.1"], ["169.254.169.254"], ["::1"], ["fd00::1"], ["93.184.215.14", "10.1.1.1"]):
        problem = media_problem(chat("https://media.example.com/a.png"), hosts, lambda _h, a=private: a)
        assert problem and "private or local address" in problem[0], private

    def gone(_host):
        raise OSError("no such name")

    assert "does not resolve" in media_problem(chat("https://media.example.com/a.png"), hosts, gone)[0]
    assert "scheme 'file'" in media_problem(chat("file:///etc/passwd", kind="audio_url"), hosts, public)[0]


async def test_requests_without_remote_media_look_nothing_up():
    assert await remote_media_problem({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, []) is None
    assert await remote_media_problem(chat("data:audio/wav;base64,UklGRg=="), []) is None
    assert (await remote_media_problem(chat("http://localhost/x.png"), []))[0].startswith("fetching remote media is off")


def test_media_hosts_setting_is_a_lowercase_list(monkeypatch):
    monkeypatch.setenv("HIVE_MEDIA_HOSTS", "Media.Example.com, cdn.example.org")
    assert HiveSettings.from_env().media_hosts == ["media.example.com", "cdn.example.org"]


# --- every shape vLLM fetches from, on every route that reaches an engine --------------------------
REMOTE = "https://media.example.com/cat.png"


def parts(*content: dict) -> list[dict]:
    return [{"type": "message", "role": "user", "content": list(content)}]


# (route, body, the field named in the refusal): shapes vLLM 0.32 loads that the typed-part check missed
BYPASSES = {
    "chat part without a type": ("/v1/chat/completions", {"model": "vl", "messages": [
        {"role": "user", "content": [{"image_url": REMOTE}]}]}, "messages.[0].content.[0].image_url"),
    "untyped audio object": ("/v1/chat/completions", {"model": "vl", "messages": [
        {"role": "user", "content": [{"audio_url": {"url": REMOTE}, "uuid": "a1"}]}]},
        "messages.[0].content.[0].audio_url.url"),
    "input_image part in a chat": ("/v1/chat/completions", {"model": "vl", "messages": [
        {"role": "user", "content": [{"type": "input_image", "image_url": REMOTE}]}]},
        "messages.[0].content.[0].image_url"),
    "input_audio given a url": ("/v1/chat/completions", {"model": "vl", "messages": [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"url": REMOTE}}]}]},
        "messages.[0].content.[0].input_audio.url"),
    "responses input_image": ("/v1/responses", {"model": "vl", "input": parts(
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": REMOTE, "detail": "auto"})}, "input.[0].content.[1].image_url"),
    "responses input_file": ("/v1/responses", {"model": "vl", "input": parts(
        {"type": "input_file", "file_url": REMOTE})}, "input.[0].content.[0].file_url"),
    "score text_2 content": ("/v1/score", {"model": "vl", "text_1": "a cat", "text_2": {"content": [
        {"type": "video_url", "video_url": {"url": REMOTE}}]}}, "text_2.content.[0].video_url.url"),
    "score queries": ("/v1/score", {"model": "vl", "queries": [{"content": [
        {"type": "image_url", "image_url": {"url": REMOTE}}]}], "documents": ["a cat"]},
        "queries.[0].content.[0].image_url.url"),
    "rerank documents": ("/v1/rerank", {"model": "vl", "query": "a cat", "documents": [
        "text", {"content": [{"type": "audio_url", "audio_url": {"url": REMOTE}}]}]},
        "documents.[1].content.[0].audio_url.url"),
    "a URL-like string anywhere under a media key": ("/v1/embeddings", {"model": "vl", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"alt": ["HTTPS://media.example.com/x"]}}]}]},
        "messages.[0].content.[0].image_url.alt.[0]"),
}


@pytest.mark.parametrize("name", sorted(BYPASSES))
async def test_remote_media_is_refused_in_every_shape_vllm_fetches(name):
    from hive_apps.serving.engine.protocol import ForwardedRequest
    from hive_apps.serving.routing.http import body_fields, request_problem

    path, body, field = BYPASSES[name]
    req = ForwardedRequest(path=path, body=json.dumps(body).encode())
    message, param = await request_problem(path, req, body_fields(req), [])  # HIVE_MEDIA_HOSTS unset
    assert param == field and field in message and "HIVE_MEDIA_HOSTS" in message
    assert media_problem(body, ["media.example.com"], public) is None  # a listed host is fetched
    assert "not allowed" in media_problem(body, ["other.example.com"], public)[0]


def test_file_urls_are_refused_even_beside_listed_hosts_and_inline_audio_is_no_url():
    for url in ("file:///etc/passwd", "FILE:///etc/passwd", "//media.example.com/cat.png"):
        body = {"model": "vl", "input": parts({"type": "input_image", "image_url": url})}
        assert "scheme" in media_problem(body, ["media.example.com"], public)[0], url
    mp3 = {"type": "input_audio", "input_audio": {"data": "//uQxAAAAAAAAAAA", "format": "mp3"}}  # raw MP3 frames
    assert media_problem({"model": "a", "messages": [{"role": "user", "content": [mp3]}]}, [], public) is None
    assert media_problem(chat("DATA:image/png;base64,iVBORw0KGgo="), [], public) is None  # vLLM's test ignores case


def test_urls_two_parsers_read_differently_are_refused():
    hosts = ["media.example.com"]
    for url in ("https://evil.example.net\\@media.example.com/a.png", "https://user:pw@media.example.com/a.png",
                "https://media.example.com/a b.png"):
        assert "credentials, backslashes" in media_problem(chat(url), hosts, public)[0], url
