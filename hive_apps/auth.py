"""Bearer-token checks for the admin API and the OpenAI routes.

Either check is off only when nothing is configured and ``HIVE_AUTH_DISABLED=1``; with
nothing configured and auth not disabled, every request is refused, so a forgotten
setting fails closed.
"""

from __future__ import annotations

import hmac
import logging

from hive_apps.settings import HiveSettings

log = logging.getLogger("ray.serve")


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, allowed: set[str]) -> bool:
    """Constant-time; compared as bytes, so a token with non-ASCII characters is just wrong."""
    if token is None:
        return False
    given = token.encode("utf-8", "surrogateescape")
    return any(hmac.compare_digest(given, k.encode("utf-8", "surrogateescape")) for k in allowed)


def check_api_key(settings: HiveSettings, authorization: str | None) -> str | None:
    """None when allowed, else the reason for a 401."""
    keys = settings.current_api_keys()
    if not keys:
        return None if settings.auth_disabled else "no API keys are configured (set HIVE_API_KEYS or HIVE_AUTH_DISABLED=1)"
    if _matches(bearer_token(authorization), keys):
        return None
    return "invalid or missing API key: send 'Authorization: Bearer <key>'"


def check_admin_token(settings: HiveSettings, authorization: str | None) -> str | None:
    if not settings.admin_token:
        return None if settings.auth_disabled else "no admin token is configured (set HIVE_ADMIN_TOKEN or HIVE_AUTH_DISABLED=1)"
    if _matches(bearer_token(authorization), {settings.admin_token}):
        return None
    return "invalid or missing admin token: send 'Authorization: Bearer <HIVE_ADMIN_TOKEN>'"


def check_monitor_token(settings: HiveSettings, authorization: str | None) -> str | None:
    """The monitor agent's own token (``HIVE_MONITOR_TOKEN``), good only for pushing samples."""
    if not settings.monitor_token:
        return "no monitor token is configured (set HIVE_MONITOR_TOKEN)"
    if _matches(bearer_token(authorization), {settings.monitor_token}):
        return None
    return "invalid or missing monitor token"


def warn_if_open(settings: HiveSettings, component: str) -> None:
    if settings.auth_disabled and (not settings.admin_token or not settings.current_api_keys()):
        log.warning("%s: authentication is DISABLED (HIVE_AUTH_DISABLED=1); do not expose this hive", component)
