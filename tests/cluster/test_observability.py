"""Observability on the simulated cluster: request ids through the logs, no secrets in them,
Prometheus metrics exported, and the status page."""

import time
import uuid
from pathlib import Path

import pytest

from tests.cluster.conftest import SIM_MODEL
from tests.harness import ADMIN_TOKEN, API_KEY

pytestmark = pytest.mark.cluster


def serve_logs(hive) -> str:
    """Every Serve log line of the cluster (proxy, controller, every replica), as one text."""
    logs = Path(hive.cluster.head_node.get_logs_dir_path())
    files = [*logs.glob("serve/*.log"), *logs.glob("worker-*.out"), *logs.glob("worker-*.err")]
    return "\n".join(f.read_text(errors="replace") for f in files)


def wait_for_logs(hive, *needles: str, timeout_s: float = 15) -> str:
    deadline = time.time() + timeout_s
    while True:
        text = serve_logs(hive)
        if all(n in text for n in needles) or time.time() > deadline:
            return text
        time.sleep(0.5)


def test_one_request_id_through_proxy_router_and_engine_and_no_secrets_in_the_logs(clean):
    hive = clean
    r = hive.deploy(model_id="traced", model=SIM_MODEL, engine="sim", gpu="node-a:gpu0",
                    vllm_kwargs={"sim_tokens_per_s": 2000})
    assert r.status_code == 200, r.text
    prompt = f"PROMPT-{uuid.uuid4().hex}"
    body = {"model": "traced", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}

    mine = f"client:{uuid.uuid4().hex}"
    for path in ("/v1/chat/completions", "/traced/v1/chat/completions"):
        out = hive.api.post(path, json=body, headers={"x-request-id": mine})
        assert out.status_code == 200, out.text
        assert out.headers.get_list("x-request-id") == [mine], "a well-formed client id comes back as sent, once"
    bad = "not well formed " + uuid.uuid4().hex
    out = hive.api.post("/v1/chat/completions", json=body, headers={"x-request-id": bad})
    assert out.status_code == 200, out.text
    (replaced,) = out.headers.get_list("x-request-id")
    assert replaced != bad and len(replaced) <= 128 and " " not in replaced
    made = hive.api.post("/v1/chat/completions", json=body).headers["x-request-id"]

    text = wait_for_logs(hive, f"request_id={mine}", f"request_id={replaced}", made)
    lines = [ln for ln in text.splitlines() if mine in ln]
    assert any("request_id=" + mine in ln and "/v1/chat/completions 200" in ln for ln in lines), \
        "the engine logs the request with the client's id"
    assert any("proxy" in ln.lower() or "Gateway" in ln for ln in lines), "the gateway/proxy lines carry the same id"
    assert f"request_id={replaced}" in text and made in text
    assert bad.split()[-1] not in text, "a malformed id is never logged"
    for secret in (API_KEY, ADMIN_TOKEN, prompt):
        assert secret not in text, f"{secret!r} leaked into the Serve logs"
