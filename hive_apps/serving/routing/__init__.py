"""Routing: the per-model router and its capacity-relative replica choice."""
