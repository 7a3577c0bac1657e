from hive_apps.registry.locks import StartLocks


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
