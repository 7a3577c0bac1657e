"""Reading one field of a Hugging Face config without guessing.

Configs name things variously (``_get`` tries aliases), and two shapes break code that expects
one number per model: a list where a number was expected (one value per layer), and
transformers 5's heterogeneous configs, whose per-layer attributes raise when read globally.
Both surface here as ``Unmodelled``, which the builder turns into a 422 naming the field.
"""

from __future__ import annotations

from typing import Any

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Sizes the model is built from (with their aliases): present, each must be positive. A zero or
# negative one is a broken config that would plan a negative or empty model, never "unset"
# (that is a missing key). ``head_dim`` is in SIZE_FIELDS too, but vLLM's ``get_head_size`` reads
# 0 as unset (some transformers configs write a missing head_dim as 0) and falls back.
SIZE_FIELDS = frozenset({
    "hidden_size", "d_model", "n_embd", "model_dim",
    "num_hidden_layers", "num_layers", "n_layer", "n_layers",
    "num_attention_heads", "num_heads", "n_head", "n_heads",
    "n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups",
    "head_dim", "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "vocab_size", "padded_vocab_size",
})
ZERO_MEANS_UNSET = frozenset({"head_dim"})


class Unmodelled(Exception):
    """The config has a shape the planner does not model exactly; ``how`` says what the user can do."""

    def __init__(self, what: str, how: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.how = how


def _is_per_layer_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "AmbiguousGlobalPerLayerAttributeError"


def get(cfg: Any, *names: str, default: Any = None) -> Any:
    """First non-None attribute (or dict key) among ``names``.

    A per-layer attribute of a heterogeneous transformers 5 config raises when read from the
    global config: that is ``Unmodelled`` (the field differs per layer), never a crash.
    """
    for name in names:
        try:
            value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        except RuntimeError as exc:
            if _is_per_layer_error(exc):
                raise Unmodelled(f"'{name}' differs per layer (per_layer_config)") from exc
            raise
        if value is not None:
            return value
    return default


def num(cfg: Any, *names: str, default: Any = None) -> Any:
    """A field vLLM reads as one number: a list there (one value per layer) is ``Unmodelled``, and so
    is a size of ``SIZE_FIELDS`` that is not positive."""
    value = get(cfg, *names)
    if value is None:
        return default
    name = _first_present(cfg, names)
    if isinstance(value, (list, tuple)):
        raise Unmodelled(f"'{name}' is a list of {len(value)} values (one per layer?) "
                         "where vLLM's model code for this architecture reads one number")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if name in SIZE_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool) and (
            value < 0 or (value == 0 and name not in ZERO_MEANS_UNSET)):
        raise Unmodelled(f"'{name}' is {value}, and a size the model is built from must be positive",
                         "fix config.json")
    return value


def _first_present(cfg: Any, names: tuple[str, ...]) -> str:
    for name in names:
        try:
            value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        except RuntimeError:
            return name
        if value is not None:
            return name
    return names[0]


def dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def is_heterogeneous(cfg: Any) -> bool:
    """A transformers 5 config with ``per_layer_config`` overrides (or the raw key on a generic config)."""
    if getattr(cfg, "is_heterogeneous", False):
        return True
    raw = cfg.get("per_layer_config") if isinstance(cfg, dict) else cfg.__dict__.get("per_layer_config")
    return bool(raw)


def per_layer_attributes(cfg: Any) -> set[str]:
    """The attributes a heterogeneous config overrides per layer."""
    attrs = getattr(cfg, "per_layer_attributes", None)
    if attrs:
        return set(attrs)
    raw = cfg.get("per_layer_config") if isinstance(cfg, dict) else cfg.__dict__.get("per_layer_config")
    out: set[str] = set()
    if isinstance(raw, dict):
        for overrides in raw.values():
            if isinstance(overrides, dict):
                out.update(k for k in overrides if k != "skip")
    return out


def layer_config(cfg: Any, i: int) -> Any:
    """Layer ``i``'s config: transformers' per-layer view, or the raw overrides laid over a generic config."""
    if getattr(cfg, "is_heterogeneous", False):
        return cfg.per_layer_config[i]
    raw = cfg.get("per_layer_config") if isinstance(cfg, dict) else cfg.__dict__.get("per_layer_config")
    if isinstance(raw, dict):
        overrides = next((v for k, v in raw.items() if str(k).lstrip("0") == str(i).lstrip("0")), None)
        if overrides:
            return _Overlay(cfg, overrides)
    return cfg


class _Overlay:
    """A config with some attributes replaced (raw ``per_layer_config`` of a config transformers cannot build)."""

    def __init__(self, base: Any, overrides: dict[str, Any]) -> None:
        self._base = base
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._base, name)
