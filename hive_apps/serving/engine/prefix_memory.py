"""What an engine replica was sent, in the routers' prefix keys (``serving/routing/prefix.py``).

Each router and gateway replica learns prefix affinity from what it sent, so one that starts (a
restart, a new replica set once the model's replicas changed, another gateway replica) knew nothing:
each conversation's next turn went least-loaded, often to a replica without its prefix. The engine
sees every request, whichever way it came (a Serve handle, its own port, the edge), so it keeps the
same keys the routers keep, as they keep them (a ``BlockLRU`` bounded by the replica's planned KV
cache); a router reads them once per replica when it first reaches it (``ReplicaSet``) and routes
those conversations back where their blocks are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hive_apps.serving.engine.adapters import adapter_ref
from hive_apps.serving.engine.http_server import PREFIX_PATH
from hive_apps.serving.routing.prefix import BlockLRU, request_keys

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_BODY_BYTES = 4 * 2**20  # a larger body (media) is not read for its prefix: its request runs as ever


def note(memory: BlockLRU, body: bytes, scope: dict) -> None:
    """The request's blocks ran here: keyed as a router keys them (an adapter's chained from its name)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return  # vLLM answers it with its own 400
    if not isinstance(parsed, dict):
        return
    ref = adapter_ref(scope)
    memory.touch(request_keys(parsed, ref.model_id if ref is not None and not isinstance(ref, str) else None))


def with_prefix_memory(app: Callable, memory: Callable[[], BlockLRU]) -> Callable:
    """``app``, noting each generate request's prompt blocks in ``memory()`` as its body arrives, and
    answering ``GET /hive/prefix`` with them."""

    async def asgi(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == PREFIX_PATH:
            body = json.dumps(list(memory().keys)).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["method"] != "POST" or scope["path"] not in GENERATE_PATHS:
            await app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0

        async def tapped() -> dict[str, Any]:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request" and size <= MAX_BODY_BYTES:  # past it, not read for this
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if not message.get("more_body") and size <= MAX_BODY_BYTES:
                    note(memory(), b"".join(chunks), scope)
            return message

        await app(scope, tapped, send)

    return asgi
