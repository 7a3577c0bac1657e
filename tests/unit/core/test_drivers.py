"""The NVIDIA driver floor: a GPU whose driver is older than the CUDA its node's vLLM runs is never placed."""

from __future__ import annotations

import pytest

from hive_apps.core.devices import DeviceKind
from hive_apps.core.drivers import (
    TOOLKIT_DRIVERS,
    VLLM_CUDA,
    cuda_version,
    driver_problem,
    numbers,
    nvml_cuda_version,
)
from hive_apps.core.planning.types import DeviceCapacity, PlanningError
from tests.unit.core.test_planning_placement import SMALL, plan, replica_devices
from tests.unit.planning_fixtures import cpu, gpu

CUDA_12_4 = {"driver_version": "550.54.14", "cuda_driver_version": "12.4"}
CUDA_13_0 = {"driver_version": "580.65.06", "cuda_driver_version": "13.0"}


def with_driver(dc: DeviceCapacity, **versions: str | None) -> DeviceCapacity:
    return dc.model_copy(update={"device": dc.device.model_copy(update=versions)})


def test_nvml_encodes_cuda_as_major_thousands_and_minor_tens():
    assert nvml_cuda_version(13000) == "13.0" and nvml_cuda_version(12040) == "12.4"
    assert nvml_cuda_version(12090) == "12.9" and nvml_cuda_version(13010) == "13.1"


def test_versions_parse_or_are_none():
    assert numbers("580.65.06") == (580, 65, 6) and cuda_version("12.8.1") == (12, 8) and cuda_version("13") == (13, 0)
    for bad in (None, "", "13.0; rm -rf /", "v580", "1.2.3.4.5"):
        assert numbers(bad) is None and cuda_version(bad) is None


def test_vllm_032s_floor_is_the_cuda_13_0_ga_driver():
    assert VLLM_CUDA == (13, 0) and TOOLKIT_DRIVERS[VLLM_CUDA] == "580.65.06"
    assert list(TOOLKIT_DRIVERS) == sorted(TOOLKIT_DRIVERS)  # newer toolkits, newer drivers
    assert [numbers(d) for d in TOOLKIT_DRIVERS.values()] == sorted(numbers(d) for d in TOOLKIT_DRIVERS.values())


def test_an_old_driver_is_refused_naming_both_versions():
    dev = with_driver(gpu("L4", "n1", 0), **CUDA_12_4).device
    assert driver_problem(dev) == (
        "node n1 gpu0 has NVIDIA driver 550.54.14 (CUDA 12.4); this vLLM's torch needs CUDA 13.0, driver "
        "580.65.06 or newer: upgrade the node's NVIDIA driver (nvidia-smi shows it)")


def test_the_ga_driver_and_newer_pass():
    assert driver_problem(with_driver(gpu("L4"), **CUDA_13_0).device) is None
    assert driver_problem(with_driver(gpu("L4"), driver_version="590.44.01", cuda_driver_version="13.1").device) is None


def test_the_need_is_the_nodes_torch_build_when_it_reported_one():
    cu128 = with_driver(gpu("L4", "n2", 1), driver_version="570.124.06", cuda_driver_version="12.8", cuda_runtime="12.8")
    assert driver_problem(cu128.device) is None  # a node running a cu128 torch needs a 12.8 driver only
    cu129 = with_driver(cu128, cuda_runtime="12.9").device
    assert "needs CUDA 12.9, driver 575.51.03 or newer" in driver_problem(cu129)
    unknown = with_driver(cu128, cuda_runtime="13.2").device  # no table row: the CUDA version still says it
    assert "needs CUDA 13.2, a driver for CUDA 13.2 or newer" in driver_problem(unknown)


def test_without_nvmls_cuda_version_the_driver_is_compared_with_the_table():
    assert "has NVIDIA driver 575.57.08;" in driver_problem(with_driver(gpu("L4"), driver_version="575.57.08").device)
    assert driver_problem(with_driver(gpu("L4"), driver_version="580.82.07").device) is None


def test_no_evidence_is_no_refusal_and_sim_gpus_and_cpus_have_no_driver():
    assert driver_problem(gpu("L4").device) is None  # NVML did not say
    sim = with_driver(gpu("L4", kind=DeviceKind.SIM_GPU), **CUDA_12_4)
    assert driver_problem(sim.device) is None
    assert driver_problem(cpu().device) is None


# ---- in placement --------------------------------------------------------------------------


def test_automatic_placement_skips_an_old_driver_and_says_why():
    old, new = with_driver(gpu("H100-80GB", "old", 0), **CUDA_12_4), with_driver(gpu("L4", "new", 0), **CUDA_13_0)
    p = plan(SMALL, [old, new])
    assert replica_devices(p) == [["new:gpu0"]]  # the faster card is refused, not ranked
    (rejected,) = [r for r in p.rejected if r.device == "old:gpu0"]
    assert "NVIDIA driver 550.54.14 (CUDA 12.4)" in rejected.reason and "580.65.06" in rejected.reason


def test_only_old_drivers_is_a_planning_error_that_names_them():
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [with_driver(gpu("L4", "n1", 0), **CUDA_12_4)])
    assert "node n1 gpu0 has NVIDIA driver 550.54.14" in err.value.message


def test_a_pin_on_an_old_driver_is_refused():
    with pytest.raises(PlanningError) as err:
        plan(SMALL, [with_driver(gpu("L4", "n1", 0), **CUDA_12_4)], gpu="n1:gpu0")
    assert err.value.status_code == 422 and "pinned n1:gpu0" in err.value.message
    assert "this vLLM's torch needs CUDA 13.0" in err.value.message


def test_the_sim_engine_makes_no_cuda_call_and_is_not_refused():
    p = plan(SMALL, [with_driver(gpu("L4", "n1", 0), **CUDA_12_4)], engine="sim")
    assert replica_devices(p) == [["n1:gpu0"]]
