"""Standalone device monitor: reads this machine's GPUs and pushes them to the hive over HTTP.

For the Kubernetes DaemonSet (or any host where a process outside Ray should report):

    python -m hive_apps.ops.monitor --registry-url http://HEAD:8000 --node-name NODE --token-file /etc/ray-hive/monitor/token
    HIVE_MONITOR_TOKEN=<NODE's token> python -m hive_apps.ops.monitor --registry-url http://HEAD:8000 --node-name NODE

Each node's agent pushes with that node's own monitor token, which the hive derives from its
secret HIVE_MONITOR_TOKEN and accepts only for samples of that node (the secret itself is
refused). Issue one per node, where HIVE_MONITOR_TOKEN holds the hive's secret:

    python -m hive_apps.ops.monitor issue-token --node-name NODE

or with the admin token: POST /admin/monitor-tokens {"node_name": "NODE"}. The token is read
from ``--token-file`` (re-read before every push, so a replaced file applies without a restart),
else ``--token``, else HIVE_MONITOR_TOKEN. Prefer the file or the variable: a token on the
command line is visible to every process on the host.

``--node-name`` must match the ``ray-hive/node`` label of the Ray node on this host (the
default is the host name). A fresh pushed reading takes precedence over the in-Ray monitor's
for that node's GPUs if it lists the same devices (kind, index, memory, name) as the in-Ray
monitor; when the agent stops, the in-Ray monitor takes over again.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

import httpx

from hive_apps.control.registry.monitor import NODE_NAME_LABEL, SIM_GPUS_LABEL, sample_node
from hive_apps.core.auth import node_monitor_token

log = logging.getLogger("hive_apps.ops.monitor")


def push_once(client: httpx.Client, url: str, node_name: str, sim_gpus: str | None) -> httpx.Response:
    labels = {NODE_NAME_LABEL: node_name}
    if sim_gpus:
        labels[SIM_GPUS_LABEL] = sim_gpus
    sample = sample_node(f"agent-{node_name}", labels, source="agent")
    return client.post(f"{url.rstrip('/')}/admin/registry/samples", json=sample.model_dump(mode="json"))


TOKEN_ENV = "HIVE_MONITOR_TOKEN"


class TokenError(ValueError):
    """No usable token: none given, or the token file is missing or empty."""


def read_token(token: str | None, token_file: str | None, environ: dict[str, str] | None = None) -> str:
    """The bearer token to push with: ``--token-file``, else ``--token``, else ``HIVE_MONITOR_TOKEN``
    (a flag given on the command line wins over the environment)."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as e:
            raise TokenError(f"cannot read --token-file {token_file}: {e.strerror}") from None
        if not text:
            raise TokenError(f"--token-file {token_file} is empty: put this node's monitor token in it")
        return text
    if token:
        return token
    env = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    if env:
        return env
    raise TokenError(f"no token: set {TOKEN_ENV}, or pass --token-file PATH (or --token, visible to other processes)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hive_apps.ops.monitor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s --registry-url URL [options]\n       %(prog)s issue-token --node-name NODE")
    ap.add_argument("--registry-url", required=True, help="the hive's HTTP address, e.g. http://ray-head:8000")
    ap.add_argument("--token-file", default=None, help="a file holding this node's token (e.g. /etc/ray-hive/monitor/token); re-read before each push")
    ap.add_argument("--token", default=None, help=f"the token itself (prefer {TOKEN_ENV} or --token-file: argv is visible to others)")
    ap.add_argument("--node-name", default=socket.gethostname())
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    ap.add_argument("--sim-gpus", default=None, help="report simulated GPUs instead, e.g. H100-80GB.L4 (tests)")
    ap.add_argument("--once", action="store_true", help="push one reading and exit")
    return ap


ISSUE_TOKEN = "issue-token"


def issue_token(argv: list[str], environ: dict[str, str] | None = None) -> int:
    """Print one node's monitor token, derived from the hive's secret in HIVE_MONITOR_TOKEN."""
    ap = argparse.ArgumentParser(prog=f"python -m hive_apps.ops.monitor {ISSUE_TOKEN}",
                                 description=f"Print the monitor token of one node, derived from the hive's secret in "
                                             f"{TOKEN_ENV}: give it to that node's agent only.")
    ap.add_argument("--node-name", required=True, help="the node's ray-hive/node label (Kubernetes: the node name)")
    args = ap.parse_args(argv)
    secret = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    if not secret:
        ap.error(f"set {TOKEN_ENV} to the hive's secret (the Ray nodes' {TOKEN_ENV})")
    try:
        print(node_monitor_token(secret, args.node_name))
    except ValueError as e:
        ap.error(str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [ISSUE_TOKEN]:
        return issue_token(argv[1:])
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        read_token(args.token, args.token_file)
    except TokenError as e:
        ap.error(str(e))
    with httpx.Client(timeout=10) as client:
        while True:
            try:
                client.headers["Authorization"] = f"Bearer {read_token(args.token, args.token_file)}"
                r = push_once(client, args.registry_url, args.node_name, args.sim_gpus)
                if r.status_code != 200:
                    log.warning("registry refused the sample: HTTP %d %s", r.status_code, r.text)
                    if args.once or r.status_code in (401, 403):
                        return 1  # a wrong token does not fix itself: fail loudly
                    # e.g. 404/422 "no alive Ray node is named ...": the node's Ray pod is not up yet
                    # (a DaemonSet starts before it); keep trying, less often, instead of crash-looping
                    time.sleep(max(0.0, min(30.0, 10 * args.interval) - args.interval))
            except httpx.HTTPError as e:
                log.warning("registry unreachable: %s", e)
                if args.once:
                    return 1
            except TokenError as e:  # the token file vanished or emptied mid-run (a Secret being rotated)
                log.warning("%s", e)
                if args.once:
                    return 1
            if args.once:
                return 0
            time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
