"""Which environment variables a deploy's ``env`` may give its engine processes. Pure: no Ray, no vLLM.

An engine's environment decides which GPUs it opens, which credentials it holds, which code it loads
and what it may reach; the admin token must not be a way to change any of that. So ``env`` takes
only names from an allow-list of tuning knobs that read no file, load no code and reach no network
(``ALLOWED``), which an operator widens with ``HIVE_ENGINE_ENV_ALLOW`` (names, or ``PREFIX*``). What
the hive itself sets or guards (``DENIED``: device pinning, the blanked secrets and credentials, the
hive's and Ray's own variables, library and Python paths, vLLM's plugin and pickle switches) is
refused whatever the operator lists. The values are not secrets, but they are never logged either.
"""

from __future__ import annotations

import re
from typing import Final

from hive_apps.core.settings import HiveSettings

MAX_VARS: Final = 64
MAX_VALUE_CHARS: Final = 4096
NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # matched in full

# Tuning knobs of vLLM, NCCL and the tokenizers, none of which names a file, a module or a host.
ALLOWED: Final = frozenset({
    "VLLM_USE_V2_MODEL_RUNNER", "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_MARLIN_USE_ATOMIC_ADD", "VLLM_FLOAT32_MATMUL_PRECISION",
    "VLLM_ENABLE_CUDAGRAPH_GC", "VLLM_DISABLE_COMPILE_CACHE", "VLLM_LOGGING_LEVEL", "VLLM_LOG_STATS_INTERVAL",
    "VLLM_ENFORCE_STRICT_TOOL_CALLING", "VLLM_TOOL_JSON_ERROR_AUTOMATIC_RETRY", "VLLM_MAX_N_SEQUENCES",
    "VLLM_MAX_STOP_STRINGS", "VLLM_MAX_NUM_BAD_WORDS",
    "NCCL_DEBUG", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE", "NCCL_CUMEM_ENABLE",
    "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
    "TOKENIZERS_PARALLELISM",
})

# Never, whatever HIVE_ENGINE_ENV_ALLOW lists (compared without case): the hive pins devices with
# them, blanks them (``control/admin/model_app.py`` ENGINE_ENV), or they load code or credentials.
DENIED: Final[dict[str, str]] = {
    **{name: "the hive pins each replica to its planned devices with it" for name in (
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES")},
    "VLLM_PLUGINS": "it picks which installed plugins vLLM imports",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "it lets vLLM unpickle data, which runs code",
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "the hive keeps media fetches from following redirects (HIVE_MEDIA_HOSTS)",
    "VLLM_USE_MODELSCOPE": "engines never reach a model hub: their node's fetcher put the weights in its cache",
    "VLLM_API_KEY": "the hive's API keys guard every route; engines are reached only through it",
    "PATH": "it picks which programs run", "HOME": "it moves every cache and config the engine reads",
}
DENIED_PREFIXES: Final[dict[str, str]] = {
    "HIVE_": "the hive's own settings and secrets",
    "RAY_": "Ray's own settings",
    "HF_": "Hugging Face credentials and hub access (engines run offline)",
    "HUGGING_FACE_": "Hugging Face credentials",
    "AWS_": "S3 credentials (engines get them blanked)",
    "CUDA_MPS_": "the hive pins each replica to its planned devices",
    "LD_": "it loads native libraries into the engine",
    "PYTHON": "it changes which Python code the engine imports or runs",
}


def denied_reason(name: str) -> str | None:
    """Why the hive never lets a deploy set ``name``; None when an operator may allow it."""
    upper = name.upper()
    if upper in DENIED:
        return DENIED[upper]
    return next((why for prefix, why in DENIED_PREFIXES.items() if upper.startswith(prefix)), None)


def allowed_by(name: str, patterns: list[str]) -> bool:
    """``name`` is one of ``patterns``: an exact name, or ``PREFIX*`` (``*`` alone: any name)."""
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def engine_env_problems(env: dict[str, str], settings: HiveSettings | None) -> list[str]:
    """Every reason to refuse this ``env`` (empty: it may be used). ``settings`` None: no operator
    policy (``core/spec.py``): names, values and the deny-list are checked, the allow-list is not."""
    problems: list[str] = []
    if len(env) > MAX_VARS:
        problems.append(f"sets {len(env)} variables; at most {MAX_VARS}")
    for name, value in env.items():
        if not NAME_RE.fullmatch(name):
            problems.append(f"{name[:64]!r} is not a variable name (a letter or '_', then letters, digits or '_', "
                            "at most 128 characters)")
            continue
        if not isinstance(value, str) or "\0" in value or len(value) > MAX_VALUE_CHARS:
            problems.append(f"{name} must be a string without NUL of at most {MAX_VALUE_CHARS} characters")
        reason = denied_reason(name)
        if reason is not None:
            problems.append(f"{name} is refused: {reason}; no setting allows it")
        elif settings is not None and name not in ALLOWED and not allowed_by(name, settings.engine_env_allow):
            problems.append(f"{name} is not among the engine variables the hive takes (tuning knobs of vLLM, NCCL "
                            f"and the tokenizers); an operator may allow it with HIVE_ENGINE_ENV_ALLOW={name}")
    return problems
