"""The deploy request: what a user asks for in ``POST /admin/models`` and ``POST /admin/plan``.

It is shared by the admin (validation), the planner (sizing) and the registry (the record
of a model), so it lives outside any one subsystem. Every field error names the field and
how to fix it, because that text is what the user sees in the 4xx body.

Two kinds of checks, and which run depends on the pydantic validation context:

* shape, always: field types and bounds, the model id slug, device names, a source the hive can
  parse (no ``..``), and the ``vllm_kwargs`` rules no setting changes (value types, the keys the
  hive never passes on, sim-engine keys, vLLM's old ``task``), ``aliases`` as slugs, and the
  ``env`` names and values no setting allows (``core/engine_env.py``);
* the operator's policy, only when the context carries the settings (``context={SETTINGS:
  settings}``, or ``ModelSpec.under_policy(body, settings)``): a folder under HIVE_MODEL_ROOT,
  the ``vllm_kwargs`` HIVE_VLLM_KWARGS_ALLOW, HIVE_TRUST_REMOTE_CODE and HIVE_HOOK_PACKAGES
  allow, and the ``env`` names HIVE_ENGINE_ENV_ALLOW allows.

A spec built without settings in context (in code, in a unit test, unpickled, a stored record
re-read) is checked for shape only: the policy is today's, and it binds what a user sends now.
So every place a request body becomes a ``ModelSpec`` validates it ``under_policy``: each admin route
that takes a spec (``control/admin/ingress.py``) and each declared model (``control/admin/declared.py``);
``tests/unit/control/test_admin_policy.py`` checks the routes. A stored record is
read back with ``STORED`` (``core/state/records.py``) and never refused by today's policy; the
registry passes its settings there too, so one the policy would refuse now keeps running with
the reason in its status (``ModelRecord.policy_warning``).
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hive_apps.core.engine_env import engine_env_problems
from hive_apps.core.settings import HiveSettings
from hive_apps.core.vllm_args import vllm_kwargs_problems

RESERVED_MODEL_IDS = frozenset({"admin", "v1", "docs", "openapi.json", "metrics", "healthz"})
RESERVED_PREFIX = "hive-"
MODEL_ID_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # matched in full: "admin\n" is no slug
DEVICE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+:(gpu\d+|cpu)$")
SETTINGS: Final = "settings"  # validation context key: the HiveSettings whose operator policy applies


def policy_of(info: ValidationInfo) -> HiveSettings | None:
    """The settings whose policy this validation checks; None: shape checks only (module docstring)."""
    settings = (info.context or {}).get(SETTINGS)
    if settings is not None and not isinstance(settings, HiveSettings):
        raise TypeError(f"validation context {SETTINGS!r} must be HiveSettings, got {type(settings).__name__}")
    return settings


def checked_source(v: str, settings: HiveSettings | None) -> str:
    """A source the hive can fetch from (``hive_apps/core/weights/source.py``); under a policy, a
    folder must lie under the operator's model root when one is set. The message is the same
    whether or not the path exists, so it tells nothing about the node's files. Model weights and
    LoRA adapters (``AdapterSpec.source``) are checked alike."""
    from hive_apps.core.weights.source import parse_source
    from hive_apps.core.weights.types import SourceError, SourceKind

    if ".." in Path(v).parts:
        raise ValueError("must not contain '..'; name a folder, a Hub repo or an s3:// prefix")
    try:
        source = parse_source(v)
    except SourceError as e:
        raise ValueError(e.message) from None
    root = settings.model_root if settings is not None else None
    if root is None or source.kind is not SourceKind.LOCAL:
        return v
    if not Path(source.location).resolve().is_relative_to(root.resolve()):
        raise ValueError(f"must be a folder under the model root {root} (HIVE_MODEL_ROOT), "
                         "a Hugging Face Hub repo or an s3:// prefix")
    return v


def checked_model_id(v: str) -> str:
    """A name a model or an adapter may take: a lowercase slug the hive does not reserve."""
    if not MODEL_ID_RE.fullmatch(v):
        raise ValueError(
            "must be a lowercase slug (a-z, 0-9, '-', 1-63 chars, starting and ending "
            f"with a letter or digit), got {v!r}; for example 'qwen3-8b'"
        )
    if v in RESERVED_MODEL_IDS or v.startswith(RESERVED_PREFIX):
        raise ValueError(
            f"{v!r} is reserved (names {sorted(RESERVED_MODEL_IDS)} and the prefix "
            f"'{RESERVED_PREFIX}' belong to the hive); choose another model_id"
        )
    return v


# vLLM 0.32's LoRAConfig.max_lora_rank: one of these (``vllm/config/lora.py`` MaxLoRARanks)
LORA_RANKS: Final = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORAS: Final = 256  # LoRA slots per engine the hive accepts (each costs memory on every device)
MAX_ALIASES: Final = 16  # other names of one model on /v1 (each is a name the namespace holds for it)


class LoraSpec(BaseModel):
    """``lora`` of a deploy: the base serves LoRA adapters (``POST /admin/adapters``, docs/lora.md).

    The planner turns it into vLLM's ``enable_lora``, ``max_loras``, ``max_lora_rank`` and
    ``max_cpu_loras`` and counts the memory of the slots and of the punica buffers in the plan and the
    reservation (``core/planning/lora.py``)."""

    model_config = ConfigDict(extra="forbid")

    max_loras: int = Field(4, ge=1, le=MAX_LORAS, description="Adapters one batch may mix: the LoRA slots on each "
                                                              "device (vLLM max_loras), each of max_lora_rank.")
    max_lora_rank: int = Field(16, description=f"The highest adapter rank this base takes (vLLM max_lora_rank): "
                                               f"one of {', '.join(map(str, LORA_RANKS))}.")
    max_cpu_loras: int | None = Field(None, ge=1, le=4096,
                                      description="Adapters each replica keeps loaded (vLLM's CPU cache, the "
                                                  "engine's LRU); default max_loras. At least max_loras.")

    @field_validator("max_lora_rank")
    @classmethod
    def _a_vllm_rank(cls, v: int) -> int:
        if v not in LORA_RANKS:
            higher = [r for r in LORA_RANKS if r >= v]
            hint = f"; the next one up is {higher[0]}" if higher else ""
            raise ValueError(f"must be one of vLLM's ranks {', '.join(map(str, LORA_RANKS))}, got {v}{hint}")
        return v

    @model_validator(mode="after")
    def _cpu_holds_the_slots(self) -> LoraSpec:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} is below max_loras={self.max_loras}: every adapter "
                             "in a slot is also loaded; raise max_cpu_loras or leave it out")
        return self

    @property
    def cpu_loras(self) -> int:
        """Adapters a replica keeps loaded (what vLLM defaults max_cpu_loras to)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's arguments for these settings (max_cpu_loras always explicit)."""
        return {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "max_cpu_loras": self.cpu_loras}


class AdapterSpec(BaseModel):
    """Body of ``POST /admin/adapters``: a LoRA adapter served on a base that has ``lora``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_id: str = Field(description="The adapter's own name: clients send it as 'model' on /v1. Unique among "
                                      "models and adapters.")
    base: str = Field(description="The model_id of a deployed model with 'lora' set.")
    source: str = Field(description="Where the adapter is (adapter_config.json and adapter_model.safetensors): a "
                                    "Hub repo 'org/name[@revision]', 's3://bucket/prefix' or an absolute folder, as "
                                    "a model's weights (docs/weights.md).")

    @classmethod
    def under_policy(cls, body: Any, settings: HiveSettings) -> AdapterSpec:
        """Checked for shape and against the operator's policy (a folder under HIVE_MODEL_ROOT)."""
        return cls.model_validate(body, context={SETTINGS: settings})

    @field_validator("model_id")
    @classmethod
    def _id_is_a_free_slug(cls, v: str) -> str:
        return checked_model_id(v)

    @field_validator("base")
    @classmethod
    def _base_is_a_slug(cls, v: str) -> str:
        if not MODEL_ID_RE.fullmatch(v):
            raise ValueError(f"must be the model_id of a deployed model (GET /admin/models), got {v!r}")
        return v

    @field_validator("source")
    @classmethod
    def _source_is_a_source(cls, v: str, info: ValidationInfo) -> str:
        return checked_source(v, policy_of(info))

    @model_validator(mode="after")
    def _not_its_own_base(self) -> AdapterSpec:
        if self.model_id == self.base:
            raise ValueError(f"model_id {self.model_id!r} is the base's own name; give the adapter a name of its own")
        return self


class EngineKind(str, Enum):
    VLLM = "vllm"
    SIM = "sim"


class Allocation(str, Enum):
    """The built-in policies by which auto placement ranks devices.

    A user policy is named by class path in ``vllm_kwargs["hive_placement_policy"]``
    (``hive_apps/core/planning/placement.py`` documents the interface); it replaces this field.
    """

    PERFORMANCE = "performance"
    CONSERVE_TDP = "conserve_tdp"


class Routing(str, Enum):
    """How the model's router and the gateway pick a replica (``serving/routing/prefix.py``)."""

    PREFIX = "prefix"  # the replica likely to hold the prompt's prefix in its cache, while it has planned room
    LEAST_LOADED = "least_loaded"  # the lowest load relative to planned capacity, prefix ignored


class ModelSpec(BaseModel):
    """Body of ``POST /admin/models`` and ``POST /admin/plan``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_id: str = Field(description="Unique slug; the model's route is /<model_id> and its OpenAI name.")
    model: str = Field(description="Where the weights are: a Hugging Face Hub repo 'org/name' or 'org/name@revision' "
                                   "(a branch, tag or commit), 's3://bucket/prefix', or an absolute folder that every "
                                   "node an engine may run on has (a shared volume). Each node fetches the weights "
                                   "into its own cache before its engine starts (docs/weights.md).")
    max_input_prompt_length: int = Field(1024, ge=1, le=1_048_576)
    max_output_prompt_length: int = Field(256, ge=0, le=1_048_576)
    replicas: int = Field(1, description=">= 1, or -1 for one replica on every eligible device.")
    gpu: str | list[str] | None = Field(
        None, description='null (auto), "node:gpuN" (pin), or a list of pins.'
    )
    allocation: Allocation = Field(
        Allocation.PERFORMANCE,
        description='Built-in placement policy; a user policy goes in vllm_kwargs["hive_placement_policy"] '
                    '= "package.module.ClassName" and replaces it.',
    )
    sleep_timeout: float | None = Field(
        None, gt=0, le=30 * 86400,
        description="Seconds without requests after which the model sleeps (parks: engines removed, memory "
                    "released, route and plan kept); the next request wakes it. A model with a sleep_timeout may "
                    "also be put to sleep to make room for another model (docs/lifecycle.md).",
    )
    idle_timeout: float | None = Field(
        None, gt=0, le=365 * 86400,
        description="Seconds without requests after which the model is destroyed (apps and memory released, "
                    "status 'destroyed'); must be greater than sleep_timeout when both are set.",
    )
    priority: int = Field(
        0, ge=-1000, le=1000,
        description="Among models that can sleep, higher is evicted later when room must be made. Needs sleep_timeout.",
    )
    keep_resident: bool = Field(
        False, description="Never put to sleep to make room for another model (its own sleep_timeout still applies). "
                           "Needs sleep_timeout: models without one are never evicted anyway.",
    )
    min_replicas: int | None = Field(
        None, ge=1, le=1024,
        description="With max_replicas: the fewest replicas load may scale the model down to (default: replicas).",
    )
    max_replicas: int | None = Field(
        None, ge=1, le=1024,
        description="Turns on load-driven replicas: another replica is placed when every replica stays above 80 % of "
                    "its planned capacity for HIVE_SCALE_WINDOW_S, one is drained and removed below 20 %.",
    )
    engine: EngineKind = EngineKind.VLLM
    max_queued_requests: int | None = Field(
        None, ge=0,
        description="Requests that may wait once every replica is full; more get 429. Default: the largest replica's max_num_seqs.",
    )
    max_concurrency: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Requests the model must serve at once, over all replicas (split evenly, rounded up). The "
                    "planner sizes max_num_seqs and the KV cache for that instead of the most a card allows, "
                    "prefers devices that hold it, and reports the tokens/s it plans for. Cannot be combined "
                    "with vllm_kwargs.max_num_seqs.",
    )
    routing: Routing = Field(
        Routing.PREFIX,
        description="prefix: send a request to the replica most likely to hold its prompt's prefix in the prefix "
                    "cache, unless that replica is past its planned capacity; least_loaded: ignore prefixes.",
    )
    lora: LoraSpec | None = Field(
        None, description="Serve LoRA adapters on this model (POST /admin/adapters): {max_loras, max_lora_rank, "
                          "max_cpu_loras}. The planner gives vLLM its LoRA settings and books the memory of the slots "
                          "(docs/lora.md). Generative models only.",
    )
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)
    aliases: list[str] = Field(
        default_factory=list,
        description=f"Other names clients may send as 'model' on /v1 and /<model_id>/v1 (at most {MAX_ALIASES}), "
                    "listed in GET /v1/models beside the model_id; each a slug like model_id, unique among models, "
                    "their aliases and LoRA adapters. Requests are served as model_id. Changes in place (PUT).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the model's engine processes: tuning knobs the hive allows "
                    "(hive_apps/core/engine_env.py) or the operator adds with HIVE_ENGINE_ENV_ALLOW; device pins, "
                    "credentials and the hive's own variables are refused. Changing them starts new engines.",
    )

    @classmethod
    def under_policy(cls, body: Any, settings: HiveSettings) -> ModelSpec:
        """A deploy body as a user sent it (a dict, or the fields a shape-only parse set), checked for
        shape and against the operator's policy in ``settings``. Raises ``ValidationError``."""
        return cls.model_validate(body, context={SETTINGS: settings})

    @field_validator("model")
    @classmethod
    def _model_is_a_source(cls, v: str, info: ValidationInfo) -> str:
        return checked_source(v, policy_of(info))

    @field_validator("model_id")
    @classmethod
    def _model_id_is_a_free_slug(cls, v: str) -> str:
        return checked_model_id(v)

    @field_validator("replicas")
    @classmethod
    def _replicas_positive_or_all(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be >= 1, or -1 for every eligible device; got {v}")
        return v

    @field_validator("gpu")
    @classmethod
    def _gpu_names_are_device_ids(cls, v: str | list[str] | None) -> str | list[str] | None:
        names = [v] if isinstance(v, str) else (v or [])
        if isinstance(v, list) and not v:
            raise ValueError("an empty list pins nothing; use null for automatic placement")
        for name in names:
            if not DEVICE_ID_RE.match(name):
                raise ValueError(
                    f"{name!r} is not a device name; use '<node>:gpu<index>' (or '<node>:cpu') "
                    "as listed by GET /admin/gpus"
                )
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError("lists the same device twice; name each device once")
        return v

    @field_validator("vllm_kwargs")
    @classmethod
    def _vllm_kwargs_allowed(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Only the arguments the hive understands, typed (``hive_apps/core/vllm_args.py``); the ones
        the operator must allow only under a policy (settings in the validation context)."""
        engine = info.data.get("engine", EngineKind.VLLM)
        problems = vllm_kwargs_problems(v, getattr(engine, "value", engine), policy_of(info))
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases_are_free_slugs(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if info.data.get("model_id") in v:
            raise ValueError(f"lists the model_id {info.data['model_id']!r}, the model's name already; drop it")
        if len(v) > MAX_ALIASES:
            raise ValueError(f"lists {len(v)} aliases; at most {MAX_ALIASES}")
        for alias in v:
            try:
                checked_model_id(alias)
            except ValueError as e:
                raise ValueError(f"alias {alias!r}: {str(e).replace('model_id', 'alias')}") from None
        if len(set(v)) != len(v):
            raise ValueError("lists the same alias twice; name each alias once")
        return v

    @field_validator("env")
    @classmethod
    def _env_allowed(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """Names the hive never passes on always refused; the operator's allow-list only under a policy."""
        problems = engine_env_problems(v, policy_of(info))
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _pins_match_replicas(self) -> ModelSpec:
        if isinstance(self.gpu, list) and self.replicas not in (1, len(self.gpu)):
            raise ValueError(
                f"gpu lists {len(self.gpu)} devices but replicas={self.replicas}: use "
                f"replicas={len(self.gpu)} for one replica per device, or replicas=1 for one "
                "tensor-parallel replica over all of them"
            )
        if isinstance(self.gpu, str) and self.replicas != 1:
            raise ValueError(
                f"gpu pins one device but replicas={self.replicas}: pin a list of devices, "
                "or set replicas=1"
            )
        return self

    @model_validator(mode="after")
    def _one_way_to_size_sequences(self) -> ModelSpec:
        if self.max_concurrency is not None and "max_num_seqs" in self.vllm_kwargs:
            raise ValueError(
                f"max_concurrency={self.max_concurrency} and vllm_kwargs.max_num_seqs="
                f"{self.vllm_kwargs['max_num_seqs']} both size the sequences; keep one (max_concurrency is "
                "split over the replicas, max_num_seqs is per replica and taken as is)"
            )
        return self

    @model_validator(mode="after")
    def _lifecycle_fields_agree(self) -> ModelSpec:
        if self.sleep_timeout is not None and self.idle_timeout is not None and self.idle_timeout <= self.sleep_timeout:
            raise ValueError(
                f"idle_timeout={self.idle_timeout:g} must be greater than sleep_timeout={self.sleep_timeout:g}: "
                "a model sleeps first and is destroyed later; raise idle_timeout or drop one of them")
        for name in ("priority", "keep_resident"):
            if name in self.model_fields_set and self.sleep_timeout is None and getattr(self, name) != type(getattr(self, name))():
                raise ValueError(
                    f"{name} only orders or prevents evictions, and only models with a sleep_timeout are ever "
                    f"evicted; set sleep_timeout too, or leave {name} out")
        return self

    @model_validator(mode="after")
    def _replica_bounds(self) -> ModelSpec:
        if self.min_replicas is not None and self.max_replicas is None:
            raise ValueError("min_replicas needs max_replicas (load-driven replicas are on only with max_replicas); "
                             "set max_replicas too, or leave min_replicas out")
        if self.max_replicas is None:
            return self
        if self.gpu is not None or self.replicas == -1:
            raise ValueError("max_replicas scales replicas the hive places; it cannot be combined with gpu pins or "
                             "replicas=-1")
        low = self.min_replicas if self.min_replicas is not None else self.replicas
        if not low <= self.replicas <= self.max_replicas:
            raise ValueError(f"need min_replicas <= replicas <= max_replicas, got {low} <= {self.replicas} <= "
                             f"{self.max_replicas}")
        return self

    @model_validator(mode="after")
    def _lora_on_a_generator(self) -> ModelSpec:
        pooling = self.vllm_kwargs.get("runner") == "pooling" or "task" in self.vllm_kwargs
        if self.lora is not None and pooling:
            raise ValueError("lora serves adapters on a generating model; this deploy runs as a pooling model "
                             "(vllm_kwargs runner='pooling' or task): drop lora, or the pooling runner")
        return self

    @property
    def replica_bounds(self) -> tuple[int, int] | None:
        """(fewest, most) replicas load may move the model between; None when scaling is off."""
        if self.max_replicas is None:
            return None
        return (self.min_replicas if self.min_replicas is not None else self.replicas), self.max_replicas

    @property
    def can_sleep(self) -> bool:
        return self.sleep_timeout is not None

    @property
    def pins(self) -> list[str]:
        return [self.gpu] if isinstance(self.gpu, str) else list(self.gpu or [])
