"""Ray Hive: plan, place, route and serve vLLM engines on a heterogeneous Ray cluster."""

__version__ = "0.1.0"
