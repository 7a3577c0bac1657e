"""Typed inputs and outputs of the planner: what a device can give, and what a replica gets."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from hive_apps.core.devices import Device, DeviceKind
from hive_apps.core.weights.types import Manifest


class DeviceCapacity(BaseModel):
    """A device as the planner sees it: the registry's view of what the hive may still use."""

    device: Device
    available_bytes: int  # budget_fraction x total - hive reservations - foreign usage, floored at 0
    free_bytes: int  # what is free on the device now (vLLM's start check compares against this)
    hive_replicas: list[str] = Field(default_factory=list)  # "<model_id>/r<k>" already here


class EngineSettings(BaseModel):
    """The vLLM engine arguments the planner owns; merged over the user's vllm_kwargs."""

    tensor_parallel_size: int = 1
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int
    enforce_eager: bool = False


class MemoryBreakdown(BaseModel):
    """Planned bytes on each device of a replica (per tensor-parallel rank)."""

    weights: int
    kv_cache: int
    activations: int
    overhead: int  # CUDA context, CUDA graphs, runtime buffers (CPU: process overhead)
    lora: int = 0  # LoRA slots and punica buffers (on a CPU device also its adapter cache): core/planning/lora.py
    cuda_graphs: int = 0  # the CUDA-graph pool, a part of overhead: what the loaded-drift check compares

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.overhead + self.lora


class ReplicaPlan(BaseModel):
    index: int
    node_id: str
    node_name: str
    devices: list[str]  # device ids, one per TP rank
    device_kind: DeviceKind
    device_indices: list[int] = Field(default_factory=list)  # CUDA indices for CUDA_VISIBLE_DEVICES
    settings: EngineSettings
    memory: MemoryBreakdown
    reservation_bytes: int  # reserved on each device of the replica (= memory.total)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)  # final vLLM args: user kwargs + settings
    expected_tokens_per_s: float | None = None  # the planner's throughput estimate
    notes: list[str] = Field(default_factory=list)  # e.g. a dtype fallback, a CPU fallback


class Rejection(BaseModel):
    device: str
    reason: str


class ProfileSummary(BaseModel):
    architecture: str
    model_type: str
    path: str  # the folder the planner read the config from (on its own node; engines resolve their own)
    runner: str  # "generate" | "pooling"
    dtype: str
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    max_position_embeddings: int | None = None
    mm_tokens_per_item: dict[str, int] = Field(default_factory=dict)  # worst-case placeholders per item
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=dict)  # items per prompt the plan allows


class Plan(BaseModel):
    model_id: str
    model: str
    engine: str
    profile: ProfileSummary
    replicas: list[ReplicaPlan]
    rejected: list[Rejection] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)  # model-level remarks (dtype downcast, MM budget)
    expected_tokens_per_s: float | None = None  # sum over replicas of the planner's roofline estimate
    planned_concurrency: int | None = None  # sum over replicas of max_num_seqs
    weights: Manifest | None = None  # the files and revision every replica loads (None: a plan from before sources)


class PlanningError(Exception):
    """The request cannot be planned; ``status_code`` is the HTTP status the admin answers."""

    def __init__(self, message: str, status_code: int = 422, rejected: list[Rejection] | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.rejected = rejected or []


class MmContextError(PlanningError):
    """The model's context cannot hold the worst-case multimodal placeholders plus the output (422)."""

    def __init__(self, message: str, knobs: list[str] | None = None):
        super().__init__(message, 422)
        self.knobs = list(knobs or [])
