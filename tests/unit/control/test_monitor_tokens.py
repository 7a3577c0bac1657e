"""Monitor tokens speak for one node, and a pushed sample must agree with what that node's own
Ray monitor reports: the admin app (``make_admin_app``: its guard and routes) in front of a registry
on the in-memory cluster, node-a with two NVML-read H100s, node-b with simulated L4s."""

from __future__ import annotations

import httpx
import pytest

from hive_apps.control.registry.deployment import Registry
from hive_apps.control.registry.monitor import NODE_NAME_LABEL, SIM_GPUS_LABEL
from hive_apps.control.registry.samples import node_problems
from hive_apps.core.auth import monitor_token_node, node_monitor_token
from hive_apps.core.devices import DeviceKind, NodeSample
from hive_apps.core.settings import HiveSettings
from hive_apps.ops.monitor import main as monitor_main
from hive_apps.ops.monitor import parser
from tests.unit.control.test_admin_app import admin_on
from tests.unit.fake_cluster import FakeCluster

SECRET = "mon-secret"
ADMIN = {"Authorization": "Bearer adm"}
GIB, TIB = 2**30, 2**40


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class NvmlCluster(FakeCluster):
    """node-a's monitor reads real H100s through NVML; node-b's GPUs come from its sim-gpus label."""

    def add_node(self, name, gpus, node_id=None):
        node_id = super().add_node(name, gpus, node_id)
        if name != "node-a":
            self.node_infos[node_id].labels[SIM_GPUS_LABEL] = gpus
        return node_id

    def sample_nodes(self, nodes):
        out = super().sample_nodes(nodes)
        for s in out.values():
            if s.node_name == "node-a":
                s.devices = [d.model_copy(update={"kind": DeviceKind.GPU, "name": "NVIDIA H100 80GB HBM3",
                                                  "uuid": f"GPU-h100-{d.index}", "driver_version": "580.65.06",
                                                  "cuda_driver_version": "13.0", "cuda_runtime": "13.0"})
                             for d in s.devices]
                s.cuda_runtime = "13.0"
        return out


@pytest.fixture
async def hive():
    """(an HTTP client of the admin app, without a token, the registry behind it)."""
    settings = HiveSettings(admin_token="adm", monitor_token=SECRET, auth_disabled=False)
    async with admin_on(NvmlCluster({"node-a": "H100-80GB.H100-80GB", "node-b": "L4.L4"}), settings) as admin:
        yield admin.anonymous, admin.registry


def own_sample(registry: Registry, node: str) -> dict:
    """What the node's own Ray monitor reports: the honest sample an agent there would push."""
    s = next(s for s in registry.in_ray.values() if s.node_name == node)
    return s.model_copy(update={"node_id": f"agent-{node}", "source": "agent"}).model_dump(mode="json")


async def push(client: httpx.AsyncClient, sample: dict, token: str | None = None) -> httpx.Response:
    return await client.post("/registry/samples", json=sample,
                              headers=bearer(token or node_monitor_token(SECRET, sample["node_name"])))


def test_a_token_names_its_node_and_only_the_secret_makes_it():
    settings = HiveSettings(monitor_token=SECRET)
    for node in ("node-a", "gpu.worker-1.example", "a"):
        assert monitor_token_node(settings, f"Bearer {node_monitor_token(SECRET, node)}") == node
    prefix, node, mac = node_monitor_token(SECRET, "node-a").split(".")
    assert monitor_token_node(settings, f"Bearer {prefix}.node-b.{mac}") is None  # renamed: the MAC no longer fits
    assert monitor_token_node(settings, f"Bearer {node_monitor_token('other-secret', 'node-a')}") is None
    assert monitor_token_node(settings, f"Bearer {SECRET}") is None
    assert monitor_token_node(settings, "Bearer hmn1.n\u00e4de.00") is None
    assert monitor_token_node(HiveSettings(), f"Bearer {node_monitor_token(SECRET, 'node-a')}") is None
    for bad in ("", "-a", "a" * 64, "a b", "n\u00e4de"):
        with pytest.raises(ValueError, match="not a node name"):
            node_monitor_token(SECRET, bad)


def test_issue_token_cli_prints_a_token_the_hive_accepts(monkeypatch, capsys):
    monkeypatch.setenv("HIVE_MONITOR_TOKEN", SECRET)
    assert monitor_main(["issue-token", "--node-name", "gpu-node-1"]) == 0
    token = capsys.readouterr().out.strip()
    assert monitor_token_node(HiveSettings(monitor_token=SECRET), f"Bearer {token}") == "gpu-node-1"
    assert "issue-token --node-name NODE" in parser().format_help()  # the agent's --help says how
    assert "endpoint takes the admin token" not in parser().format_help()
    monkeypatch.delenv("HIVE_MONITOR_TOKEN")
    with pytest.raises(SystemExit) as e:
        monitor_main(["issue-token", "--node-name", "gpu-node-1"])
    assert e.value.code == 2 and "HIVE_MONITOR_TOKEN" in capsys.readouterr().err


async def test_the_issue_endpoint_needs_the_admin_token(hive):
    client, _ = hive
    r = await client.post("/monitor-tokens", json={"node_name": "node-a"}, headers=ADMIN)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store", r.text
    assert r.json() == {"node_name": "node-a", "token": node_monitor_token(SECRET, "node-a")}
    for headers in ({}, bearer(SECRET), bearer(node_monitor_token(SECRET, "node-a"))):
        assert (await client.post("/monitor-tokens", json={"node_name": "node-a"}, headers=headers)).status_code == 401
    r = await client.post("/monitor-tokens", json={"node_name": "node a/../b"}, headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["field"] == "node_name"


async def test_a_node_token_pushes_its_own_node_only(hive):
    client, registry = hive
    sample = own_sample(registry, "node-a")
    sample["devices"][0]["used_bytes"] = 5 * GIB  # a process outside Ray holds memory on gpu0
    r = await push(client, sample, node_monitor_token(SECRET, "node-b"))
    assert r.status_code == 403 and "speaks for node 'node-b'" in r.json()["error"]["message"], r.text
    r = await push(client, sample, SECRET)
    assert r.status_code == 401 and "issue-token" in r.json()["error"]["message"], r.text
    assert (await client.get("/gpus", headers=bearer(node_monitor_token(SECRET, "node-a")))).status_code == 401
    assert (await push(client, sample)).status_code == 200
    assert (await push(client, sample, "adm")).status_code == 200  # operators may push any node
    await registry.sample_once()
    node = next(s for s in registry.nodes.values() if s.node_name == "node-a")
    assert node.source == "agent" and node.devices[0].used_bytes == 5 * GIB
    assert node.host_total_bytes == 64 * GIB  # host RAM stays the Ray monitor's


async def test_a_pushed_gpu_keeps_the_cuda_of_the_ray_pods_torch(hive):
    """Engines run in the Ray pod, not in the agent's container: the planner's CUDA need is the pod's."""
    client, registry = hive
    sample = own_sample(registry, "node-a")
    sample["cuda_runtime"] = None  # the agent's image has no torch
    sample["devices"] = [{**d, "cuda_runtime": None} for d in sample["devices"]]
    assert (await push(client, sample)).status_code == 200
    await registry.sample_once()
    node = next(s for s in registry.nodes.values() if s.node_name == "node-a")
    assert node.source == "agent" and [d.cuda_runtime for d in node.devices] == ["13.0", "13.0"]
    assert node.cuda_runtime == "13.0"
    r = await client.get("/nodes", headers=ADMIN)
    nodes = {n["node_name"]: n for n in r.json()["nodes"]}
    versions = ("driver_version", "cuda_driver_version", "cuda_runtime")
    assert [nodes["node-a"][k] for k in versions] == ["580.65.06", "13.0", "13.0"]
    assert [nodes["node-b"][k] for k in versions] == [None, None, None]  # simulated GPUs have no driver


def _with(sample: dict, **devices) -> dict:
    return {**sample, "devices": [{**d, **devices} for d in sample["devices"]]}


@pytest.mark.parametrize("node, forge, why", [
    ("node-a", lambda s: _with(s, kind="sim-gpu"), "sim-gpu on 'node-a'"),  # hides foreign use
    ("node-a", lambda s: _with(s, total_bytes=TIB), "differs from the Ray monitor's"),
    ("node-a", lambda s: {**s, "devices": []}, "lists no devices"),
    ("node-a", lambda s: {**s, "devices": s["devices"][:1]}, "reports gpu0, gpu1"),
    ("node-a", lambda s: {**s, "host_total_bytes": 64 * TIB}, "host memory"),
    ("node-a", lambda s: _with(s, name="NVIDIA H100 80GB HBM3 #1234"), "named"),
    ("node-a", lambda s: _with(s, name="\x1b[31m"), "printable"),
    ("node-a", lambda s: _with(s, driver_version="999.99"), "driver_version '999.99' is not the Ray monitor's"),
    ("node-a", lambda s: _with(s, cuda_driver_version="12.4"), "is not the Ray monitor's '13.0'"),  # or to block it
    ("node-b", lambda s: _with(s, total_bytes=80 * GIB), "differs from the Ray monitor's"),
])
async def test_samples_must_agree_with_the_nodes_own_monitor(hive, node, forge, why):
    client, registry = hive
    sample = forge(own_sample(registry, node))
    r = await push(client, sample)
    assert r.status_code == 422 and why in r.json()["error"]["message"], r.text
    assert node not in registry.pushed


def test_node_problems_allow_an_honest_sample_and_sim_gpus_only_where_labelled():
    gpu = dict(id="n:gpu0", node_id="x", node_name="n", kind="sim-gpu", index=0, name="L4", total_bytes=24 * GIB)
    own = NodeSample(node_id="x", node_name="n", host_total_bytes=64 * GIB, host_used_bytes=GIB, cpu_count=8,
                     devices=[gpu])
    capped = own.model_copy(update={"host_total_bytes": 256 * 2**20})  # the agent's container limit: fine
    assert node_problems(capped, own, {NODE_NAME_LABEL: "n", SIM_GPUS_LABEL: "L4"}) == []
    assert any("no ray-hive/sim-gpus label" in p for p in node_problems(capped, own, {NODE_NAME_LABEL: "n"}))
