"""Planning: model profiles, vLLM's memory model, placement and engine settings (pure, no Ray; deployment.py is the Serve shell)."""
