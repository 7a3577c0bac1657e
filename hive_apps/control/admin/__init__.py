"""The /admin ingress: validate, plan, reserve, add and remove model apps, self-heal."""
