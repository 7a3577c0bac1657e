"""What the planner must know about a model, read from its Hugging Face config only.

No weights are read and nothing is downloaded. The package derives, the way vLLM 0.32 does (KV
bytes per token as its layers' ``get_kv_cache_spec`` compute them; weight bytes from the stored
tensors' sizes with each quantization format's packing, since vLLM measures them while loading):

* ``model.py``: the data model (``ModelProfile``, cache groups, parameters by role) and the
  figures derived from it: KV bytes per token, weights per rank, vLLM's block pool per request
  (cross-checked against vLLM's own spec code by tests/engine/test_kv_crosscheck.py);
* ``config.py``: reading a local folder, a cached Hugging Face name or a parsed dict; ``load.py``: the
  entry points (``load_profile``, ``profile_from_config_dict``) that read one and build its profile;
* ``fields.py``: reading one config field without guessing (per-layer lists and transformers 5
  per-layer configs become a 422 naming the field);
* ``quant.py``: which quantization config vLLM applies, packed weight sizes, the KV cache dtype;
* ``families/``: one class per architecture family, keyed by ``model_type``, that reads the
  layer layout (attention, sliding window, MLA, Mamba-2, gated delta net, shared caches) and
  counts parameters; the ``hive_attention_cls`` user hook is one more such class;
* ``towers.py``: vision and audio towers and the worst-case placeholder tokens of one item
  (token math in ``hive_apps/core/planning/multimodal.py``);
* ``vllm_registry.py``: the architectures vLLM 0.32 runs, and those it dropped;
* ``build.py``: the order the builder asks its questions in, and the 422s.

An architecture vLLM 0.32 does not run is refused at plan time, and a config the planner cannot
model exactly is a 422 naming what is unknown and how to supply it, never a smaller reservation.
Every ``hive_*`` key is the hive's, never vLLM's: the planner strips them from the engine kwargs.
"""

from hive_apps.core.planning.multimodal import MmItem, TowerInfo
from hive_apps.core.planning.profile.families import Family
from hive_apps.core.planning.profile.load import load_profile, profile_from_config_dict
from hive_apps.core.planning.profile.model import (
    VLLM_QUANTIZATION_METHODS,
    AttentionGroup,
    ModelProfile,
    ParamCounts,
    QuantScheme,
    StateGroup,
)

__all__ = [
    "AttentionGroup", "Family", "ModelProfile", "ParamCounts", "QuantScheme", "StateGroup", "TowerInfo", "MmItem",
    "VLLM_QUANTIZATION_METHODS", "load_profile", "profile_from_config_dict",
]
