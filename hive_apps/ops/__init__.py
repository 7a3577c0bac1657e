"""What runs beside the hive: the per-node device monitor, metrics, the quickstart, Serve's settings."""
