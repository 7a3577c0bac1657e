"""The /v1 ingress: one OpenAI endpoint for every model, chosen by the request's model field."""
