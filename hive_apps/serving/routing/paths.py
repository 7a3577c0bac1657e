"""Which request paths may reach an engine: OpenAI's routes, nothing else. Pure: no Ray.

Routers and the gateway attach the engine's token to what they forward, so forwarding any
path would open vLLM's other routes (and the replica's own ``/hive/load``) to every API key
holder. Paths are matched after rejecting anything a normaliser could turn into another path.
"""

from __future__ import annotations

import re
from typing import Any

from hive_apps.serving.routing.split import fanout_problem

# POST routes served by vLLM's OpenAI layer
ENGINE_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/rerank", "/v1/score", "/v1/classify",
})
MODELS_ROUTE = "/v1/models"
_UNSAFE = re.compile(r"(^|/)\.{1,2}(/|$)|//|\\|%", re.IGNORECASE)


def engine_route(method: str, path: str) -> str | None:
    """The canonical path if ``method path`` may be forwarded to an engine, else None."""
    if _UNSAFE.search(path):
        return None
    path = path.rstrip("/") or "/"
    if method == "POST" and path in ENGINE_ROUTES:
        return path
    return None


def model_object_id(method: str, path: str) -> str | None:
    """``GET /v1/models/{id}``: the id asked for, else None."""
    if method != "GET" or _UNSAFE.search(path) or not path.startswith(MODELS_ROUTE + "/"):
        return None
    rest = path[len(MODELS_ROUTE) + 1:].rstrip("/")
    return rest or None


def is_models_list(method: str, path: str) -> bool:
    return method == "GET" and path.rstrip("/") == MODELS_ROUTE


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def body_problem(path: str, body: dict[str, Any] | None) -> tuple[str, str] | None:
    """What OpenAI would refuse with a 400 before any model runs: ``(message, param)``, or None.
    Audio routes take multipart forms, checked by the engine."""
    if path.startswith("/v1/audio/"):
        return None
    if body is None:
        return "the request body must be a JSON object", "body"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "the request body must name a model in its 'model' field (GET /v1/models lists them)", "model"
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list", "messages"
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in CHAT_ROLES:
                return (f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
                        f"messages.[{i}].role")
    return fanout_problem(path, body)
