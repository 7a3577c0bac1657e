"""One settings object for the whole hive, read from the environment (``HIVE_*``).

Serve replicas inherit the environment of the Ray node they run on, so a value exported
before ``ray start`` (or set in a RayService container) reaches every hive deployment.
Every variable is a typed field below; ``serve_configs/hive.yaml`` lists them for operators.
Booleans accept ``0/1/true/false/on/off/yes/no`` everywhere. A bad value stops the component
at start with a message naming the variable and what it accepts.
"""

from __future__ import annotations

import logging
import os
import re
import time
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from hive_apps.core.ports import parse_port_range

log = logging.getLogger("ray.serve")

ENV_PREFIX = "HIVE_"
RACY_S = 2.0


class SettingsError(ValueError):
    """A ``HIVE_*`` variable has a value the hive cannot use."""


class HiveSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    admin_token: str | None = Field(None, description="Bearer token for /admin (required unless auth is disabled).")
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Comma-separated API keys for /v1 and /<model_id>/v1.")
    api_keys_file: Path | None = Field(None, description="A file with one API key per line, re-read when it changes.")
    admin_token_file: Path | None = Field(None, description="A file with the admin token (instead of HIVE_ADMIN_TOKEN; one a line, the old one beside the new while rotating), re-read when it changes.")
    monitor_token: str | None = Field(None, description="Secret the per-node monitor-agent tokens derive from (python -m hive_apps.ops.monitor issue-token, POST /admin/monitor-tokens); never a bearer itself.")
    monitor_token_file: Path | None = Field(None, description="A file with the monitor secret (instead of HIVE_MONITOR_TOKEN; one a line, new tokens issued from the first), re-read when it changes.")
    auth_disabled: bool = Field(False, description="Allow requests where no token/key is configured (logs a warning).")
    memory_budget_fraction: float = Field(0.90, gt=0, le=1, description="Share of each device's memory the planner may use.")
    monitor_interval_s: float = Field(1.0, gt=0, description="Seconds between device samples of every node.")
    deploy_timeout_s: float = Field(900.0, gt=0, description="Deadline for every replica of a deploy to become ready once its weights are on its node.")
    pending_reservation_ttl_s: float = Field(960.0, gt=0, description="Free a reservation whose engine never came up after this.")
    self_heal: bool = Field(True, description="Replace replicas lost with their node where capacity exists.")
    heal_backoff_max_s: float = Field(60.0, gt=0, description="Longest wait between self-healing attempts of one model (doubles from 2 s).")
    vllm_kwargs_allow: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Comma-separated vLLM arguments a deploy may pass beyond the hive's allow-list (hive_apps/core/vllm_args.py).")
    engine_env_allow: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Comma-separated environment variables (names, or PREFIX* patterns) a deploy's env may set beyond the hive's allow-list (hive_apps/core/engine_env.py); the variables the hive pins or guards stay refused.")
    trust_remote_code: bool = Field(False, description="Let deploys set trust_remote_code (runs a model repository's own code on the node).")
    hook_packages: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Comma-separated package prefixes that hive_placement_policy / hive_attention_cls classes may come from; empty = hooks off.")
    plan_timeout_s: float = Field(30.0, gt=0, description="Longest one plan may compute; past it the deploy gets 422.")
    engine_read_timeout_s: float = Field(600.0, gt=0, description="A streamed request fails when its engine sends nothing for this long; a non-streaming one waits for its whole answer while the engine answers a load probe this often.")
    engine_http: bool = Field(True, description="Routers reach engines over each replica's own HTTP port; off = Serve handles only.")
    engine_port_range: Annotated[tuple[int, int] | None, NoDecode] = Field(
        None, description="e.g. 20000-20999: engine replicas listen on the first free port of this range "
                          "(for NetworkPolicies and firewalls); unset = any free port.")
    edge_port: int | None = Field(None, ge=1, le=65535, description=(
        "Port of the edge on each gateway replica's node: an HAProxy that sends /v1 and /<model_id>/v1 requests "
        "straight to the engine replica the gateway chooses, and the rest to Serve's ingress; unset = no edge."))
    default_demand_seqs: int = Field(0, ge=0, le=1024, description=(
        "Sequences per replica a deploy without max_concurrency is sized for, packed onto a shared card; "
        "0 = throughput-first: the most the free memory holds (a lone model is not grown back yet)."))
    hold_max_per_model: int = Field(64, ge=0, description="Requests that may wait for one sleeping model to wake; more get 429.")
    hold_timeout_s: float = Field(300.0, gt=0, description="Longest a request waits for a sleeping model to wake; then 503.")
    hold_keepalive_s: float = Field(5.0, gt=0, description="Seconds between SSE comment keep-alives sent to a streaming client that waits for a wake.")
    drain_grace_s: float = Field(30.0, ge=0, description="Longest a replica that is put to sleep or deleted waits for its in-flight requests.")
    read_ahead: bool = Field(True, description="A starting vLLM engine (a deploy, a wake) first reads its weights into the node's page cache in a thread, while it imports vLLM and waits for its start lock, when the node's available RAM holds what is missing twice over.")
    warm_park: bool = Field(True, description="An engine without vLLM's sleep mode (vLLM on CPU) sleeps warm: vLLM stops in it and frees its memory, the replica's process stays with vLLM imported, and a wake starts vLLM again in it (no Serve scheduling, no new process, no imports). Its process's memory stays booked on its node until another model needs it. Off: such an engine is removed (parked) and its wake is a cold start.")
    min_residency_s: float = Field(60.0, ge=0, description="Cap of the minimum residency: a model that woke is kept its own wake cost, and a model waiting for room honours that its own wake cost, at most this many seconds each.")
    lifecycle_tick_s: float = Field(1.0, gt=0, description="How often the admin reads the activity of models that can sleep or be destroyed.")
    scale_window_s: float = Field(30.0, gt=0, description="How long every replica must stay above 80 % (below 20 %) of its planned capacity before one is added (removed).")
    media_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Comma-separated hosts chat requests may have engines fetch media from (http/https); empty = remote media off, data: URLs only.")
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Comma-separated browser origins (https://app.example.com, or *) allowed to call /v1 and /<model_id>/v1 (CORS); empty = CORS off.")
    state_namespace: str = Field("ray-hive", min_length=1, description="Ray internal-KV namespace of the durable state.")
    kv_timeout_s: float = Field(10.0, gt=0, description="Deadline of one read or write of the durable state.")
    model_root: Path | None = Field(None, description="When set, a deploy's model folder must lie under it (a cached Hugging Face name is always allowed).")
    model_cache_dir: Path = Field(Path.home() / ".cache" / "ray-hive", description="Where built-in models are written.")
    weights_cache: Path = Field(Path.home() / ".cache" / "ray-hive" / "weights",
                                description="This node's weight cache: Hub models in the Hugging Face cache layout "
                                            "(hub/), S3 prefixes (s3/), and the planner's metadata (meta/). Read on "
                                            "each node: set it per node (a hostPath or PVC on Kubernetes).")
    fetch_workers: int = Field(8, ge=1, le=64, description="Files one node downloads at once for one model.")

    @field_validator("api_keys", "vllm_kwargs_allow", "engine_env_allow", "hook_packages", "media_hosts", "cors_origins",
                     mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @field_validator("media_hosts")
    @classmethod
    def _hostnames(cls, v: list[str]) -> list[str]:
        if isinstance(v, list):
            return [h.lower() for h in v]
        return v

    @field_validator("engine_env_allow")
    @classmethod
    def _env_patterns(cls, v: list[str]) -> list[str]:
        """A name or a prefix with one trailing ``*``: anything else would match nothing, or not what was meant."""
        bad = [p for p in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\*?|\*", p)]
        if bad:
            raise ValueError(f"not a variable name or a PREFIX* pattern: {', '.join(bad)}")
        return v

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        """An origin is scheme://host[:port], as browsers send it; a path or a typo would match nothing."""
        origins = [o.rstrip("/").lower() for o in v]
        bad = [o for o in origins if o != "*" and not re.fullmatch(r"https?://[a-z0-9.\[\]:-]+", o)]
        if bad:
            raise ValueError(f"not an origin (scheme://host[:port], or *): {', '.join(bad)}")
        return origins

    @field_validator("engine_port_range", mode="before")
    @classmethod
    def _port_range(cls, value: Any) -> Any:
        if value == "":
            return None
        return parse_port_range(value) if isinstance(value, str) else value

    @field_validator("admin_token", "monitor_token", "api_keys_file", "admin_token_file", "monitor_token_file",
                     "model_root", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        return None if v == "" else v

    @model_validator(mode="after")
    def _one_source_per_token(self) -> HiveSettings:
        """A token in the environment beside its file would outlive every rotation of the file."""
        for name in ("admin_token", "monitor_token"):
            if getattr(self, name) and getattr(self, name + "_file") is not None:
                var = ENV_PREFIX + name.upper()
                raise ValueError(f"set {var} or {var}_FILE, not both")
        return self

    @classmethod
    def from_env(cls) -> HiveSettings:
        """Read the environment; a bad value raises ``SettingsError`` naming the variable."""
        try:
            return cls()
        except ValidationError as e:
            problems = []
            for err in e.errors():
                if not err.get("loc"):  # a rule across variables: its message names them
                    problems.append(err["msg"].removeprefix("Value error, "))
                    continue
                name = ENV_PREFIX + str(err["loc"][0]).upper() if err.get("loc") else "HIVE_*"
                field = cls.model_fields.get(str(err["loc"][0])) if err.get("loc") else None
                accepted = _accepted(field.annotation) if field else ""
                problems.append(f"{name}={os.environ.get(name, '')!r}: {err['msg']}{accepted}")
            raise SettingsError("invalid hive settings: " + "; ".join(problems)) from None

    def current_api_keys(self) -> set[str]:
        """Keys from the environment plus the key file (re-read only when the file changes)."""
        return set(self.api_keys) | set(_key_file.read(self.api_keys_file))

    def current_admin_tokens(self) -> tuple[str, ...]:
        """``HIVE_ADMIN_TOKEN``, or every line of ``HIVE_ADMIN_TOKEN_FILE`` as it is now (two lines
        while a rotation is under way: the new token and the old one)."""
        if self.admin_token_file is not None:
            return _admin_file.read(self.admin_token_file)
        return (self.admin_token,) if self.admin_token else ()

    def current_monitor_secrets(self) -> tuple[str, ...]:
        """``HIVE_MONITOR_TOKEN``, or every line of ``HIVE_MONITOR_TOKEN_FILE`` as it is now. Node
        tokens derived from any of them are accepted; new ones are issued from the first."""
        if self.monitor_token_file is not None:
            return _monitor_file.read(self.monitor_token_file)
        return (self.monitor_token,) if self.monitor_token else ()


def _accepted(annotation: Any) -> str:
    if annotation is bool:
        return " (accepted: 0/1, true/false, on/off, yes/no)"
    if annotation is float or annotation is int:
        return " (accepted: a number)"
    return ""


class _KeyFile:
    """A file of secrets, one a line, parsed again only when its modification time or size changed."""

    def __init__(self) -> None:
        self._stamp: tuple[Any, ...] | None = None
        self._keys: tuple[str, ...] = ()

    def read(self, path: Path | None) -> tuple[str, ...]:
        """Its non-empty lines that are not ``#`` comments, in order; none while it cannot be read."""
        if path is None:
            return ()
        try:
            st = path.stat()
            stamp = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
            # A file written twice within one mtime tick keeps its stamp: while the stamp is that
            # young, read it again ("racy" stamps, as git treats its index).
            if stamp != self._stamp or time.time() - st.st_mtime < RACY_S:
                lines = (line.strip() for line in path.read_text().splitlines())
                self._keys = tuple(dict.fromkeys(s for s in lines if s and not s.startswith("#")))
                self._stamp = stamp
        except (OSError, UnicodeDecodeError):
            self._stamp, self._keys = None, ()
        return self._keys


_key_file, _admin_file, _monitor_file = _KeyFile(), _KeyFile(), _KeyFile()


@lru_cache(maxsize=1)
def get_settings() -> HiveSettings:
    """This process's settings, read from its environment once. Called only at composition roots (a
    Serve deployment's constructor, a Ray actor's on its node, a CLI's main), which pass the settings,
    or the values they need, to what they build; ``tests/unit/test_layering.py`` lists the roots."""
    return HiveSettings.from_env()
