"""The standalone monitor agent (``python -m hive_apps.ops.monitor``): where its token comes from, and
what it pushes when NVML shows GPUs (the fake ``pynvml`` in tests/fixtures, in its own process)."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hive_apps.ops.monitor import TOKEN_ENV, TokenError, read_token

ROOT = Path(__file__).resolve().parents[3]
FAKE_PYNVML = ROOT / "tests" / "fixtures" / "fake_pynvml"


def test_token_file_wins_then_argv_then_env(tmp_path):
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert read_token("from-argv", str(f), {TOKEN_ENV: "from-env"}) == "from-file"
    assert read_token("from-argv", None, {TOKEN_ENV: "from-env"}) == "from-argv"  # an explicit flag beats the env
    assert read_token(None, None, {TOKEN_ENV: " from-env\n"}) == "from-env"
    f.write_text("rotated")
    assert read_token(None, str(f), {}) == "rotated"  # re-read each time: a rotated Secret applies


def test_missing_empty_or_absent_token_is_a_clear_error(tmp_path):
    with pytest.raises(TokenError, match=f"set {TOKEN_ENV}, or pass --token-file"):
        read_token(None, None, {})
    with pytest.raises(TokenError, match="cannot read --token-file"):
        read_token(None, str(tmp_path / "nope"), {})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(TokenError, match="is empty"):
        read_token("argv", str(tmp_path / "empty"), {})


class Recorder(BaseHTTPRequestHandler):
    seen: list = []
    statuses: list = []  # answers to give, in order; 200 once used up

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.seen.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(Recorder.statuses.pop(0) if Recorder.statuses else 200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_):
        pass


@pytest.fixture
def registry():
    Recorder.seen, Recorder.statuses = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run_agent(url: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(FAKE_PYNVML), str(ROOT)])
    return subprocess.run([sys.executable, "-m", "hive_apps.ops.monitor", "--registry-url", url, "--once", *args],
                          env=full_env, capture_output=True, text=True, timeout=60)


GPUS = [
    {"name": "NVIDIA H100 80GB HBM3", "total": 85520809984, "used": 600 << 20, "compute_capability": [9, 0]},
    {"name": "NVIDIA L4", "total": 24152899584, "used": 0, "uuid": "GPU-l4-fixed", "power_limit_w": 72},
]


def test_agent_process_pushes_fake_nvml_gpus_with_the_env_token(registry):
    r = run_agent(registry, "--node-name", "gpu-node-1",
                  env={TOKEN_ENV: "agent-secret", "FAKE_PYNVML_GPUS": json.dumps(GPUS)})
    assert r.returncode == 0, r.stderr
    (path, auth, sample), = Recorder.seen
    assert path == "/admin/registry/samples" and auth == "Bearer agent-secret"
    assert sample["node_name"] == "gpu-node-1" and sample["source"] == "agent"
    devices = sample["devices"]
    assert [d["id"] for d in devices] == ["gpu-node-1:gpu0", "gpu-node-1:gpu1"]
    assert [d["name"] for d in devices] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    assert [d["total_bytes"] for d in devices] == [85520809984, 24152899584]
    assert devices[0]["used_bytes"] == 600 << 20 and devices[1]["uuid"] == "GPU-l4-fixed"
    assert devices[1]["tdp_w"] == 72  # NVML's power limit
    assert devices[0]["tdp_w"] == 700 and devices[0]["sm_count"] == 132  # no NVML figure: the catalog's H100 SXM
    assert {(d["driver_version"], d["cuda_driver_version"]) for d in devices} == {("580.65.06", "13.0")}
    assert sample["cuda_runtime"] is None and devices[0]["cuda_runtime"] is None  # this venv's torch: a CPU build


def test_agent_reads_the_token_file_and_never_needs_argv(registry, tmp_path):
    f = tmp_path / "monitor-token"
    f.write_text("file-secret\n")
    r = run_agent(registry, "--node-name", "n", "--token-file", str(f), "--token", "argv-secret",
                  env={TOKEN_ENV: "env-secret", "FAKE_PYNVML_GPUS": json.dumps(GPUS[:1])})
    assert r.returncode == 0, r.stderr
    assert [auth for _, auth, _ in Recorder.seen] == ["Bearer file-secret"]


def test_agent_without_a_token_exits_2_and_says_how(registry):
    r = run_agent(registry, "--node-name", "n", env={"FAKE_PYNVML_GPUS": json.dumps(GPUS)})
    assert r.returncode == 2 and TOKEN_ENV in r.stderr and "--token-file" in r.stderr
    assert Recorder.seen == []


def test_agent_keeps_trying_while_its_node_is_unknown_and_stops_on_a_bad_token(registry):
    """A DaemonSet pod starts before its node's Ray pod joins: 422 is retried, 401 ends the agent."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update({TOKEN_ENV: "t", "FAKE_PYNVML_GPUS": json.dumps(GPUS[:1]),
                "PYTHONPATH": os.pathsep.join([str(FAKE_PYNVML), str(ROOT)])})
    Recorder.statuses = [422, 422, 200, 200, 401]
    r = subprocess.run([sys.executable, "-m", "hive_apps.ops.monitor", "--registry-url", registry, "--node-name", "n",
                        "--interval", "0.02"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(Recorder.seen) == 5, r.stderr
    assert "HTTP 422" in r.stderr and "HTTP 401" in r.stderr
