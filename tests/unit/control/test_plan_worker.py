"""A plan that outlives its deadline is a 422 and its worker process is replaced."""

import time

from hive_apps.control.planner import PlanWorker
from hive_apps.core.devices import Device, DeviceKind
from hive_apps.core.planning.types import DeviceCapacity
from hive_apps.core.spec import ModelSpec


def devices() -> list[DeviceCapacity]:
    dev = Device(id="n:gpu0", node_id="n", node_name="n", kind=DeviceKind.SIM_GPU, index=0, name="L4",
                 total_bytes=24 * 2**30, memory_bandwidth_gbps=300, fp16_tflops=121)
    return [DeviceCapacity(device=dev, available_bytes=20 * 2**30, free_bytes=24 * 2**30)]


async def test_a_huge_config_is_cut_off_and_the_next_plan_works(tmp_path):
    import json
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B" / "config.json"
    cfg = json.loads(fixture.read_text())
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**7}))
    worker = PlanWorker(timeout_s=3)
    try:
        ok = await worker.plan(ModelSpec(model_id="ok", model=str(fixture.parent), engine="sim"), devices())
        assert ok.plan is not None, ok.error
        t0 = time.monotonic()
        out = await worker.plan(ModelSpec(model_id="huge", model=str(huge), engine="sim"), devices())
        assert time.monotonic() - t0 < 10
        assert out.status_code == 422 and ("took longer than 3s" in out.error or "cannot be planned" in out.error), out.error
        again = await worker.plan(ModelSpec(model_id="ok", model=str(fixture.parent), engine="sim"), devices())
        assert again.plan is not None
    finally:
        worker.close()


async def test_the_planner_starts_its_worker_before_the_first_plan(monkeypatch):
    """A deploy right after the hive starts must not wait ~5 s for the worker's imports."""
    import asyncio
    import importlib.util
    from pathlib import Path

    from hive_apps.control.planner import Planner
    from hive_apps.core.settings import get_settings

    monkeypatch.setenv("HIVE_HOOK_PACKAGES", "")  # the default: code hooks off (tests/conftest.py turns them on)
    get_settings.cache_clear()

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B"
    planner = Planner.__new__(Planner)
    await planner.__init__()  # Serve awaits an async constructor the same way
    try:
        assert planner.worker.warmed_at is None  # warming runs in the background: the constructor returns at once
        await asyncio.wait_for(planner._warming, 120)
        assert planner.worker.warmed_at is not None
        warmed = set(planner.worker._pool._processes)
        assert len(warmed) == 1
        out = await planner.plan(ModelSpec(model_id="ok", model=str(fixture), engine="sim"), devices())
        assert out.plan is not None, out.error
        assert set(planner.worker._pool._processes) == warmed  # the plan ran in the worker warmed at start
        # no hook packages, no remote code: the worker plans without torch (~400 MB it never uses)
        assert planner.worker._pool.submit(importlib.util.find_spec, "torch").result(30) is None
    finally:
        planner.worker.close()
        monkeypatch.undo()
        get_settings.cache_clear()


async def test_the_worker_loads_neither_the_replicas_main_file_nor_scikit_learn(tmp_path, monkeypatch):
    """In a Serve replica ``__main__`` is Ray's worker script: a spawned child would import all of Ray
    again. And transformers would import scikit-learn, which planning never uses."""
    import importlib.util
    import sys
    import types

    marker = tmp_path / "main-ran"
    main_file = tmp_path / "fake_worker_main.py"
    main_file.write_text(f"open({str(marker)!r}, 'w').close()\n")
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = str(main_file)
    fake_main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    worker = PlanWorker(timeout_s=30)
    try:
        await worker.warm_up()
        assert worker.warmed_at is not None
        assert fake_main.__file__ == str(main_file)  # restored once the process started
        assert not marker.exists()
        assert worker._pool.submit(importlib.util.find_spec, "sklearn").result(30) is None
        assert worker._pool.submit(importlib.util.find_spec, "json").result(30) is not None
        assert worker._pool.submit(importlib.util.find_spec, "torch").result(30) is not None  # user code may want it
    finally:
        worker.close()


def test_every_fixture_profiles_the_same_without_torch():
    """The plan worker blocks torch (no user code can run in it by default): profiles must not depend on it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from hive_apps.core.planning.profile import load_profile

    root = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs"
    folders = sorted(str(p) for p in root.iterdir() if (p / "config.json").exists())
    script = (
        "import sys, json; sys.modules['torch'] = None\n"
        "from hive_apps.core.planning.profile import load_profile\n"
        "out = {}\n"
        "for f in json.loads(sys.argv[1]):\n"
        "    try: out[f] = load_profile(f, {}).model_dump(mode='json')\n"
        "    except Exception as e: out[f] = type(e).__name__ + ': ' + str(e)\n"
        "print(json.dumps(out))\n")
    run = subprocess.run([sys.executable, "-c", script, json.dumps(folders)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr[-2000:]
    without = json.loads(run.stdout.strip().splitlines()[-1])
    for f in folders:
        try:
            with_torch = load_profile(f, {}).model_dump(mode="json")
        except Exception as e:  # noqa: BLE001 - the same refusal is expected
            with_torch = type(e).__name__ + ": " + str(e)
        assert without[f] == json.loads(json.dumps(with_torch)), Path(f).name
    assert len(folders) > 30


def test_the_hives_default_demand_reaches_the_plan():
    """HIVE_DEFAULT_DEMAND_SEQS (the Planner's ``demand_seqs``): a deploy without max_concurrency is
    sized for it; unset, throughput-first."""
    from pathlib import Path

    from hive_apps.control.planner import plan_or_error

    model = str(Path(__file__).resolve().parents[2] / "fixtures" / "model_configs" / "Qwen__Qwen3-0.6B")
    spec = ModelSpec(model_id="m", model=model, engine="sim", max_input_prompt_length=512, max_output_prompt_length=128)
    sized = plan_or_error(spec, devices(), demand_seqs=8).plan
    alone = plan_or_error(spec, devices()).plan
    assert sized is not None and alone is not None
    assert sized.replicas[0].settings.max_num_seqs == 8 < alone.replicas[0].settings.max_num_seqs
    assert sized.replicas[0].reservation_bytes < alone.replicas[0].reservation_bytes
