"""Planning: model profiles, vLLM's memory model, placement and engine settings (pure, no Ray)."""
