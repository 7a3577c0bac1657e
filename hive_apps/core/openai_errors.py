"""Errors in OpenAI's shape, for every reply the hive itself writes on the OpenAI routes."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               429: "RateLimitError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def openai_error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """Every 503 says when to come back (``Retry-After: 1`` unless the caller knows better): the
    OpenAI SDKs and proxies retry on it instead of failing the request."""
    if status == 503 and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "retry-after": "1"}
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> bytes:
    """The last events of a stream that cannot go on (its headers, 200, are already sent)."""
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()
