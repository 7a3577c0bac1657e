"""Remote media is fetched only from the operator's hosts, and never from private addresses."""

import pytest

from hive_apps.routing.media import media_problem, remote_media_problem
from hive_apps.settings import HiveSettings


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
