"""Quantization: which quantization config vLLM 0.32 applies, the packed weight size, the KV cache dtype.

Where vLLM finds the config (``transformers_utils/config.py::get_config`` and
``ModelArchConfigConvertorBase._normalize_quantization_config``): ``quantization_config`` (or
``compression_config``) of config.json, then of its ``text_config``; only when config.json has
none, a ModelOpt ``hf_quant_config.json`` side file. vLLM marks that file as ModelOpt only when
its ``producer.name`` is ``"modelopt"`` (or it has a legacy ``quantization.modelopt_quant_config``);
a side file without that marker gets no quantization method, so vLLM applies neither its weight
format nor its KV cache dtype. AutoGPTQ's ``quantize_config.json`` is read only when the deploy
names a GPTQ/AWQ method (``get_quant_config`` looks for it then).

The KV cache dtype with ``kv_cache_dtype="auto"`` (``utils/torch_utils.py::resolve_kv_cache_dtype_string``):
a ModelOpt config's ``kv_cache_quant_algo`` / ``kv_cache_scheme`` ("fp8" -> ``fp8_e4m3``); a
compressed-tensors ``kv_cache_scheme`` makes the attention layer use fp8 (``attention.py``);
otherwise the model dtype.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from typing import Any

from hive_apps.core.planning.profile.config import read_json
from hive_apps.core.planning.profile.fields import DTYPE_BYTES, Unmodelled, dtype_name, get
from hive_apps.core.planning.profile.model import QuantScheme

# KV cache element sizes by vLLM ``kv_cache_dtype`` whose page is dense (vllm/utils/torch_utils.py
# STR_DTYPE_TO_TORCH_DTYPE; fp8 variants are stored as uint8). MLA packed formats have a fixed size per token.
KV_DTYPE_BYTES: dict[str, float] = {
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
}
MLA_PACKED_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}  # research note §A2
# modelopt kv_cache_quant_algo -> vLLM cache dtype (torch_utils.MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP)
_MODELOPT_KV = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}
_MODELOPT_FP8_ALGOS = {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"}


def quantization_config(cfg: Any, text: Any, raw: dict[str, Any], folder: str, vllm_kwargs: dict[str, Any],
                        notes: list[str]) -> dict[str, Any] | None:
    """The quantization config vLLM applies, normalized as vLLM normalizes it (``quant_method`` set)."""
    q = None
    for c in (cfg, text):
        found = get(c, "quantization_config") or get(c, "compression_config")
        if found is not None:
            q = dict(found) if isinstance(found, dict) else found.to_dict()
            break
    if q is None and raw.get("quantization_config") is None:
        side = read_json(folder, "hf_quant_config.json")
        if side:
            q = dict(side)
            if not _is_modelopt(q):
                notes.append("hf_quant_config.json does not name ModelOpt as its producer, so vLLM 0.32 applies "
                             "neither its weight format nor its KV cache dtype: both sized unquantized")
                return None
    if q is None:
        online = str(vllm_kwargs.get("quantization") or "").lower()
        if online in ("gptq", "gptq_marlin", "awq", "awq_marlin", "auto_gptq", "auto_awq"):
            legacy = read_json(folder, "quantize_config.json")  # AutoGPTQ's own file
            if legacy and legacy.get("bits"):
                q = dict(legacy)
                q.setdefault("quant_method", "awq" if "awq" in online else "gptq")
        if q is None:
            return None
    if _is_modelopt(q):
        algo = str((q.get("quantization") or {}).get("quant_algo") or q.get("quant_algo") or "").upper()
        if algo in _MODELOPT_FP8_ALGOS:
            q["quant_method"] = "modelopt"
        elif algo == "NVFP4":
            q["quant_method"] = "modelopt_fp4"
        elif algo:
            raise Unmodelled(f"ModelOpt quant_algo {algo!r} (vLLM 0.32 refuses it: 'Unknown ModelOpt quant algo')",
                             "use a ModelOpt FP8 or NVFP4 checkpoint")
    q["quant_method"] = str(q.get("quant_method") or "").lower().replace("compressed_tensors", "compressed-tensors")
    return q


def _is_modelopt(q: dict[str, Any]) -> bool:
    producer = q.get("producer")
    inner = q.get("quantization")
    return ((isinstance(producer, dict) and producer.get("name") == "modelopt")
            or (isinstance(inner, dict) and "modelopt_quant_config" in inner)
            or str(q.get("quant_method") or "").lower().startswith("modelopt"))


def kv_cache_dtype(requested: Any, q: dict[str, Any] | None, notes: list[str]) -> str:
    """vLLM's resolved ``cache_dtype``: the deploy's choice, else what the checkpoint asks for, else "auto"."""
    name = str(requested or "auto").lower()
    if name != "auto":
        return name
    if not q:
        return "auto"
    method = q.get("quant_method", "")
    if method.startswith("modelopt"):
        inner: dict[str, Any] = q["quantization"] if isinstance(q.get("quantization"), dict) else q
        algo = (inner.get("kv_cache_scheme") or q.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
                or q.get("kv_cache_quant_algo"))
        if isinstance(algo, dict):
            if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
                algo = "fp8"
            elif algo.get("num_bits") == 4 and algo.get("type") == "float":
                algo = "nvfp4"
            else:
                return "auto"
        if isinstance(algo, str):
            resolved = _MODELOPT_KV.get(algo.lower(), "auto")
            if resolved != "auto":
                notes.append(f"checkpoint asks for an {resolved} KV cache (ModelOpt kv_cache_quant_algo)")
            return resolved
        return "auto"
    if method == "compressed-tensors" and q.get("kv_cache_scheme"):
        notes.append("checkpoint asks for an fp8 KV cache (compressed-tensors kv_cache_scheme)")
        return "fp8"
    return "auto"


def kv_elem_bytes(cache_dtype: str, dtype_bytes: int, is_mla: bool) -> float:
    """Bytes per element of a dense KV page; packed formats the planner does not size are ``Unmodelled``."""
    if cache_dtype == "auto":
        return float(dtype_bytes)
    if cache_dtype in KV_DTYPE_BYTES:
        return KV_DTYPE_BYTES[cache_dtype]
    if cache_dtype in MLA_PACKED_BYTES and is_mla:
        return 1.0  # the page size is fixed per token (MLA_PACKED_BYTES)
    raise Unmodelled(f"kv_cache_dtype {cache_dtype!r}: its packed page layout (data plus scales, chosen by the "
                     "attention backend) is not modelled" + ("" if cache_dtype not in MLA_PACKED_BYTES else
                                                            " (DeepSeek MLA formats need an MLA model)"),
                     "set vllm_kwargs kv_cache_dtype to 'auto', 'bfloat16' or 'fp8', which the planner sizes exactly")


def ssm_bytes(name: Any, dtype_bytes: int) -> int:
    name = str(name or "auto")
    return dtype_bytes if name == "auto" else DTYPE_BYTES.get(dtype_name(name) or "", 4)


def _patterns(q: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("modules_to_not_convert", "ignore", "llm_int8_skip_modules", "exclude_modules"):
        v = q.get(key)
        if v:
            out.extend(str(x) for x in v)
    inner = q.get("quantization")
    if isinstance(inner, dict) and inner.get("exclude_modules"):
        out.extend(str(x) for x in inner["exclude_modules"])
    return out


def _excluded(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif any(ch in p for ch in "*?["):
            if fnmatch(name, p) or fnmatch(name, p + ".*"):
                return True
        elif name == p or name.startswith(p + ".") or f".{p}." in f".{name}.":
            return True
    return False


# Representative module names (HF layout) to test a checkpoint's ignore lists against.
_ROLE_MODULES = {
    "attention": "model.layers.{i}.self_attn.q_proj",
    "mlp": "model.layers.{i}.mlp.gate_proj",
    "experts": "model.layers.{i}.mlp.experts.0.gate_proj",
    "mixer": "model.layers.{i}.mixer.in_proj",
}


def quant_scheme(q: dict[str, Any] | None, online: Any) -> QuantScheme | None:
    """Bytes per parameter of quantized linears (research note §A4 table)."""
    if q is None:
        if online:
            method = str(online).lower()
            if "fp8" in method:
                return QuantScheme(method=method, weight_format="fp8 (online)", bytes_per_param=1.0,
                                   quantized_roles=list(_ROLE_MODULES), fp8_weights=True)
            if method == "bitsandbytes":
                return QuantScheme(method=method, weight_format="bitsandbytes nf4 (in-flight)",
                                   bytes_per_param=0.5 + 4 / 64, quantized_roles=list(_ROLE_MODULES))
        return None
    method = str(q.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    patterns = _patterns(q)
    roles = [r for r, n in _ROLE_MODULES.items() if not _excluded(n.format(i=1), patterns)]

    if method in ("fp8", "modelopt", "fbgemm_fp8", "ptpc_fp8"):
        block = q.get("weight_block_size")
        scale = 4 / (block[0] * block[1]) if block else 0.0  # one fp32 scale per block
        fmt = f"fp8 block {block[0]}x{block[1]}" if block else "fp8"
        return QuantScheme(method=method, weight_format=fmt, bytes_per_param=1 + scale,
                           quantized_roles=roles, fp8_weights=True,
                           weight_only=q.get("activation_scheme") is None and method != "modelopt")
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "marlin"):
        bits = int(q.get("bits") or q.get("w_bit") or 4)
        group = int(q.get("group_size") or q.get("q_group_size") or 128)
        per_group = (2 + bits / 8) / group if group > 0 else 0.0  # fp16 scale + packed zero per group
        return QuantScheme(method=method, weight_format=f"{method} int{bits} g{group}",
                           bytes_per_param=bits / 8 + per_group, quantized_roles=roles)
    if method == "bitsandbytes":
        if q.get("load_in_8bit") or q.get("_load_in_8bit"):
            return QuantScheme(method=method, weight_format="bitsandbytes int8", bytes_per_param=1.0,
                               quantized_roles=roles)
        double = q.get("bnb_4bit_use_double_quant")
        return QuantScheme(method=method, weight_format="bitsandbytes 4-bit",
                           bytes_per_param=0.5 + (1.0 / 64 if double else 4.0 / 64), quantized_roles=roles)
    if method == "mxfp4":
        return QuantScheme(method=method, weight_format="mxfp4", bytes_per_param=0.5 + 1 / 32,
                           quantized_roles=roles)
    if method == "modelopt_fp4":
        return QuantScheme(method=method, weight_format="nvfp4", bytes_per_param=0.5 + 1 / 16,
                           quantized_roles=roles)
    if method == "compressed-tensors":
        worst = 0.0
        fp8 = False
        weight_only = True
        fmt = "compressed-tensors"
        for group in (q.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits = int(w.get("num_bits") or 16)
            size = int(w.get("group_size") or 0)
            b = bits / 8 + (2 / size if size and w.get("strategy") == "group" else 0.0)
            if b > worst:
                worst = b
                fmt = f"compressed-tensors {w.get('type', 'int')}{bits}" + (f" g{size}" if size else "")
            fp8 = fp8 or (bits == 8 and w.get("type") == "float")
            weight_only = weight_only and not (group or {}).get("input_activations")
        if not worst:
            return None
        return QuantScheme(method=method, weight_format=fmt, bytes_per_param=worst, quantized_roles=roles,
                           fp8_weights=fp8, weight_only=weight_only)
    width = q.get("bits") or q.get("weight_bits") or q.get("w_bit")
    if width:
        return QuantScheme(method=method or "unknown", weight_format=f"{method} {width}-bit",
                           bytes_per_param=int(width) / 8, quantized_roles=roles)
    return None
