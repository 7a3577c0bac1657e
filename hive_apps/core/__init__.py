"""Pure logic and the vocabulary every layer shares: the deploy spec, settings, names, vLLM's
memory model and the planner, weight sources, the lifecycle rules. No Ray here (tests/unit/test_layering.py)."""
