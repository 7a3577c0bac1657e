"""Which request paths may reach an engine, and as which of vLLM's routes. Pure: no Ray.

Routers and the gateway attach the engine's token to what they forward, so forwarding any
path would open vLLM's other routes (and the replica's own ``/hive/load``) to every API key
holder. Paths are matched after rejecting anything a normaliser could turn into another path.

The table follows vLLM 0.32's own routers (``vllm/entrypoints/**/api_router.py``). The gateway
lives at ``/v1`` only, so vLLM's routes outside ``/v1`` (``/classify``, ``/tokenize``, ...) are
reached there under a ``/v1`` name; a model's own route (``/<model_id>/...``) takes both names.
"""

from __future__ import annotations

import re
from typing import Any

from hive_apps.serving.routing.split import fanout_problem

# a path a client sends (after any /<model_id> prefix) -> the vLLM route it reaches
ENGINE_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
    "/v1/embeddings": "/v1/embeddings",
    "/v1/responses": "/v1/responses",
    "/v1/audio/transcriptions": "/v1/audio/transcriptions",  # multipart forms
    "/v1/audio/translations": "/v1/audio/translations",
    # vLLM's /v1/score and /v1/rerank are aliases that log a deprecation warning (/v1/score on every call)
    "/v1/score": "/score", "/score": "/score",
    "/v1/rerank": "/rerank", "/rerank": "/rerank", "/v2/rerank": "/v2/rerank",
    # vLLM serves these outside /v1 only
    "/v1/classify": "/classify", "/classify": "/classify",
    "/v1/tokenize": "/tokenize", "/tokenize": "/tokenize",
    "/v1/detokenize": "/detokenize", "/detokenize": "/detokenize",
}
MULTIPART_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
MODELS_ROUTE = "/v1/models"
RESPONSES_ROUTE = "/v1/responses"
# GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: vLLM's ids are resp_<hex>
_RESPONSE_OBJECT = re.compile(r"/v1/responses/([A-Za-z0-9_-]{1,128})(/cancel)?")
_UNSAFE = re.compile(r"(^|/)\.{1,2}(/|$)|//|\\|%", re.IGNORECASE)

SERVED = ("POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/audio/transcriptions, "
          "/v1/audio/translations, /v1/score, /v1/rerank, /v1/classify, /v1/tokenize, /v1/detokenize; "
          "GET /v1/models, /v1/responses/{id}")
"""What the hive serves on /v1, for the 404 of any other route."""


def split_model_route(path: str) -> tuple[str | None, str]:
    """``/<model_id>/v1/...`` -> (model_id, ``/v1/...``); ``/v1/...`` -> (None, itself); else (None, "")."""
    if path.startswith("/v1/"):
        return None, path
    head, _, rest = path.removeprefix("/").partition("/")
    return (head, "/" + rest) if head and rest.startswith("v1/") and not _UNSAFE.search(path) else (None, "")


def engine_route(method: str, path: str) -> str | None:
    """The vLLM route ``method path`` is forwarded to, or None when it may not reach an engine."""
    if _UNSAFE.search(path):
        return None
    path = path.rstrip("/") or "/"
    if method == "POST" and path in ENGINE_ROUTES:
        return ENGINE_ROUTES[path]
    if is_response_object(method, path):
        return path
    return None


def is_response_object(method: str, path: str) -> bool:
    """``GET /v1/responses/{id}`` or ``POST /v1/responses/{id}/cancel``: no body, and no model in it."""
    m = _RESPONSE_OBJECT.fullmatch(path.rstrip("/"))
    return m is not None and not _UNSAFE.search(path) and method == ("POST" if m.group(2) else "GET")


def model_object_id(method: str, path: str) -> str | None:
    """``GET /v1/models/{id}``: the id asked for, else None."""
    if method != "GET" or _UNSAFE.search(path) or not path.startswith(MODELS_ROUTE + "/"):
        return None
    rest = path[len(MODELS_ROUTE) + 1:].rstrip("/")
    return rest or None


def is_models_list(method: str, path: str) -> bool:
    return method == "GET" and path.rstrip("/") == MODELS_ROUTE


def missing_model(method: str, path: str) -> str:
    """Why a request on /v1 names no model, and how to name one."""
    if is_response_object(method, path):
        return ("a response id does not say which model made it: add ?model=<model id> on /v1, or ask "
                "/<model_id>/v1/responses/{id}")
    if path.rstrip("/") in MULTIPART_ROUTES:
        return "the multipart form must have a 'model' field naming a model from GET /v1/models"
    return "the request body must be JSON with a 'model' field naming a model from GET /v1/models"


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def body_problem(path: str, body: dict[str, Any] | None) -> tuple[str, str] | None:
    """What OpenAI would refuse with a 400 before any model runs: ``(message, param)``, or None.
    ``path`` is the vLLM route. Audio takes multipart forms and a response id no body: the engine checks those."""
    if path in MULTIPART_ROUTES or path.startswith(RESPONSES_ROUTE + "/"):
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
