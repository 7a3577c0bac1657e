"""The hive's own history (core/history.py): one-minute points, bounded, and read back after a restart."""

from __future__ import annotations

import json

from hive_apps.core.history import KEEP_S, MAX_SERIES, MAX_WAKES, MINUTE_S, History, WakePoint

T0 = 1_800_000_000.0 - 1_800_000_000.0 % MINUTE_S  # a minute's start


def test_requests_per_second_come_from_counter_deltas_and_peaks_are_kept():
    h = History(since=T0)
    h.model("m", T0 + 0, requests_total=100, running=1, capacity=8)
    h.model("m", T0 + 10, requests_total=130, running=5, waiting=2, capacity=8)
    h.model("m", T0 + 20, requests_total=150, running=2, capacity=8)
    (p,) = h.view(T0 + 30)["models"]["m"]
    assert p["t"] == T0 and p["requests"] == 50 and p["requests_per_s"] == 2.5
    assert (p["running"], p["waiting"], p["capacity"], p["resident"]) == (5, 2, 8, True)
    h.model("m", T0 + 70, requests_total=10)  # an engine restarted: its counter began again
    pts = h.view(T0 + 80)["models"]["m"]
    assert [q["t"] for q in pts] == [T0, T0 + MINUTE_S] and pts[1]["requests"] == 10


def test_an_asleep_model_counts_nothing_and_a_long_gap_is_not_traffic():
    h = History(since=T0)
    h.model("m", T0, requests_total=5)
    h.model("m", T0 + 30, resident=False)
    h.model("m", T0 + 60, requests_total=500)  # woke: a new counter, nothing to subtract from
    h.model("m", T0 + 600, requests_total=900)  # nine minutes unread: not spread over one point
    view = h.view(T0 + 600)["models"]["m"]
    assert [p["requests"] for p in view] == [0, 0, 0] and view[0]["resident"] is False


def test_devices_keep_the_most_seen_in_each_minute():
    h = History(since=T0)
    h.device("n:gpu0", T0 + 1, total=80, reserved=10, used=12, dormant=0)
    h.device("n:gpu0", T0 + 2, total=80, reserved=30, used=11, dormant=5)
    (p,) = h.view(T0 + 3)["devices"]["n:gpu0"]
    assert (p["reserved_bytes"], p["used_bytes"], p["dormant_bytes"], p["total_bytes"]) == (30, 12, 5, 80)


def test_everything_is_bounded():
    h = History(since=T0)
    for i in range(200):  # more than KEEP_S of minutes
        h.model("m", T0 + i * MINUTE_S, requests_total=i)
        h.wake("m", WakePoint(at=T0 + i * MINUTE_S, how="parked", total_s=3.0))
    for i in range(MAX_SERIES + 10):
        h.device(f"n:gpu{i}", T0 + 199 * MINUTE_S + i * 0.001, total=1, reserved=0, used=0, dormant=0)
    now = T0 + 199 * MINUTE_S
    h.trim(now)
    pts = h.models["m"]
    assert len(pts) == KEEP_S / MINUTE_S and pts[0].t > now - KEEP_S
    assert len(h.wakes["m"]) == MAX_WAKES and len(h.devices) == MAX_SERIES and "n:gpu0" not in h.devices
    h.wake("m", WakePoint(at=now, how="parked", total_s=3.0))  # the same wake read again
    assert len(h.wakes["m"]) == MAX_WAKES
    assert len(h.dump()) < 200_000


def test_a_new_admin_takes_the_history_over_and_says_it_restarted():
    h = History(since=T0)
    h.model("m", T0, requests_total=1)
    h.model("gone", T0, requests_total=1)
    h.model("m", T0 + KEEP_S, requests_total=2)
    back = History.resume(h.dump(), T0 + KEEP_S + 5)
    assert back.since == T0 and back.restarts == [T0 + KEEP_S + 5] and back.counters == {}
    assert "gone" not in back.models and len(back.models["m"]) == 1  # trimmed on the way in
    fresh = History.resume(b"{not json", T0)
    assert fresh.since == T0 and fresh.restarts == [] and History.resume(None, T0).models == {}
    assert json.loads(json.dumps(back.view(T0)))["since"] == T0
