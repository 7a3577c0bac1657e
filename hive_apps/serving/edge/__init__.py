"""The hive's edge: an HAProxy next to each gateway replica that carries OpenAI bytes straight to engines."""
