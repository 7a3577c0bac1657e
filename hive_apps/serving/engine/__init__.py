"""Engine replicas: vLLM in-process behind its own OpenAI app, and the simulated engine."""
