import pytest

from hive_apps.registry.devices import DeviceKind
from hive_apps.registry.monitor import sample_node


def test_simulated_gpus_from_label():
    sample = sample_node("abcdef123456", {"ray-hive/node": "node-b", "ray-hive/sim-gpus": "L4.L4.A10"})
    devs = sample.devices
    assert sample.node_name == "node-b" and 0 < sample.host_used_bytes < sample.host_total_bytes
    assert [d.id for d in devs] == ["node-b:gpu0", "node-b:gpu1", "node-b:gpu2"]
    assert [d.name for d in devs] == ["L4", "L4", "A10"]
    assert all(d.kind is DeviceKind.SIM_GPU and d.total_bytes == 24 * 2**30 for d in devs)


def test_cpu_node_is_a_device():
    (dev,) = sample_node("abcdef123456", {}).devices
    assert dev.id == "abcdef12:cpu" and dev.kind is DeviceKind.CPU
    assert 0 < dev.used_bytes < dev.total_bytes


def test_unknown_sim_gpu_is_an_error():
    with pytest.raises(KeyError, match="known: H200"):
        sample_node("n", {"ray-hive/sim-gpus": "TPU"})
