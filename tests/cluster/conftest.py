from pathlib import Path

import pytest

from tests.harness import SIM_MODEL, start_hive, stop_hive

# Node A: 2 x H100; node B: 2 x L4 + 1 x A10; the head is a CPU-only node.
NODES = [
    {"labels": {"ray-hive/node": "node-a", "ray-hive/sim-gpus": "H100-80GB.H100-80GB"}},
    {"labels": {"ray-hive/node": "node-b", "ray-hive/sim-gpus": "L4.L4.A10"}},
]


# short lifecycle clocks, so tests/cluster/test_lifecycle.py runs in seconds
LIFECYCLE_ENV = {"HIVE_MIN_RESIDENCY_S": "3", "HIVE_HOLD_MAX_PER_MODEL": "8", "HIVE_HOLD_KEEPALIVE_S": "0.5",
                 "HIVE_DRAIN_GRACE_S": "5", "HIVE_LIFECYCLE_TICK_S": "0.5",
                 "HIVE_SCALE_WINDOW_S": "1"}


# Weights served by the suite's Hub-compatible server (tests/fixtures/fake_hub.py): a config the
# planner knows and two safetensors shards (random bytes: the sim engine loads nothing), and a copy
# served slowly, so a test can kill the admin while it downloads.
HUB_TOKEN = "hf_test_token_never_logged"
HUB_REPO = "hive-test/qwen3-sim"
HUB_SLOW_REPO = "hive-test/qwen3-sim-slow"
SHARD_BYTES = 4 * 2**20
SLOW_BYTES_PER_S = 2**19  # 8 s a shard: long enough to kill the admin mid-download


def hub_repo_files(seed: int) -> dict[str, bytes]:
    import random

    rng = random.Random(seed)
    config = (Path(SIM_MODEL) / "config.json").read_bytes()
    return {"config.json": config, "generation_config.json": b'{"temperature": 0.6}',
            **{f"model-0000{i}-of-00002.safetensors": rng.randbytes(SHARD_BYTES) for i in (1, 2)}}


@pytest.fixture(scope="package")
def hub_files() -> dict[str, dict[str, bytes]]:
    return {HUB_REPO: hub_repo_files(1), HUB_SLOW_REPO: hub_repo_files(2)}


@pytest.fixture(scope="package")
def fake_hub(hub_files):
    from tests.fixtures.fake_hub import FakeHub

    with FakeHub(token=HUB_TOKEN) as hub:
        yield hub


@pytest.fixture(scope="package")
def hub_shas(fake_hub, hub_files) -> dict[str, str]:
    # private: only a node whose environment has the token can list or fetch it
    shas = {repo: fake_hub.add_repo(repo, files, private=repo == HUB_REPO) for repo, files in hub_files.items()}
    fake_hub.throttle(HUB_SLOW_REPO, SLOW_BYTES_PER_S)
    return shas


@pytest.fixture(scope="package")
def weight_caches(tmp_path_factory) -> dict[str, Path]:
    """One weight cache per node, nothing shared between them."""
    root = tmp_path_factory.mktemp("weights")
    return {name: root / name for name in ("head", "node-a", "node-b")}


@pytest.fixture(scope="package")
def hive(fake_hub, hub_shas, weight_caches):
    nodes = [{**n, "env_vars": {"HIVE_WEIGHTS_CACHE": str(weight_caches[n["labels"]["ray-hive/node"]])}}
             for n in NODES]
    h = start_hive(nodes, env={**LIFECYCLE_ENV, "HF_ENDPOINT": fake_hub.url, "HF_TOKEN": HUB_TOKEN,
                               "HIVE_WEIGHTS_CACHE": str(weight_caches["head"])})
    yield h
    stop_hive(h)


def pytest_collection_modifyitems(items):
    """``test_fake_nvml.py`` starts its own small cluster, so it runs before any test of the
    package's shared one (whatever the file names sort as)."""
    items.sort(key=lambda item: item.module.__name__ != "tests.cluster.test_fake_nvml")
