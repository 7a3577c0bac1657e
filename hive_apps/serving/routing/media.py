"""Which media URLs a request may make the engine fetch. Pure, except the name lookup it is given.

vLLM fetches media URLs itself, from inside the cluster: left open, any client could make the
engine request internal addresses (server-side request forgery). So remote media is off unless
the operator lists hosts (``HIVE_MEDIA_HOSTS``), and even a listed name is refused when it
resolves to a private, loopback, link-local or otherwise non-public address. Data URLs (the
media inline) are always accepted.

vLLM reads media from more shapes than the typed chat parts: parts without a ``type``
(``{"image_url": "http://..."}``), a part with a ``uuid``, Responses ``input_image`` parts,
``/v1/responses`` inputs, and content-part objects in ``/v1/score`` and ``/v1/rerank`` fields
(``renderers/chat_utils.py::_parse_chat_message_content_mm_part`` in vLLM 0.32). Following each of
those shapes would miss the next one vLLM adds, so the check is structural: every value under a
media key anywhere in the JSON body is a media reference, whatever the route and the part's type.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

# Keys whose value vLLM (or an OpenAI-style client) treats as media to load: a URL string, or an
# object with a ``url``. Compared in lower case.
MEDIA_KEYS = frozenset({"image_url", "video_url", "audio_url", "input_image", "input_audio", "file_url"})
# Under a media key, keys that hold the media itself, never a location: ``input_audio.data`` is
# base64 that vLLM wraps in a data: URL (raw MP3 frames encode to "//..."; it must not read as a URL).
INLINE_KEYS = frozenset({"data"})
# Any other string under a media key that starts like this is a URL too (compared in lower case).
URL_PREFIXES = ("http://", "https://", "file:", "//")
# Characters two URL parsers read differently (the hive's ``urlsplit`` and vLLM's urllib3
# ``parse_url`` can then see different hosts, e.g. ``http://a.example\@b.example/``): a media URL
# holding one is refused, as is credentials' ``@`` before the host.
_AMBIGUOUS = frozenset("\\\x7f") | {chr(c) for c in range(0x21)}

# A place in the body as linked (parent, segment) pairs: cheap per container, formatted only when reported.
_Path = tuple[Any, str]


def _format(path: _Path | None) -> str:
    segments: list[str] = []
    while path is not None:
        path, segment = path
        segments.append(segment)
    return ".".join(reversed(segments))


def _inline(url: str) -> bool:
    """vLLM's own test for a data URL (``load_from_url``): the first five characters, any case."""
    return url[:5].lower() == "data:"


def media_urls(body: Any) -> Iterator[tuple[str, str]]:
    """``(param, url)`` of every media reference in a JSON body, in document order.

    A reference is a string under a media key, or the ``url`` of an object under one; any other
    string under a media key that starts like a URL counts as well. Iterative: a body nested as
    deep as ``json.loads`` allows does not overflow the stack here.
    """
    stack: list[tuple[Any, _Path | None, str]] = [(body, None, "walk")]
    while stack:
        node, path, mode = stack.pop()
        if isinstance(node, str):
            if mode == "reference" or (mode == "maybe" and node[:8].lower().startswith(URL_PREFIXES)):
                yield _format(path), node
            continue
        if isinstance(node, dict):
            children = []
            for key, value in node.items():
                if mode == "walk":
                    child_mode = "reference" if str(key).lower() in MEDIA_KEYS else "walk"
                elif str(key).lower() in INLINE_KEYS:
                    continue
                else:
                    child_mode = "reference" if key == "url" else "maybe"
                if isinstance(value, (str, dict, list)):
                    children.append((value, (path, str(key)), child_mode))
        elif isinstance(node, list):
            child_mode = "maybe" if mode != "walk" else "walk"
            children = [(value, (path, f"[{i}]"), child_mode) for i, value in enumerate(node)
                        if isinstance(value, (dict, list)) or (mode != "walk" and isinstance(value, str))]
        else:
            continue
        stack.extend(reversed(children))


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return ip.is_global and not ip.is_multicast


def media_problem(body: dict[str, Any] | None, allowed_hosts: list[str],
                  resolve: Callable[[str], list[str]]) -> tuple[str, str] | None:
    """``(message, param)`` for the first media URL the engine may not fetch, or None.

    Each host is looked up once per request."""
    if not body:
        return None
    resolved: dict[str, list[str] | OSError] = {}
    for param, url in media_urls(body):
        if _inline(url):
            continue
        problem = _url_problem(url, allowed_hosts, resolved, resolve)
        if problem is not None:
            return f"{problem} (field {param})", param
    return None


def _url_problem(url: str, allowed_hosts: list[str], resolved: dict[str, list[str] | OSError],
                 resolve: Callable[[str], list[str]]) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (f"media URLs must be data: URLs or http(s) URLs of a host in HIVE_MEDIA_HOSTS, got scheme "
                f"{parts.scheme or 'none'!r}")
    if not allowed_hosts:
        return ("fetching remote media is off on this hive: send the media inline as a data: URL "
                "(or ask the operator to list the host in HIVE_MEDIA_HOSTS)")
    if _AMBIGUOUS.intersection(url) or "@" in parts.netloc:
        return ("a media URL may not hold credentials, backslashes, spaces or control characters "
                "(percent-encode them)")
    host = parts.hostname.lower()
    if host not in allowed_hosts:
        return (f"media host {host!r} is not allowed by HIVE_MEDIA_HOSTS (allowed: {', '.join(allowed_hosts)}); "
                "send the media inline as a data: URL")
    if host not in resolved:
        try:
            resolved[host] = resolve(host)
        except OSError as e:
            resolved[host] = e
    addresses = resolved[host]
    if isinstance(addresses, OSError):
        return f"media host {host!r} does not resolve"
    if not addresses or not all(_public(a) for a in addresses):
        return (f"media host {host!r} resolves to a private or local address; the hive fetches media only "
                "from public addresses")
    return None


async def remote_media_problem(body: dict[str, Any] | None, allowed_hosts: list[str],
                               off_loop: bool = False) -> tuple[str, str] | None:
    """``media_problem`` for a request. Names are looked up off the event loop, and only when a
    reference is not inline; ``off_loop`` walks a large body off the loop too."""
    if not body:
        return None
    if not off_loop and all(_inline(url) for _, url in media_urls(body)):
        return None
    return await asyncio.to_thread(media_problem, body, allowed_hosts, resolve_host)


def resolve_host(host: str) -> list[str]:
    """Every address a name resolves to (blocking: call it off the event loop)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
