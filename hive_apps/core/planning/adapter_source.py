"""A LoRA adapter read from its source and checked against its base, before anything is loaded.

The adapter's source is listed like a model's (``core/weights/listing.py``: the revision every replica
will load is pinned here), its ``adapter_config.json`` fetched into the planner's metadata cache, and its
``adapter_model.safetensors`` header read in place (``core/weights/header.py``): names and shapes only.
The base is profiled from its own pinned revision; ``lora.check_adapter`` decides. No Ray here: the
planner runs it in its worker process, under the plan deadline.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from hive_apps.core.planning.lora import AdapterError, AdapterInfo, check_adapter, parse_adapter_config
from hive_apps.core.planning.source_profile import load_source_profile
from hive_apps.core.planning.types import PlanningError
from hive_apps.core.spec import AdapterSpec, ModelSpec
from hive_apps.core.weights.types import Manifest, SourceError, SourceKind

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterCheck(BaseModel):
    """The planner's answer about one adapter: what it is and the revision pinned, or why it cannot serve."""

    info: AdapterInfo | None = None
    weights: Manifest | None = None
    error: str = ""
    status_code: int = 200
    field: str = "source"  # the body field the problem is about


def read_adapter(spec: AdapterSpec, base: ModelSpec, base_weights: Manifest | None, *,
                 metadata: Path | None) -> tuple[AdapterInfo, Manifest]:
    """The adapter's figures and pinned manifest; ``AdapterError`` (a 4xx) when it does not fit the base."""
    from hive_apps.core.weights.header import read_header
    from hive_apps.core.weights.listing import fetch_metadata, list_source
    from hive_apps.core.weights.source import parse_source

    try:
        manifest = list_source(parse_source(spec.source))
        files = {f.path for f in manifest.files}
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if f not in files]
        if missing:
            raise AdapterError(f"{spec.source} is not a LoRA adapter the hive serves: it lacks {', '.join(missing)} "
                               "(a PEFT adapter saved with safe_serialization)")
        if manifest.source.kind is SourceKind.LOCAL:
            folder = Path(manifest.source.location)
        elif metadata is None:
            raise AdapterError(f"{spec.source!r} is not a folder and this planner has no metadata cache", 500)
        else:
            folder = fetch_metadata(manifest, metadata)
        try:
            raw = (folder / CONFIG_FILE).read_bytes()
        except OSError as e:
            raise AdapterError(f"{spec.source}: {CONFIG_FILE} cannot be read: {e.strerror or e}") from None
        config = parse_adapter_config(raw)
        tensors = {name: t.shape for name, t in read_header(manifest, WEIGHTS_FILE).items()}
    except SourceError as e:
        raise AdapterError(e.message, e.status_code) from None
    try:
        profile, _ = load_source_profile(base.model, base.vllm_kwargs, base_weights, metadata=metadata)
    except PlanningError as e:
        raise AdapterError(f"the base {base.model_id!r} cannot be profiled: {e.message}", e.status_code) from None
    info = check_adapter(config, tensors, profile, base.lora,
                         [base.model, profile.architecture, profile.model_type])
    # the files an engine loads, and no others: what a node fetches, and what travels with each request
    # to the engine (serving/engine/protocol.py AdapterRef)
    return info, manifest.model_copy(update={"files": [f for f in manifest.files if f.path in (CONFIG_FILE, WEIGHTS_FILE)]})


def adapter_or_error(spec: AdapterSpec, base: ModelSpec, base_weights: Manifest | None,
                     metadata: Path | None) -> AdapterCheck:
    """``read_adapter`` as the planner answers it: never raises for a bad adapter or config."""
    try:
        info, manifest = read_adapter(spec, base, base_weights, metadata=metadata)
        return AdapterCheck(info=info, weights=manifest)
    except AdapterError as e:
        return AdapterCheck(error=e.message, status_code=e.status_code, field=e.field)
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, RecursionError, OSError) as e:
        return AdapterCheck(error=f"the adapter {spec.source!r} cannot be checked ({type(e).__name__}: {e})",
                            status_code=422)
