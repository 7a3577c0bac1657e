"""What reaches the hive from outside: errors in the hive's shapes, only OpenAI routes
forwarded to engines, tokens checked before bodies are read (forged samples: tests/unit/control/test_admin_app.py)."""


import pytest

from tests.cluster.conftest import SIM_MODEL
from tests.harness import ADMIN_TOKEN

pytestmark = pytest.mark.cluster


def test_only_openai_routes_reach_engines(clean):
    hive = clean
    r = hive.deploy(model_id="gated", model=SIM_MODEL, engine="sim", gpu="node-b:gpu0",
                    max_input_prompt_length=256, max_output_prompt_length=64)
    assert r.status_code == 200, r.text
    for path in ("/v1/unknown", "/gated/v1/unknown", "/gated/hive/load", "/gated/health", "/v1/../gated/hive/load"):
        r = hive.api.post(path, json={"model": "gated"})
        assert r.status_code == 404, (path, r.text)
        assert {"message", "type", "code"} <= set(r.json()["error"]), (path, r.text)
    assert hive.api.get("/v1/models/gated").json()["id"] == "gated"
    assert hive.api.get("/gated/v1/models/gated").json()["id"] == "gated"
    assert hive.api.get("/v1/models/ghost").status_code == 404
    r = hive.api.post("/v1/chat/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    for route in ("/v1", "/gated/v1"):
        r = hive.api.post(f"{route}/chat/completions", json={"model": "gated", "messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and "role" in r.json()["error"]["message"], (route, r.text)
    r = hive.api.post("/gated/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    ok = hive.api.post("/gated/v1/chat/completions", json={"model": "gated", "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200, ok.text


def test_admin_api_survives_fuzzing(clean):
    """Property-based requests from the admin's own OpenAPI schema: no 5xx, and every answer
    is documented and matches its documented schema."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    cli = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    hive = clean
    run = subprocess.run(
        [cli, "run", f"{hive.url}/admin/openapi.json", "--url", f"{hive.url}/admin",
         "-H", f"Authorization: Bearer {ADMIN_TOKEN}", "--workers", "1", "--max-time", "45",
         "--phases", "examples,coverage,fuzzing", "--checks",
         "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
         "--suppress-health-check", "all", "--request-timeout", "30"],
        capture_output=True, text=True, timeout=240)
    tail = run.stdout[-4000:]
    print(tail)
    assert run.returncode == 0, tail
