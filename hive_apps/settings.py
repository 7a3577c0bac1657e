"""One settings object for the whole hive, read from the environment (``HIVE_*``).

Serve replicas inherit the environment of the Ray node they run on, so a value exported
before ``ray start`` (or set in a RayService container) reaches every hive deployment.
``serve_configs/hive.yaml`` documents each variable.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from hive_apps.engine.ports import parse_port_range

log = logging.getLogger("ray.serve")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


class HiveSettings(BaseModel):
    admin_token: str | None = Field(None, description="Bearer token for /admin (HIVE_ADMIN_TOKEN).")
    api_keys: list[str] = Field(default_factory=list, description="Keys for /v1 and /<model>/v1 (HIVE_API_KEYS, comma separated).")
    api_keys_file: Path | None = Field(None, description="A file with one API key per line (HIVE_API_KEYS_FILE).")
    auth_disabled: bool = Field(False, description="HIVE_AUTH_DISABLED=1 turns auth off where no token/key is set.")
    memory_budget_fraction: float = Field(0.90, gt=0, le=1, description="Share of each device's memory the hive may plan on.")
    monitor_interval_s: float = Field(1.0, gt=0, description="How often the registry samples every node's devices.")
    deploy_timeout_s: float = Field(900.0, gt=0, description="Deadline for every replica of a deploy to become ready.")
    pending_reservation_ttl_s: float = Field(960.0, gt=0, description="A reservation whose engine never comes up is freed after this.")
    self_heal: bool = Field(True, description="Replace replicas lost with their node (HIVE_SELF_HEAL=0 turns it off).")
    engine_http: bool = Field(True, description="Routers reach engines over each replica's own HTTP port (HIVE_ENGINE_HTTP=0: Serve handles only).")
    engine_port_range: tuple[int, int] | None = Field(
        None, description="HIVE_ENGINE_PORT_RANGE, e.g. 20000-20999: engine replicas listen on the first free port "
                          "of this range (for NetworkPolicies and firewalls); unset = any free port.")
    state_namespace: str = Field("ray-hive", description="Ray internal-KV namespace for durable state.")
    model_cache_dir: Path = Field(Path.home() / ".cache" / "ray-hive", description="Where built-in models are written.")

    @field_validator("engine_port_range", mode="before")
    @classmethod
    def _port_range(cls, value):
        return parse_port_range(value) if isinstance(value, str) else value

    @classmethod
    def from_env(cls) -> "HiveSettings":
        keys = _env("HIVE_API_KEYS")
        keys_file = _env("HIVE_API_KEYS_FILE")
        return cls(
            admin_token=_env("HIVE_ADMIN_TOKEN"),
            api_keys=[k.strip() for k in keys.split(",") if k.strip()] if keys else [],
            api_keys_file=Path(keys_file) if keys_file else None,
            auth_disabled=_env("HIVE_AUTH_DISABLED", "0").lower() in ("1", "true", "yes"),
            memory_budget_fraction=float(_env("HIVE_MEMORY_BUDGET_FRACTION", "0.90")),
            monitor_interval_s=float(_env("HIVE_MONITOR_INTERVAL_S", "1.0")),
            deploy_timeout_s=float(_env("HIVE_DEPLOY_TIMEOUT_S", "900")),
            pending_reservation_ttl_s=float(_env("HIVE_PENDING_RESERVATION_TTL_S", "960")),
            self_heal=_env("HIVE_SELF_HEAL", "1").lower() not in ("0", "false", "no"),
            engine_http=_env("HIVE_ENGINE_HTTP", "1").lower() not in ("0", "false", "no"),
            engine_port_range=_env("HIVE_ENGINE_PORT_RANGE"),
            state_namespace=_env("HIVE_STATE_NAMESPACE", "ray-hive"),
            model_cache_dir=Path(_env("HIVE_MODEL_CACHE_DIR", str(Path.home() / ".cache" / "ray-hive"))),
        )

    def current_api_keys(self) -> set[str]:
        """Keys from the environment plus the key file, read on every call so edits apply without restart."""
        keys = set(self.api_keys)
        if self.api_keys_file and self.api_keys_file.exists():
            keys.update(line.strip() for line in self.api_keys_file.read_text().splitlines() if line.strip())
        return keys


@lru_cache(maxsize=1)
def get_settings() -> HiveSettings:
    return HiveSettings.from_env()
