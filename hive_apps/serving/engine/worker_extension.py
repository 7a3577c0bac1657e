"""What each vLLM worker loaded, read inside the worker through vLLM's own extension hook.

vLLM adds the methods of ``worker_extension_cls`` to its worker class (``WorkerWrapperBase``), so
``AsyncLLM.collective_rpc("hive_loaded_bytes")`` runs them on every rank by name: no pickled
callable (vLLM refuses those unless ``VLLM_ALLOW_INSECURE_SERIALIZATION``). The engine replica
compares the answer with its plan (``core/planning/drift.py``). This module is imported in the
worker process, where vLLM and torch are already loaded; the control plane never imports it.
"""

from __future__ import annotations

from typing import Any


class HiveWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``model_runner``)."""

    model_runner: Any

    def hive_loaded_bytes(self) -> dict[str, int | None]:
        """This rank's weights as vLLM measured their load ("Model loading took": the V1 and V2 GPU
        runners keep it as ``model_memory_usage``) and, on CUDA, the CUDA-graph pool vLLM captured
        into. None where vLLM has no such figure: its CPU runner measures no load, and its oneDNN
        path repacks linear weights outside torch's parameters, so counting them would be wrong."""
        weights = getattr(self.model_runner, "model_memory_usage", None)
        return {"weights_bytes": int(weights) if weights is not None else None,
                "cuda_graph_bytes": _graph_pool_bytes()}


    def hive_opened_device(self) -> dict[str, str]:
        """The CUDA device this rank opened, by UUID and name (``cuda_devices.opened_gpus`` compares)."""
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"uuid": str(props.uuid), "name": str(props.name)}


def _graph_pool_bytes() -> int | None:
    """Bytes of the segments torch's allocator holds for vLLM's global CUDA-graph pool (None on
    CPU, or before any graph was captured: eager)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from vllm.platforms import current_platform

    pool = type(current_platform)._global_graph_pool  # set by get_global_graph_pool() at the first capture
    if pool is None:
        return None
    pool_id = tuple(pool)
    return sum(int(s["total_size"]) for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == pool_id)
