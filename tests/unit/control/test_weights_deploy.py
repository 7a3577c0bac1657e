"""Deploys of models named by source, on the in-memory cluster (``fake_cluster.py``: every node has a
weight cache folder of its own) with the registry and the admin's reconciler, against the suite's
Hub-compatible server and the real ``huggingface_hub`` client: the fetch phase, its failures, the
revision a heal is pinned to, and the admin's room check before anything is booked."""

from __future__ import annotations

import asyncio
import json
import os
import random
import uuid
from pathlib import Path

import pytest

from hive_apps.control.admin.weights import NodeCaches
from hive_apps.core.spec import ModelSpec
from hive_apps.core.state.records import ModelStatus
from hive_apps.core.weights.types import CacheDisk, FetchState, SourceKind, WeightSource
from tests.unit.control.test_controller import MODEL, hive  # noqa: F401  (the fixture)

REPO = "hive-test/qwen3"
SHARD = 256 * 1024


def repo_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {"config.json": (Path(MODEL) / "config.json").read_bytes(),
            "model.safetensors.index.json": json.dumps({"metadata": {"total_size": 2 * SHARD}}).encode(),
            **{f"model-0000{i}-of-00002.safetensors": rng.randbytes(SHARD) for i in (1, 2)}}


@pytest.fixture
def hub(fake_hub, monkeypatch):
    """The repo at a fresh name per test (the planner's metadata cache is the fake cluster's own)."""
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    yield fake_hub


async def settle(hive, model_id: str, timeout_s: float = 30):  # noqa: F811
    """Step the model's loop, giving the nodes' fetch threads time, until it needs nothing more."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        delay = await hive.step(model_id)
        if model_id not in hive.reconciler.fetching and (delay is None or delay > 1):
            break
        await asyncio.sleep(0.05)
    return await hive.registry.get_model(model_id)


def files_under(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*.safetensors") if p.is_file()}


async def test_each_node_fetches_into_its_own_cache_before_the_app_is_built(hive, hub, tmp_path):  # noqa: F811
    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    sha = hub.add_repo(repo, repo_files(1))
    hive.cluster.planner_cache = tmp_path / "planner"
    hive.cluster.weights_root = hive.cluster.planner_cache.parent / "nodes"
    rec = await hive.deploy("m", model=repo, gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2)
    assert rec.plan.weights.revision == sha and rec.plan.weights.weight_bytes == 2 * SHARD
    assert rec.plan.weights.key.endswith(sha)
    assert not files_under(Path(rec.plan.profile.path))  # the planner read config.json & co., no weights
    rec = await settle(hive, "m")
    assert rec.status is ModelStatus.READY, rec.message
    caches = {hive.cluster.node_infos[i].labels["ray-hive/node"]: hive.cluster.weights_root / i
              for i in hive.cluster.fetchers}
    assert set(caches) == {"node-a", "node-b"}  # only the nodes that run a replica
    for root in caches.values():
        assert files_under(root) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
        assert (root / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / sha).is_dir()
    assert not files_under(hive.cluster.planner_cache)  # the planner's node: metadata only
    assert "m" not in hive.reconciler.fetching


async def test_the_app_waits_while_a_node_is_still_fetching(hive, hub):  # noqa: F811
    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    hub.add_repo(repo, repo_files(2))
    hub.throttle(repo, SHARD)  # a second a shard
    rec = await hive.deploy("m", model=repo, gpu="node-a:gpu1")
    await hive.step("m")
    fetching = hive.reconciler.fetching["m"]
    assert set(fetching) == {"node-a"} and fetching["node-a"].state is FetchState.FETCHING
    assert fetching["node-a"].bytes_total >= 2 * SHARD and "m" not in hive.cluster.apps  # nothing built yet
    hive.cluster.fetchers[rec.plan.replicas[0].node_id].wait(rec.plan.weights.key, 30)
    assert (await settle(hive, "m")).status is ModelStatus.READY
    assert "m" not in hive.reconciler.fetching


async def test_a_fetch_that_keeps_failing_fails_the_deploy_and_frees_everything(hive, hub):  # noqa: F811
    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    hub.add_repo(repo, repo_files(3))
    hub.corrupt(repo, "model-00002-of-00002.safetensors")  # every download of it fails its sha256
    rec = await hive.deploy("bad", model=repo, gpu="node-b:gpu1")
    node_id = rec.plan.replicas[0].node_id
    hive.cluster.fetcher_call(node_id, "disk")  # makes the node's fetcher, to make it give up sooner
    hive.cluster.fetchers[node_id].attempts, hive.cluster.fetchers[node_id].backoff_s = 2, 0.01
    for _ in range(200):
        rec = await hive.registry.get_model("bad")
        if rec.status is not ModelStatus.DEPLOYING:
            break
        await hive.step("bad")
        await asyncio.sleep(0.05)
    assert rec.status is ModelStatus.FAILED and "fetching its weights failed" in rec.message
    assert "node-b" in rec.message and "sha256" in rec.message.lower()
    assert hive.reserved("bad") == {} and "bad" not in hive.cluster.apps
    root = hive.cluster.weights_root / node_id
    assert not [p for p in root.rglob("*") if p.is_file() and (".incomplete" in p.name or ".part" in p.name)]
    hub.corrupt(repo, "model-00002-of-00002.safetensors", on=False)


async def test_a_heal_loads_the_revision_the_deploy_pinned(hive, hub):  # noqa: F811
    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    first = hub.add_repo(repo, repo_files(4))
    hive.cluster.add_node("node-c", "H100-80GB")
    await hive.sample()
    await hive.deploy("m", model=repo, gpu=None, replicas=2)
    rec = await settle(hive, "m")
    assert rec.status is ModelStatus.READY and rec.plan.weights.revision == first
    hub.add_repo(repo, repo_files(5))  # main moves on
    lost = rec.plan.replicas[1].node_name
    hive.cluster.kill_node(lost)
    await hive.sample()
    rec = await settle(hive, "m")
    assert rec.status is ModelStatus.READY, rec.message
    assert rec.plan.weights.revision == first and all(rp.node_name != lost for rp in rec.plan.replicas)


async def test_room_is_checked_on_each_node_before_anything_is_booked(hive, hub, monkeypatch):  # noqa: F811
    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    hub.add_repo(repo, repo_files(6))
    spec = ModelSpec(model_id="m", model=repo, engine="sim", max_input_prompt_length=256, max_output_prompt_length=64,
                     gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2)
    outcome = await hive.reconciler.planner.plan.remote(spec, await hive.registry.capacities())
    plan = outcome.plan
    caches = NodeCaches(hive.cluster)
    assert await caches.room_problems(plan, set()) == []
    node_b = next(rp.node_id for rp in plan.replicas if rp.node_name == "node-b")
    hive.cluster.fetcher_call(node_b, "disk")
    fetcher = hive.cluster.fetchers[node_b]
    monkeypatch.setattr(fetcher, "disk", lambda: CacheDisk(root="/cache", total_bytes=10**9, free_bytes=SHARD))
    (problem,) = await caches.room_problems(plan, set())
    assert problem.startswith("node-b needs") and "/cache" in problem

    # a folder source: the node that lacks the folder is named
    folder_plan = plan.model_copy(update={"weights": plan.weights.model_copy(update={
        "source": WeightSource(kind=SourceKind.LOCAL, location="/no/such/folder")})})
    problems = await caches.room_problems(folder_plan, set())
    assert len(problems) == 2 and all("/no/such/folder" in p for p in problems)
    assert {p.split(":")[0] for p in problems} == {"node-a", "node-b"}


def test_a_fetch_progress_is_ready_at_once_when_cached(hub, tmp_path):
    from hive_apps.core.weights.fetcher import WeightFetcher
    from hive_apps.core.weights.listing import list_source
    from hive_apps.core.weights.source import parse_source

    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    hub.add_repo(repo, repo_files(7))
    manifest = list_source(parse_source(repo))
    fetcher = WeightFetcher(tmp_path / "node", "node-x", workers=2)
    fetcher.ensure(manifest)
    assert fetcher.wait(manifest.key, 30).state is FetchState.READY
    served = sum(n for (r, _), n in hub.served_bytes.items() if r == repo)
    again = WeightFetcher(tmp_path / "node", "node-x", workers=2)  # a restarted fetcher on the same disk
    progress = again.ensure(manifest)
    assert progress.state is FetchState.READY and progress.path.startswith(str(tmp_path / "node"))
    assert sum(n for (r, _), n in hub.served_bytes.items() if r == repo) == served


def test_files_verified_before_a_reboot_are_checked_again(hub, tmp_path, monkeypatch):
    """Files are not fsynced as they arrive: after a crash their bytes may differ while size and
    mtime look the same, so a record from another boot vouches for nothing."""
    from hive_apps.core.weights import cache
    from hive_apps.core.weights.fetcher import WeightFetcher
    from hive_apps.core.weights.listing import list_source
    from hive_apps.core.weights.source import parse_source

    repo = f"{REPO}-{uuid.uuid4().hex[:8]}"
    files = repo_files(8)
    hub.add_repo(repo, files)
    manifest = list_source(parse_source(repo))
    fetcher = WeightFetcher(tmp_path / "node", "node-x", workers=2)
    fetcher.ensure(manifest)
    assert fetcher.wait(manifest.key, 30).state is FetchState.READY
    name = "model-00001-of-00002.safetensors"
    blob = (Path(fetcher.ensure(manifest).path) / name).resolve()
    st = blob.stat()
    blob.write_bytes(bytes(SHARD))  # what a lost page cache can leave: zeros, same size...
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...and the same mtime
    assert WeightFetcher(tmp_path / "node", "node-x").ensure(manifest).state is FetchState.READY  # same boot: trusted
    served = hub.served_bytes[(repo, name)]
    monkeypatch.setattr(cache, "BOOT_ID", "after-a-reboot")
    again = WeightFetcher(tmp_path / "node", "node-x", workers=2)
    again.ensure(manifest)
    assert again.wait(manifest.key, 30).state is FetchState.READY
    assert hub.served_bytes[(repo, name)] - served == SHARD and blob.read_bytes() == files[name]
