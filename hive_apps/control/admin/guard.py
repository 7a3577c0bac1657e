"""The admin's gate: the token and the body size are checked before anything is read.

FastAPI parses a whole body before its dependencies run, so a token check written as a
dependency lets anyone without a token make the head parse megabytes of JSON. This ASGI
layer answers 401 or 413 from the headers alone, and stops a body that grows past the limit
while it streams in (admin bodies are small JSON, so it is read here and handed on whole).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hive_apps.core.auth import check_admin_token, check_monitor_token
from hive_apps.core.settings import HiveSettings

# describe the API or hold no state; "/" is the status page's shell, whose script asks for the token
OPEN_PATHS = {"/", "/healthz", "/docs", "/openapi.json", "/docs/oauth2-redirect"}
SAMPLES_PATH = "/registry/samples"  # a per-node monitor token is accepted here (and only here)
MAX_BODY_BYTES = 1 * 2**20


def _error(status: int, message: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "field": None, "status": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


class AdminGuard:
    def __init__(self, app, settings: Callable[[], HiveSettings], max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.settings = settings
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        root = scope.get("root_path", "")
        path = scope["path"][len(root):] if root and scope["path"].startswith(root) else scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        reason = self._refusal(path.rstrip("/") or "/", headers.get("authorization"))
        if reason is None:
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                reason = (413, f"the body is larger than {self.max_body_bytes // 1024} KiB; admin bodies are small JSON objects")
        if reason is not None:
            start, body = _error(*reason)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return

        # Admin bodies are small: read it here, under the limit, and hand it on whole.
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_body_bytes:
                start, body = _error(413, f"the body is larger than {self.max_body_bytes // 1024} KiB")
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the client to leave
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _refusal(self, path: str, authorization: str | None) -> tuple[int, str] | None:
        if path in OPEN_PATHS:
            return None
        settings = self.settings()
        reason = check_admin_token(settings, authorization)
        if path == SAMPLES_PATH and reason is not None:
            # the endpoint then refuses a sample for any node but the token's own (403)
            monitor = check_monitor_token(settings, authorization)
            if monitor is None:
                return None
            reason = monitor if settings.current_monitor_secrets() else reason
        return (401, reason) if reason else None
