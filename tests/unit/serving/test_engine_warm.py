"""An engine replica asleep warm (``EngineBase.rest``, issue 27): the engine stops, the process stays;
a wake starts the engine again in it. The shell's steps run here on the sim engine, with the
engine's own stop and start replaced by counters (vLLM's are the engine tier's:
``tests/engine/test_park_and_wake.py``)."""

import aiohttp
import pytest

from hive_apps.core import names
from hive_apps.core.devices import DeviceKind
from hive_apps.core.state.records import ModelStatus, SleepMode
from hive_apps.serving.engine.http_server import TOKEN_HEADER
from hive_apps.serving.engine.sim_engine import SimEngine
from tests.unit.helpers import replica_plan
from tests.unit.serving.test_engine_http import CHAT


class KeptSim(SimEngine):
    """A sim engine that can sleep warm: its stop and start are counted."""

    stops = starts = 0

    def can_rest(self) -> bool:
        return True

    async def _rest(self) -> None:
        self.stops += 1

    async def _restart(self) -> float:
        self.starts += 1
        self.answer = None
        return await self.warm_up()


async def kept(**kw) -> KeptSim:
    rp = replica_plan(sim_tokens_per_s=5000, **kw).model_copy(
        update={"devices": ["n:cpu"], "device_kind": DeviceKind.CPU, "device_indices": []})
    e = KeptSim.__new__(KeptSim)
    await e.__init__("sim-model", "", rp, use_start_lock=False)
    return e


async def chat(e: SimEngine) -> int:
    endpoint = e.endpoint()
    assert endpoint is not None
    async with aiohttp.ClientSession() as s, s.post(endpoint.url + "/v1/chat/completions", json=CHAT,
                                                    headers={TOKEN_HEADER: endpoint.token}) as r:
        return r.status


async def test_rest_stops_the_engine_and_its_port_keeps_the_process_and_says_what_it_holds():
    e = await kept()
    before = e.endpoint()
    assert await chat(e) == 200
    report = await e.rest()
    assert e.resting and e.stops == 1 and e.endpoint() is None, "the port goes with the engine"
    assert report.residual_bytes is not None and set(report.residual_bytes) == {"n:cpu"}
    assert 20 * 2**20 < report.residual_bytes["n:cpu"] < 8 * 2**30, "this process's own resident memory"
    assert (await e.rest()).residual_bytes == report.residual_bytes and e.stops == 1, "idempotent"
    assert e.info()["resting"] and e.info()["can_rest"]

    woke = await e.wake_up()
    assert not e.resting and e.starts == 1 and e.residual_bytes is None
    assert woke["warm_up_s"] >= 0 and woke["wake_s"] >= 0
    after = e.endpoint()
    assert after is not None and after.url != before.url, "a new port with the new engine"
    assert await chat(e) == 200
    assert (await e.wake_up())["wake_s"] < 0.5 and e.starts == 1, "awake: nothing to start"
    await e.http.stop()


async def test_an_engine_that_cannot_rest_refuses_to():
    e = await kept()
    e.can_rest = lambda: False  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="cannot sleep warm"):
        await e.rest()
    await e.http.stop()


class Registry:
    def __init__(self, rec):
        self.rec = rec

        class Call:
            @staticmethod
            async def remote(model_id):
                if isinstance(rec, Exception):
                    raise rec
                return rec

        self.get_model = Call()


class Seam:
    def __init__(self, rec):
        self.registry = Registry(rec)

    def app_handle(self, name):
        assert name == names.REGISTRY_APP
        return self.registry


@pytest.mark.parametrize(("record", "warm"), [
    ({"status": ModelStatus.SLEEPING, "resident": False, "sleep_mode": SleepMode.WARM}, True),
    ({"status": ModelStatus.SLEEPING, "resident": True, "sleep_mode": SleepMode.WARM}, False),  # still dozing
    ({"status": ModelStatus.SLEEPING, "resident": False, "sleep_mode": SleepMode.PARKED}, False),
    ({"status": ModelStatus.WAKING, "resident": True, "sleep_mode": SleepMode.WARM}, False),
    ({"status": ModelStatus.DEPLOYING, "resident": True, "sleep_mode": None}, False),
    (None, False),  # no record
    (TimeoutError(), False),  # no registry answer: start
])
async def test_a_replica_started_again_while_its_model_sleeps_warm_comes_up_without_its_engine(record, warm):
    from types import SimpleNamespace

    e = await kept()
    e._seam = Seam(record if record is None or isinstance(record, Exception) else SimpleNamespace(**record))
    assert await e.asleep_warm_now() is warm
    await e.http.stop()


async def test_a_starting_engine_reads_its_weights_into_the_page_cache_when_the_node_has_room(tmp_path, monkeypatch):
    import asyncio
    import os
    from types import SimpleNamespace

    import psutil

    from hive_apps.core.weights import page_cache

    weights = tmp_path / "model.safetensors"
    with open(weights, "wb") as f:
        f.write(os.urandom(16 * 2**20))
        f.flush()
        os.fsync(f.fileno())
    e = await kept()
    page_cache.drop(tmp_path)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=16 * 2**20))
    e.read_weights_ahead(str(tmp_path))  # twice what is missing is more than the node has: nothing read
    await asyncio.sleep(0.3)
    assert page_cache.cached_bytes(tmp_path)[0] < 2**20
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * 2**30))
    e.read_weights_ahead(str(tmp_path))
    for _ in range(50):
        if page_cache.cached_bytes(tmp_path)[0] == weights.stat().st_size:
            break
        await asyncio.sleep(0.1)
    assert page_cache.cached_bytes(tmp_path) == (weights.stat().st_size,) * 2
    await e.http.stop()
