from hive_apps.core.state.locks import StartLocks


def test_one_holder_per_device_all_or_nothing():
    locks = StartLocks()
    assert locks.try_acquire(["a:gpu0"], "m1/r0", 60, now=0)
    assert not locks.try_acquire(["a:gpu1", "a:gpu0"], "m2/r0", 60, now=1)
    assert locks.holder_of("a:gpu1", now=1) is None  # nothing taken by the failed attempt
    assert locks.try_acquire(["a:gpu0"], "m1/r0", 60, now=2)  # re-entrant for the same holder


def test_release_by_replica_or_model():
    locks = StartLocks()
    locks.try_acquire(["a:gpu0"], "m1/r0", 60, now=0)
    locks.try_acquire(["a:gpu1"], "m1/r1", 60, now=0)
    locks.try_acquire(["a:gpu2"], "m10/r0", 60, now=0)
    assert locks.release("m1/r0") == ["a:gpu0"]
    assert locks.release("m1") == ["a:gpu1"]  # not m10's lock
    assert locks.holder_of("a:gpu2", now=1) == "m10/r0"


def test_lease_frees_a_dead_holder():
    locks = StartLocks()
    locks.try_acquire(["a:gpu0"], "dead/r0", 10, now=0)
    assert not locks.try_acquire(["a:gpu0"], "m/r0", 10, now=5)
    assert locks.try_acquire(["a:gpu0"], "m/r0", 10, now=11)


class LockRegistry:
    """The registry's start-lock calls over a real ``StartLocks``, recording each grant."""

    def __init__(self):
        self.locks = StartLocks()
        self.granted: list[str] = []

    def acquire_start_lock(self, devices, holder, lease_s):
        got = self.locks.try_acquire(devices, holder, lease_s)
        if got:
            self.granted.append(holder)
        return got

    def release_start_lock(self, holder):
        self.locks.release(holder)

    def report_usage(self, holder, measured):
        pass


class LockCluster:
    def __init__(self, registry):
        self.registry = registry

    def app_handle(self, name):
        from tests.unit.fake_cluster import LocalHandle

        return LocalHandle(self.registry)


async def test_an_in_place_wake_waits_for_a_neighbours_start_on_its_device():
    """A wake takes gigabytes back on the device; a neighbour starting there measures its own
    footprint as an NVML delta, so the wake must wait for that start to settle (and the reverse)."""
    import asyncio

    from hive_apps.control.cluster import set_cluster
    from hive_apps.serving.engine.sim_engine import SimEngine
    from tests.unit.helpers import replica_plan

    registry = LockRegistry()
    set_cluster(LockCluster(registry))
    try:
        e = SimEngine.__new__(SimEngine)
        await e.__init__("m", "", replica_plan(sim_tokens_per_s=5000))
        await e.sleep(1)
        assert registry.granted == ["m/r0", "m/r0/sleep"] and not registry.locks.held

        assert registry.acquire_start_lock(["n:gpu0"], "neighbour/r0", 600)  # a neighbour starts there
        wake = asyncio.create_task(e.wake_up())
        await asyncio.sleep(1.2)
        assert not wake.done() and e.sleep_level == 1, "the wake went ahead during the neighbour's start"
        registry.release_start_lock("neighbour/r0")
        await asyncio.wait_for(wake, 10)
        assert registry.granted[-1] == "m/r0/wake" and e.sleep_level == 0
        assert not registry.locks.held, "the wake gives the lock back"
    finally:
        set_cluster(None)
        if e.http:
            await e.http.stop()
