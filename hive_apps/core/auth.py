"""Bearer-token checks for the admin API and the OpenAI routes.

Either check is off only when nothing is configured and ``HIVE_AUTH_DISABLED=1``; with
nothing configured and auth not disabled, every request is refused, so a forgotten
setting fails closed. A token file (``HIVE_*_FILE``) is read again when it changes, so a
rotation needs no restart; one that is missing or empty closes its door, never opens it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re

from hive_apps.core.settings import HiveSettings

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
        if settings.api_keys_file is not None:
            return "HIVE_API_KEYS_FILE holds no key (missing, unreadable or empty): every request is refused"
        return None if settings.auth_disabled else "no API keys are configured (set HIVE_API_KEYS or HIVE_AUTH_DISABLED=1)"
    if _matches(bearer_token(authorization), keys):
        return None
    return "invalid or missing API key: send 'Authorization: Bearer <key>'"


def check_admin_token(settings: HiveSettings, authorization: str | None) -> str | None:
    tokens = settings.current_admin_tokens()
    if not tokens:
        if settings.admin_token_file is not None:
            return "HIVE_ADMIN_TOKEN_FILE holds no token (missing, unreadable or empty): the admin is closed"
        return None if settings.auth_disabled else "no admin token is configured (set HIVE_ADMIN_TOKEN or HIVE_AUTH_DISABLED=1)"
    if _matches(bearer_token(authorization), set(tokens)):
        return None
    return "invalid or missing admin token: send 'Authorization: Bearer <HIVE_ADMIN_TOKEN>'"


# A Ray / Kubernetes label value (non-empty): what a hive node name is (the ``ray-hive/node`` label).
NODE_NAME_PATTERN = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
MONITOR_TOKEN_PREFIX = "hmn1"
ISSUE_HINT = ("issue one per node with 'python -m hive_apps.ops.monitor issue-token --node-name NODE' "
              "(HIVE_MONITOR_TOKEN in its environment) or POST /admin/monitor-tokens with the admin token")


def valid_node_name(name: str) -> bool:
    return re.fullmatch(NODE_NAME_PATTERN, name) is not None


def node_monitor_token(secret: str, node_name: str) -> str:
    """The token of the monitor agent on ``node_name``: ``hmn1.<node>.<HMAC-SHA256 of the name>`` under
    the hive's ``HIVE_MONITOR_TOKEN``. The hive keeps no list of tokens, and one token speaks
    for its own node only, so a leaked agent token cannot report for any other node."""
    if not valid_node_name(node_name):
        raise ValueError(f"{node_name!r} is not a node name: at most 63 letters, digits, '-', '_' or '.', "
                         "beginning and ending with a letter or digit (a Ray label value)")
    mac = hmac.new(secret.encode("utf-8", "surrogateescape"), f"ray-hive-monitor:{node_name}".encode(), hashlib.sha256)
    return f"{MONITOR_TOKEN_PREFIX}.{node_name}.{mac.hexdigest()}"


def monitor_token_node(settings: HiveSettings, authorization: str | None) -> str | None:
    """The node a per-node monitor token speaks for; None when the bearer is not a valid one."""
    token = bearer_token(authorization)
    secrets = settings.current_monitor_secrets()
    if not secrets or token is None:
        return None
    prefix, _, rest = token.partition(".")
    node = rest.rpartition(".")[0]
    if prefix != MONITOR_TOKEN_PREFIX or not valid_node_name(node):
        return None
    return node if _matches(token, {node_monitor_token(secret, node) for secret in secrets}) else None


def check_monitor_token(settings: HiveSettings, authorization: str | None) -> str | None:
    """None for a per-node monitor token (good only for pushing samples), else the reason for a 401.

    ``HIVE_MONITOR_TOKEN`` itself is the secret the node tokens derive from, never a bearer:
    whoever held it could report for every node.
    """
    secrets = settings.current_monitor_secrets()
    if not secrets:
        return "no monitor token secret is configured (set HIVE_MONITOR_TOKEN or HIVE_MONITOR_TOKEN_FILE on the hive)"
    if monitor_token_node(settings, authorization) is not None:
        return None
    if _matches(bearer_token(authorization), set(secrets)):
        return ("HIVE_MONITOR_TOKEN is the hive's secret, not an agent's token: each monitor agent pushes with "
                f"the token of its own node; {ISSUE_HINT}")
    return f"invalid or missing monitor token: send 'Authorization: Bearer <this node's monitor token>'; {ISSUE_HINT}"


def warn_if_open(settings: HiveSettings, component: str) -> None:
    if settings.auth_disabled and (not settings.current_admin_tokens() or not settings.current_api_keys()):
        log.warning("%s: authentication is DISABLED (HIVE_AUTH_DISABLED=1); do not expose this hive", component)
