"""A model's profile from where its weights live, reading metadata only.

The planner lists the source (file names, sizes, checksums, the revision it resolves to) and
fetches the few small files it reads (``config.json`` and the quantization, processor and
tokenizer configs) into its own node's metadata cache; the weights are never downloaded here.
The weight bytes the plan and the disk check use come from the listing. A folder source is read
where the planner runs, as before; every node an engine lands on checks its own copy later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hive_apps.core.planning.profile import load_profile
from hive_apps.core.planning.profile.model import ModelProfile
from hive_apps.core.planning.types import PlanningError
from hive_apps.core.weights.types import Manifest, SourceError, SourceKind

METADATA_DIR = "meta"


def metadata_dir(weights_cache: Path) -> Path:
    """Where the planner keeps the metadata files it fetched, in its node's weight cache (HIVE_WEIGHTS_CACHE)."""
    return Path(weights_cache) / METADATA_DIR


def load_source_profile(model: str, vllm_kwargs: dict[str, Any] | None = None,
                        weights: Manifest | None = None, *, metadata: Path | None) -> tuple[ModelProfile, Manifest]:
    """``weights``: the manifest a deploy already pinned (a wake, a heal, a replica added for load):
    planned again from the same revision, without asking the source. ``metadata``: the folder the
    metadata of a Hub or S3 source is fetched into (``metadata_dir``); None plans folder sources only."""
    from hive_apps.core.weights.listing import fetch_metadata, list_source
    from hive_apps.core.weights.source import parse_source

    try:
        source = parse_source(model)
        manifest = weights if weights is not None and weights.source == source else list_source(source)
        if source.kind is SourceKind.LOCAL:
            return load_profile(source.location, vllm_kwargs), manifest
        if metadata is None:
            raise PlanningError(f"{model!r} is not a folder and this planner has no metadata cache to read it into", 500)
        folder = fetch_metadata(manifest, metadata)
    except SourceError as e:
        raise PlanningError(e.message, e.status_code) from e
    profile = load_profile(str(folder), vllm_kwargs)
    return profile.model_copy(update={"model": model,
                                      "checkpoint_bytes": profile.checkpoint_bytes or manifest.weight_bytes}), manifest
