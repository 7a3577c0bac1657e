"""benchmarks/gpu_check.py's identity section: the monitor's real NVML code through the fake pynvml,
and the planner's word on each driver, as the device check prints them."""

from __future__ import annotations

import importlib.util
import os
import sys

from tests.unit.fake_nvml import FakeNvml, h100_sxm, l4

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def gpu_check():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # it imports gpu_calibrate beside it
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_identity_names_each_card_its_catalog_entry_and_versions(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([h100_sxm(), l4()]))
    check = gpu_check()
    lines = check.identity_lines(check.read_nvml_gpus("n", "n").devices)
    assert "-> catalog H100-80GB" in lines[0] and "driver 580.65.06 (CUDA 13.0)" in lines[0]
    assert lines[1].strip() == "planner: driver accepted"
    assert any("-> catalog L4" in line for line in lines)


def test_an_old_driver_is_shown_as_the_planner_refuses_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([l4()], driver_version="550.54.14", cuda_driver_version=12040))
    check = gpu_check()
    lines = check.identity_lines(check.read_nvml_gpus("n", "n").devices)
    assert "550.54.14 (CUDA 12.4)" in lines[0] and "needs CUDA 13.0" in lines[1] and "580.65.06" in lines[1]
