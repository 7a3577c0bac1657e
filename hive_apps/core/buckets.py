"""Fixed histogram bounds the engines count in and the admin's history reads back. Pure: no Ray.

The time-to-first-token bounds are vLLM's own for ``vllm:time_to_first_token_seconds``
(``vllm/v1/metrics/buckets.py``), so a p50 read from an engine's ``EngineLoad`` (serving/engine/protocol.py)
is the one Grafana would show. Fixed: the history adds two reads' buckets only when they have as many;
an engine from before the histogram sends none.
"""

from __future__ import annotations

TTFT_BOUNDS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
