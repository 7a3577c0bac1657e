"""Durable key-value state in Ray's GCS (internal KV), so registry restarts lose nothing."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel
from ray.experimental import internal_kv

T = TypeVar("T", bound=BaseModel)


class StateStore:
    def __init__(self, namespace: str):
        self.namespace = namespace

    def put(self, key: str, value: BaseModel) -> None:
        internal_kv._internal_kv_put(key, value.model_dump_json(), overwrite=True, namespace=self.namespace)

    def delete(self, key: str) -> None:
        internal_kv._internal_kv_del(key, namespace=self.namespace)

    def load_all(self, prefix: str, model: type[T]) -> list[T]:
        out = []
        for key in internal_kv._internal_kv_list(prefix, namespace=self.namespace):
            raw = internal_kv._internal_kv_get(key, namespace=self.namespace)
            if raw is not None:
                out.append(model.model_validate_json(raw))
        return out
