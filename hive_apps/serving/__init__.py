"""The request path: engine replicas (vLLM or the sim engine), each model's router, the gateway
at /v1, and the request ids the Serve proxy keeps."""
