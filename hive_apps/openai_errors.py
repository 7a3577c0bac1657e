"""Errors in OpenAI's shape, for every reply the hive itself writes on the OpenAI routes."""

from __future__ import annotations

from starlette.responses import JSONResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               429: "RateLimitError", 503: "ServiceUnavailableError"}


def openai_error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)
