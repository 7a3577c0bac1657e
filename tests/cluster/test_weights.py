"""Weights reach the nodes that run them: a model named by its Hub repo, served from the test suite's
Hub-compatible server (``tests/fixtures/fake_hub.py``) through the real ``huggingface_hub`` client.

Every node of the shared cluster has a weight cache of its own (``HIVE_WEIGHTS_CACHE`` set per
raylet, ``conftest.py``), so a path resolved on one node and sent to another would point into a
folder that node's fetcher never filled. The head runs the planner and holds metadata only.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import ray

from tests.cluster.conftest import HUB_REPO, HUB_SLOW_REPO, HUB_TOKEN
from tests.cluster.test_observability import serve_logs
from tests.harness import Hive

pytestmark = pytest.mark.cluster

CHAT = {"max_tokens": 2, "messages": [{"role": "user", "content": "which node are you on?"}]}


def spec(model_id: str, model: str = HUB_REPO, **extra) -> dict:
    return {"model_id": model_id, "model": model, "engine": "sim", "max_input_prompt_length": 256,
            "max_output_prompt_length": 16, "vllm_kwargs": {"sim_tokens_per_s": 1000}, **extra}


def weight_files(cache: Path) -> dict[str, int]:
    """Every weight file under one node's cache (resolving the Hub layout's links): name -> size."""
    return {p.name: p.stat().st_size for p in cache.rglob("*.safetensors") if p.is_file()}


def engine_info(model_id: str, index: int) -> dict:
    from ray import serve

    return serve.get_deployment_handle(f"engine-r{index}", app_name=model_id).info.remote().result(timeout_s=30)


def test_a_hub_model_is_fetched_onto_each_node_that_runs_it(clean: Hive, fake_hub, hub_files, hub_shas, weight_caches):
    hive = clean
    files = hub_files[HUB_REPO]
    weights = {name: len(data) for name, data in files.items() if name.endswith(".safetensors")}
    before = dict(fake_hub.served_bytes)
    r = hive.deploy(**spec("from-hub", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["revision"] == hub_shas[HUB_REPO] and body["weight_bytes"] == sum(weights.values())
    # each engine loaded from its own node's cache; the head holds no weights at all
    for index, node in ((0, "node-a"), (1, "node-b")):
        info = engine_info("from-hub", index)
        assert info["weights_path"].startswith(str(weight_caches[node])), info["weights_path"]
        assert weight_files(weight_caches[node]) == weights
    assert weight_files(weight_caches["head"]) == {}
    # the planner (wherever Serve placed it) read config.json & co. from its own node's meta/ folder
    assert any((cache / "meta").exists() for cache in weight_caches.values())
    # each weight file went over the wire once per node, and the metadata never to the engines' nodes only
    for name, size in weights.items():
        assert fake_hub.served_bytes[(HUB_REPO, name)] - before.get((HUB_REPO, name), 0) == 2 * size
    for _ in range(6):
        assert hive.api.post("/v1/chat/completions", json={"model": "from-hub", **CHAT}).status_code == 200
    # the repo is private: the token in the nodes' environment fetched it, and no log line shows it
    assert HUB_TOKEN not in serve_logs(hive)

    # a second model of the same repo on the same nodes downloads nothing
    served = dict(fake_hub.served_bytes)
    r = hive.deploy(**spec("same-weights", gpu=["node-a:gpu1", "node-b:gpu1"], replicas=2))
    assert r.status_code == 200, r.text
    assert {k: v for k, v in fake_hub.served_bytes.items() if k[1].endswith(".safetensors")} == \
        {k: v for k, v in served.items() if k[1].endswith(".safetensors")}

    # the caches as the admin lists them, and each node's disk
    listing = hive.admin.get("/weights").json()["nodes"]
    entry = next(w for w in listing["node-a"]["weights"] if w["revision"] == body["revision"])
    assert entry["in_use"] and entry["complete"] and entry["bytes"] >= sum(weights.values())
    assert not any(w["bytes"] >= sum(weights.values()) for w in listing["head"]["weights"])
    nodes = {n["node_name"]: n for n in hive.admin.get("/nodes").json()["nodes"]}
    assert nodes["node-a"]["weights_disk"]["free_bytes"] > 0
    assert hive.admin.delete("/weights", params={"key": entry["key"]}).status_code == 409  # in use


def test_a_corrupt_cached_file_is_fetched_again(clean: Hive, fake_hub, weight_caches):
    hive = clean
    assert hive.deploy(**spec("first", gpu="node-b:gpu2")).status_code == 200
    assert hive.admin.delete("/models/first").status_code == 200
    name, path = next((p.name, p) for p in weight_caches["node-b"].rglob("*.safetensors"))
    real = path.resolve()
    data = real.read_bytes()
    real.write_bytes(bytes(b ^ 0xFF for b in data[:64]) + data[64:])  # same size, other bytes
    served = fake_hub.served_bytes[(HUB_REPO, name)]
    r = hive.deploy(**spec("second", gpu="node-b:gpu2"))
    assert r.status_code == 200, r.text
    assert fake_hub.served_bytes[(HUB_REPO, name)] - served == len(data)  # that file, and only it, again
    assert path.resolve().read_bytes() == data


def test_killing_the_admin_mid_download_ends_ready_without_fetching_twice(clean: Hive, fake_hub, hub_files, weight_caches):
    hive = clean
    sizes = {n: len(d) for n, d in hub_files[HUB_SLOW_REPO].items() if n.endswith(".safetensors")}
    before = dict(fake_hub.served_bytes)
    r = hive.deploy(wait=False, **spec("slow", model=HUB_SLOW_REPO, gpu="node-a:gpu1"))
    assert r.status_code == 202, r.text
    deadline = time.time() + 60
    while time.time() < deadline:  # the download is under way on node-a
        fetch = hive.admin.get("/models/slow").json()["fetch"]
        if fetch.get("node-a", {}).get("bytes_done", 0) > 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the fetch never showed progress")
    assert fetch["node-a"]["state"] == "fetching" and fetch["node-a"]["bytes_total"] >= sum(sizes.values())
    (admin,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "hive-admin#" in a["name"]]
    ray.kill(ray.get_actor(admin, namespace="serve"), no_restart=True)
    deadline = time.time() + 180
    status = None
    while time.time() < deadline:
        try:
            status = hive.admin.get("/models/slow", timeout=5).json().get("status")
        except (httpx.HTTPError, ValueError):
            status = None
        if status in ("ready", "failed"):
            break
        time.sleep(0.5)
    assert status == "ready"
    for name, size in sizes.items():  # each byte went over the wire once
        assert fake_hub.served_bytes[(HUB_SLOW_REPO, name)] - before.get((HUB_SLOW_REPO, name), 0) == size
    assert weight_files(weight_caches["node-a"]).items() >= sizes.items()


def test_sources_that_cannot_be_used_are_4xx_at_plan_time(clean: Hive):
    hive = clean
    for model, code, words in (("hive-test/no-such-repo", 404, "no-such-repo"),
                               (f"{HUB_REPO}@no-such-branch", 404, "no-such-branch"),
                               ("gs://bucket/model", 422, "gs")):
        r = hive.deploy(**spec("bad", model=model))
        assert r.status_code == code, (model, r.text)
        assert words in r.json()["error"]["message"]
    assert hive.admin.get("/models/bad").status_code == 404
    assert all(d["reserved_bytes"] == 0 for d in hive.gpus().values())


def test_prefetch_then_remove(clean: Hive, fake_hub, weight_caches):
    hive = clean
    r = hive.admin.post("/weights", json={"model": HUB_REPO, "nodes": ["node-b"]})
    assert r.status_code == 202, r.text
    key = r.json()["key"]
    deadline = time.time() + 60
    while time.time() < deadline:
        listing = hive.admin.get("/weights").json()["nodes"]
        if any(w["key"] == key and w["complete"] for w in listing["node-b"]["weights"]):
            break
        time.sleep(0.3)
    else:
        pytest.fail("the pre-fetch did not complete")
    assert not any(w["key"] == key for w in listing["node-a"]["weights"] if w["complete"]) or \
        weight_files(weight_caches["node-a"])  # node-a may hold it from an earlier test, never from this call
    r = hive.admin.delete("/weights", params={"key": key, "node": "node-b"})
    assert r.status_code == 200, r.text
    assert not any(w["key"] == key for w in hive.admin.get("/weights").json()["nodes"]["node-b"]["weights"])
    assert hive.admin.delete("/weights", params={"key": key, "node": "node-b"}).status_code == 404
