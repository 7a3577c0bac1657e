"""Real-GPU code paths on a cluster whose node reads a fake NVML: identity, CUDA_VISIBLE_DEVICES pins, performance.

Its own small cluster (a CPU head and one "GPU" node): the node's raylet gets
``tests/fixtures/fake_nvml`` first on its PYTHONPATH, so every process there, the hive's
NodeMonitor included, imports the fake ``pynvml`` (2 x H100 SXM + L4). The product code is
unchanged: this is the NVML branch of ``control/registry/monitor.py`` and the GPU pin branch of
``control/admin/model_app.py`` as they run on a real GPU node. Engines are the sim engine (it
reports the CUDA_VISIBLE_DEVICES it was started with).

This module must run before any module that uses the package's ``hive`` fixture (one Ray
cluster per process at a time): pytest collects ``test_fake_nvml.py`` first by name, and the
module-scoped cluster is shut down when the module ends.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.harness import ROOT, start_hive, stop_hive

SIM_MODEL = str(ROOT / "tests" / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")
FAKE = str(ROOT / "tests" / "fixtures" / "fake_nvml")


@pytest.fixture(scope="module")
def gpu_hive():
    import ray

    assert not ray.is_initialized(), "another test cluster is still connected; run this module first"
    env = {"PYTHONPATH": os.pathsep.join([FAKE, str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HIVE_TEST_FAKE_NVML": "h100_sxm,h100_sxm,l4"}
    h = start_hive([{"labels": {"ray-hive/node": "gpu-f"}, "env_vars": env}])
    yield h
    stop_hive(h)


def engine_env(model_id: str, replica: int) -> str | None:
    from ray import serve

    handle = serve.get_deployment_handle(f"engine-r{replica}", app_name=model_id)
    return handle.info.remote().result()["cuda_visible_devices"]


def test_nvml_node_is_identified_and_pinned(gpu_hive):
    gpus = gpu_hive.gpus()
    f = {k: v["device"] for k, v in gpus.items() if k.startswith("gpu-f:")}
    assert sorted(f) == ["gpu-f:gpu0", "gpu-f:gpu1", "gpu-f:gpu2"]
    assert [f[k]["kind"] for k in sorted(f)] == ["gpu"] * 3  # read through NVML, not simulated
    assert [f[k]["catalog_key"] for k in sorted(f)] == ["H100-80GB", "H100-80GB", "L4"]
    assert f["gpu-f:gpu0"]["memory_bandwidth_gbps"] == 3350 and f["gpu-f:gpu2"]["sm_count"] == 58

    # Both deploys start at once (a fresh node starts a worker process per replica; in parallel it is faster).
    # performance: two replicas go to the two H100s, not the L4; a pin to the L4 gets CUDA_VISIBLE_DEVICES=2
    lengths = dict(max_input_prompt_length=512, max_output_prompt_length=128)
    r = gpu_hive.deploy(wait=False, model_id="fast", model=SIM_MODEL, engine="sim", replicas=2, **lengths)
    assert r.status_code in (200, 202), r.text
    devices = {k: v["devices"] for k, v in r.json()["replicas"].items()}
    assert sorted(d for ds in devices.values() for d in ds) == ["gpu-f:gpu0", "gpu-f:gpu1"]
    r = gpu_hive.deploy(wait=False, model_id="pinned", model=SIM_MODEL, engine="sim", gpu="gpu-f:gpu2", **lengths)
    assert r.status_code in (200, 202), r.text
    for model_id in ("fast", "pinned"):
        deadline = time.time() + 300
        while (status := gpu_hive.admin.get(f"/models/{model_id}").json()["status"]) == "deploying":
            assert time.time() < deadline, f"{model_id} still deploying"
            time.sleep(0.5)
        assert status == "ready", gpu_hive.admin.get(f"/models/{model_id}").text
    for name, ds in devices.items():
        assert engine_env("fast", int(name.lstrip("r"))) == ds[0].rsplit("gpu", 1)[1]
    assert engine_env("pinned", 0) == "2"
    gpu_hive.admin.delete("/models")
