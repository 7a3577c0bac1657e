import pytest

from tests.harness import ROOT, start_hive, stop_hive

SIM_MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")

# Node A: 2 x H100; node B: 2 x L4 + 1 x A10; the head is a CPU-only node.
NODES = [
    {"labels": {"ray-hive/node": "node-a", "ray-hive/sim-gpus": "H100-80GB.H100-80GB"}},
    {"labels": {"ray-hive/node": "node-b", "ray-hive/sim-gpus": "L4.L4.A10"}},
]


# short lifecycle clocks, so tests/cluster/test_lifecycle.py runs in seconds
LIFECYCLE_ENV = {"HIVE_MIN_RESIDENCY_S": "3", "HIVE_HOLD_MAX_PER_MODEL": "8", "HIVE_HOLD_KEEPALIVE_S": "0.5",
                 "HIVE_DRAIN_GRACE_S": "5", "HIVE_LIFECYCLE_TICK_S": "0.5",
                 "HIVE_SCALE_WINDOW_S": "1"}


@pytest.fixture(scope="package")
def hive():
    h = start_hive(NODES, env=LIFECYCLE_ENV)
    yield h
    stop_hive(h)


@pytest.fixture
def clean(hive):
    """Every test starts and ends with no model deployed."""
    hive.admin.delete("/models")
    yield hive
    hive.admin.delete("/models")


def pytest_collection_modifyitems(items):
    """``test_fake_nvml.py`` starts its own small cluster, so it runs before any test of the
    package's shared one (whatever the file names sort as)."""
    items.sort(key=lambda item: item.module.__name__ != "tests.cluster.test_fake_nvml")
