"""Standalone device monitor: reads this machine's GPUs and pushes them to the hive over HTTP.

For the Kubernetes DaemonSet (or any host where a process outside Ray should report):

    python -m hive_apps.monitor --registry-url http://HEAD:8000 --token $HIVE_ADMIN_TOKEN

``--node-name`` must match the ``ray-hive/node`` label of the Ray node on this host (the
default is the host name). A fresh pushed reading takes precedence over the in-Ray monitor's
for that node; when the agent stops, the in-Ray monitor takes over again.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time

import httpx

from hive_apps.registry.monitor import NODE_NAME_LABEL, SIM_GPUS_LABEL, sample_node

log = logging.getLogger("hive_apps.monitor")


def push_once(client: httpx.Client, url: str, node_name: str, sim_gpus: str | None) -> httpx.Response:
    labels = {NODE_NAME_LABEL: node_name}
    if sim_gpus:
        labels[SIM_GPUS_LABEL] = sim_gpus
    sample = sample_node(f"agent-{node_name}", labels, source="agent")
    return client.post(f"{url.rstrip('/')}/admin/registry/samples", json=sample.model_dump(mode="json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry-url", required=True, help="the hive's HTTP address, e.g. http://ray-head:8000")
    ap.add_argument("--token", required=True, help="the admin token (HIVE_ADMIN_TOKEN)")
    ap.add_argument("--node-name", default=socket.gethostname())
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    ap.add_argument("--sim-gpus", default=None, help="report simulated GPUs instead, e.g. H100-80GB.L4 (tests)")
    ap.add_argument("--once", action="store_true", help="push one reading and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with httpx.Client(headers={"Authorization": f"Bearer {args.token}"}, timeout=10) as client:
        while True:
            try:
                r = push_once(client, args.registry_url, args.node_name, args.sim_gpus)
                if r.status_code != 200:
                    log.warning("registry refused the sample: HTTP %d %s", r.status_code, r.text)
                    if args.once or r.status_code in (401, 404, 422):
                        return 1
            except httpx.HTTPError as e:
                log.warning("registry unreachable: %s", e)
                if args.once:
                    return 1
            if args.once:
                return 0
            time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
