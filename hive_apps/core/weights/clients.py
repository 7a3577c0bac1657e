"""The clients every weight module talks through: the Hub's endpoint and token, the Hub's per-thread
online switch, S3 clients, and the scrubbing of secrets out of any text that leaves the process.

Credentials come from the environment at call time (``HF_TOKEN``; boto3's standard ``AWS_*``
variables), so a rotated key needs no restart, and no message ever carries one. The planner's
listing (``listing``) and the nodes' fetch (``fetch``) both use these; neither imports the other.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from huggingface_hub import constants as hf_constants

from hive_apps.core.weights.types import WeightSource

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
SECRET_VARS = ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_BEARER = re.compile(r"(?i)(bearer\s+)\S+")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{16,}")


def scrub(text: str) -> str:
    """``text`` with this process's secrets masked: upstream errors may echo a header or a URL."""
    for var in SECRET_VARS:
        if (value := os.environ.get(var)) and len(value) >= 4:
            text = text.replace(value, "***")
    return _HF_TOKEN.sub("***", _BEARER.sub(r"\1***", text))


# -- the Hub -----------------------------------------------------------------------------------


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` now: huggingface_hub reads it once, at import, so every call here passes it."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


def hub_token() -> str | None:
    """``HF_TOKEN``, and nothing else: a login stored on one node must not make the planner see a repo
    that the other nodes' fetchers cannot."""
    return os.environ.get("HF_TOKEN") or None


_HUB_ONLINE: ContextVar[bool] = ContextVar("hive_hub_online", default=False)
_switch_lock = threading.Lock()


def _install_online_switch() -> None:
    """``huggingface_hub`` reads HF_HUB_OFFLINE once, at import, and asks ``constants.is_offline_mode()``
    before every request. Engines and tests run offline and must stay so; only the hive's own calls
    (inside ``hub_online``) are let through."""
    with _switch_lock:
        offline = hf_constants.is_offline_mode
        if getattr(offline, "hive_switch", False):
            return

        def is_offline_mode() -> bool:
            return not _HUB_ONLINE.get() and offline()

        is_offline_mode.hive_switch = True  # type: ignore[attr-defined]
        hf_constants.is_offline_mode = is_offline_mode


@contextmanager
def hub_online() -> Iterator[None]:
    """Lift the Hub's offline mode for the calling thread only, for the duration of the block."""
    _install_online_switch()
    token = _HUB_ONLINE.set(True)
    try:
        yield
    finally:
        _HUB_ONLINE.reset(token)


# -- S3 ----------------------------------------------------------------------------------------

_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE",
           "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def s3_client(retries: bool) -> Any:
    """An S3 client from the standard AWS variables as they are now (``AWS_ENDPOINT_URL`` included).
    ``retries``: botocore's own retries on (the planner's listing) or off (the fetch retries, and
    counts the tries, itself)."""
    return _s3_client(tuple(os.environ.get(name) for name in _S3_ENV), retries)


@functools.lru_cache(maxsize=8)
def _s3_client(env: tuple[str | None, ...], retries: bool) -> Any:
    """One client per set of AWS variables and retry setting: a client is thread-safe. A session of
    its own, as boto3's default one is not thread-safe, sharing botocore's service models."""
    import boto3  # here: a tenth of a second every Hub-only fetch and plan would pay at import
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    session.register_component("data_loader", _service_models())
    config = None if retries else Config(retries={"total_max_attempts": 1})
    return boto3.session.Session(botocore_session=session).client("s3", config=config)


@functools.cache
def _service_models() -> Any:
    """botocore's reader of its service descriptions: they never change, and reading them again is
    most of the cost of a new client."""
    import botocore.session

    return botocore.session.get_session().get_component("data_loader")


def s3_location(source: WeightSource) -> tuple[str, str]:
    """(bucket, key prefix ending in "/" or empty) of an S3 source."""
    bucket, _, prefix = source.location.partition("/")
    return bucket, f"{prefix}/" if prefix else ""
