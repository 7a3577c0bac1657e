"""Which media URLs a chat request may make the engine fetch. Pure, except the name lookup it is given.

vLLM fetches ``image_url`` / ``video_url`` / ``audio_url`` parts itself, from inside the cluster:
left open, any client could make the engine request internal addresses (server-side request
forgery). So remote media is off unless the operator lists hosts (``HIVE_MEDIA_HOSTS``), and even
a listed name is refused when it resolves to a private, loopback, link-local or otherwise
non-public address. Data URLs (the media inline) are always accepted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

MEDIA_PARTS = ("image_url", "video_url", "audio_url")


def media_urls(body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(param, url)`` of every media URL in a chat body's message contents."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in MEDIA_PARTS:
                continue
            kind = part["type"]
            value = part.get(kind)
            url = value.get("url") if isinstance(value, dict) else value
            if isinstance(url, str):
                yield f"messages.[{i}].content.[{j}].{kind}.url", url


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return ip.is_global and not ip.is_multicast


def media_problem(body: dict[str, Any] | None, allowed_hosts: list[str],
                  resolve: Callable[[str], list[str]]) -> tuple[str, str] | None:
    """``(message, param)`` for the first media URL the engine may not fetch, or None."""
    if not body:
        return None
    for param, url in media_urls(body):
        if url.startswith("data:"):
            continue
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return (f"media URLs must be data: URLs or http(s) URLs of an allowed host, got scheme "
                    f"{parts.scheme or 'none'!r}", param)
        host = parts.hostname.lower()
        if host not in allowed_hosts:
            if not allowed_hosts:
                return ("fetching remote media is off on this hive: send the media inline as a data: URL "
                        "(or ask the operator to list the host in HIVE_MEDIA_HOSTS)", param)
            return (f"media host {host!r} is not allowed (allowed: {', '.join(allowed_hosts)}); send the media "
                    "inline as a data: URL", param)
        try:
            addresses = resolve(host)
        except OSError:
            return f"media host {host!r} does not resolve", param
        if not addresses or not all(_public(a) for a in addresses):
            return (f"media host {host!r} resolves to a private or local address; the hive fetches media only "
                    "from public addresses", param)
    return None


async def remote_media_problem(body: dict[str, Any] | None, allowed_hosts: list[str]) -> tuple[str, str] | None:
    """``media_problem`` for a request; names are looked up off the event loop, and only when a
    part is not inline."""
    if not body or all(url.startswith("data:") for _, url in media_urls(body)):
        return None
    import asyncio

    return await asyncio.to_thread(media_problem, body, allowed_hosts, resolve_host)


def resolve_host(host: str) -> list[str]:
    """Every address a name resolves to (blocking: call it off the event loop)."""
    import socket

    return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
