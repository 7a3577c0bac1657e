"""The hive's own history (core/history.py): one-minute points, bounded, and read back after a restart."""

from __future__ import annotations

import json

import pytest

from hive_apps.core.buckets import TTFT_BOUNDS_S
from hive_apps.core.history import (
    KEEP_S,
    MAX_SERIES,
    MAX_WAKES,
    MINUTE_S,
    History,
    Totals,
    WakePoint,
    bucket_quantile,
    delta,
)
from hive_apps.serving.engine.protocol import EngineCounters

T0 = 1_800_000_000.0 - 1_800_000_000.0 % MINUTE_S  # a minute's start


def req(n: int) -> dict[str, Totals]:
    """One replica's counters with only requests counted."""
    return {"r0": Totals(requests=n)}


def engine_totals(c: EngineCounters, requests: int = 0) -> Totals:
    """What the admin's keeper makes of an engine's load report (control/admin/history.py)."""
    f = c.fields()
    return Totals(requests=requests, prompt_tokens=f["prompt_tokens_total"], generation_tokens=f["generation_tokens_total"],
                  ttft_buckets=f["ttft"].buckets, ttft_count=f["ttft"].count, ttft_sum_s=f["ttft"].sum_s)


def test_requests_per_second_come_from_counter_deltas_and_peaks_are_kept():
    h = History(since=T0)
    h.model("m", T0 + 0, totals=req(100), running=1, capacity=8)
    h.model("m", T0 + 10, totals=req(130), running=5, waiting=2, capacity=8)
    h.model("m", T0 + 20, totals=req(150), running=2, capacity=8)
    (p,) = h.view(T0 + 30)["models"]["m"]
    assert p["t"] == T0 and p["requests"] == 50 and p["requests_per_s"] == 2.5
    assert (p["running"], p["waiting"], p["capacity"], p["resident"]) == (5, 2, 8, True)
    h.model("m", T0 + 70, totals=req(10))  # an engine restarted: its counter began again
    pts = h.view(T0 + 80)["models"]["m"]
    assert [q["t"] for q in pts] == [T0, T0 + MINUTE_S] and pts[1]["requests"] == 10


def test_an_asleep_model_counts_nothing_and_a_long_gap_is_not_traffic():
    h = History(since=T0)
    h.model("m", T0, totals=req(5))
    h.model("m", T0 + 30, resident=False)
    h.model("m", T0 + 60, totals=req(500))  # woke: a new counter, nothing to subtract from
    h.model("m", T0 + 600, totals=req(900))  # nine minutes unread: not spread over one point
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
        h.model("m", T0 + i * MINUTE_S, totals=req(i))
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
    h.model("m", T0, totals=req(1))
    h.model("gone", T0, totals=req(1))
    h.model("m", T0 + KEEP_S, totals=req(2))
    back = History.resume(h.dump(), T0 + KEEP_S + 5)
    assert back.since == T0 and back.restarts == [T0 + KEEP_S + 5] and back.reads == {}
    assert "gone" not in back.models and len(back.models["m"]) == 1  # trimmed on the way in
    fresh = History.resume(b"{not json", T0)
    assert fresh.since == T0 and fresh.restarts == [] and History.resume(None, T0).models == {}
    assert json.loads(json.dumps(back.view(T0)))["since"] == T0


# --- tokens/s and p50 TTFT (issue 31) ------------------------------------------------------------
def test_the_quantile_interpolates_inside_its_bucket_as_prometheus_does():
    bounds = (0.1, 0.5, 1.0)
    assert bucket_quantile(0.5, bounds, [0, 10, 10], 10) == pytest.approx(0.3)  # all in (0.1, 0.5]: its middle
    assert bucket_quantile(0.5, bounds, [4, 4, 8], 8) == pytest.approx(0.1)  # rank 4: the first bucket's top
    assert bucket_quantile(0.5, bounds, [2, 6, 8], 8) == pytest.approx(0.1 + 0.4 * 2 / 4)
    assert bucket_quantile(0.5, bounds, [2, 2, 2], 2) == pytest.approx(0.05)  # the first bucket runs from 0
    assert bucket_quantile(0.5, bounds, [0, 0, 1], 5) == 1.0  # past the last bound: the last bound
    assert bucket_quantile(0.9, bounds, [1, 2, 10], 10) == pytest.approx(0.5 + 0.5 * 7 / 8)
    assert bucket_quantile(0.5, bounds, [], 0) is None and bucket_quantile(0.5, bounds, [1, 1], 1) is None
    assert bucket_quantile(0.5, bounds, [0, 0, 0], 0) is None


def test_delta_is_what_the_counters_took_and_a_restart_takes_the_new_count():
    prev = Totals(requests=10, prompt_tokens=100, generation_tokens=50, ttft_buckets=[1, 3, 4], ttft_count=4, ttft_sum_s=2.0)
    cur = Totals(requests=15, prompt_tokens=160, generation_tokens=90, ttft_buckets=[1, 5, 7], ttft_count=8, ttft_sum_s=5.0)
    d = delta(prev, cur)
    assert (d.requests, d.prompt_tokens, d.generation_tokens) == (5, 60, 40)
    assert d.ttft_buckets == [0, 2, 3] and d.ttft_count == 4 and d.ttft_sum_s == pytest.approx(3.0)
    restarted = Totals(requests=2, prompt_tokens=20, generation_tokens=9, ttft_buckets=[0, 1, 2], ttft_count=2, ttft_sum_s=1.0)
    d = delta(cur, restarted)  # counters went back: the engine began again, all of its new count is new
    assert (d.requests, d.prompt_tokens, d.generation_tokens, d.ttft_buckets, d.ttft_count) == (2, 20, 9, [0, 1, 2], 2)
    # one bucket went back while the totals grew: a restart as well
    d = delta(cur, Totals(requests=20, prompt_tokens=200, generation_tokens=100, ttft_buckets=[0, 9, 9], ttft_count=9))
    assert d.requests == 20 and d.ttft_buckets == [0, 9, 9]
    # an engine from before the histogram sends no buckets: tokens still count, no TTFT is made up
    old = Totals(requests=20, prompt_tokens=200, generation_tokens=100)
    d = delta(old, old.model_copy(update={"generation_tokens": 110}))
    assert d.ttft_buckets == [] and d.ttft_count == 0 and d.generation_tokens == 10
    # counted before without buckets, now with them: nothing to subtract them from, so none are taken
    assert delta(Totals(requests=1, ttft_count=3), cur).ttft_count == 0
    assert delta(Totals(), cur).ttft_buckets == [1, 5, 7]  # a new engine: from zero
    assert delta(prev, cur.model_copy(update={"ttft_buckets": [1, 5]})).ttft_buckets == []  # other bounds


def test_tokens_per_second_and_p50_ttft_come_from_the_replicas_counters():
    a, b = EngineCounters(), EngineCounters()
    a.tokens(1000, 10)
    a.first_token(0.03)  # before the first read: not this minute's
    h = History(since=T0)
    h.model("m", T0, totals={"r0": engine_totals(a), "r1": engine_totals(b)})
    for _ in range(9):  # 9 first tokens in (0.2, 0.25] s on r0, one slow one on r1
        a.first_token(0.22)
    a.tokens(300, 200)
    b.tokens(100, 100)
    b.first_token(30.0)
    h.model("m", T0 + 10, totals={"r0": engine_totals(a, requests=9), "r1": engine_totals(b, requests=1)})
    (p,) = h.view(T0 + 20)["models"]["m"]
    assert p["requests"] == 10 and p["requests_per_s"] == 1.0
    assert (p["prompt_tokens"], p["generation_tokens"]) == (400, 300), "both replicas' deltas, not the totals"
    assert p["prompt_tokens_per_s"] == 40.0 and p["generation_tokens_per_s"] == 30.0
    assert p["ttft_count"] == 10
    # rank 5 of 10: all 9 fast ones are in (0.1, 0.25]; linear inside it: 0.1 + 0.15 * 5 / 9
    assert p["ttft_p50_s"] == pytest.approx(0.1 + 0.15 * 5 / 9, abs=1e-4)
    assert p["ttft_mean_s"] == pytest.approx((9 * 0.22 + 30.0) / 10, abs=1e-4)
    assert "ttft_buckets" not in p and "seconds" not in p

    # the next read in the same minute: its first tokens join the minute's, the median moves
    for _ in range(20):
        b.first_token(3.0)  # (2.5, 5.0]
    h.model("m", T0 + 20, totals={"r0": engine_totals(a, requests=9), "r1": engine_totals(b, requests=21)})
    (p,) = h.view(T0 + 30)["models"]["m"]
    assert p["ttft_count"] == 30 and p["requests_per_s"] == 1.5  # 30 requests over 20 s
    lo, hi = TTFT_BOUNDS_S.index(2.5), TTFT_BOUNDS_S.index(5.0)
    assert TTFT_BOUNDS_S[lo] < p["ttft_p50_s"] <= TTFT_BOUNDS_S[hi]  # rank 15 of 30: among the 3 s ones
    assert p["ttft_p50_s"] == pytest.approx(2.5 + 2.5 * (15 - 9) / 20, abs=1e-4)

    # a minute with no first token has no p50 (not a zero); a closed minute keeps its p50, not its buckets
    h.model("m", T0 + MINUTE_S + 5, totals={"r0": engine_totals(a, requests=9), "r1": engine_totals(b, requests=21)})
    pts = h.view(T0 + MINUTE_S + 6)["models"]["m"]
    assert pts[1]["ttft_p50_s"] is None and pts[1]["generation_tokens_per_s"] == 0.0 and pts[0]["ttft_p50_s"] > 0
    assert h.models["m"][0].ttft_buckets == [] and h.models["m"][0].ttft_p50_s == pts[0]["ttft_p50_s"]


def test_a_replica_that_restarted_or_was_away_is_not_a_spike():
    h = History(since=T0)
    h.model("m", T0, totals={"r0": Totals(requests=1000, generation_tokens=50_000), "r1": Totals(requests=500)})
    # r1 was scaled in: the model's sum fell, yet r0's own delta is all that counts
    h.model("m", T0 + 10, totals={"r0": Totals(requests=1010, generation_tokens=50_100)})
    (p,) = h.view(T0 + 10)["models"]["m"]
    assert (p["requests"], p["generation_tokens"]) == (10, 100)
    # r0 restarted (its counters began again) and r2 is new: r0's new count, nothing yet of r2
    h.model("m", T0 + 20, totals={"r0": Totals(requests=3, generation_tokens=30), "r2": Totals(requests=7000)})
    (p,) = h.view(T0 + 20)["models"]["m"]
    assert (p["requests"], p["generation_tokens"]) == (13, 130)
    assert set(h.reads["m"]) == {"r0", "r1", "r2"}
    h.model("m", T0 + 200, totals={"r0": Totals(requests=4)})  # over two minutes later: r1's and r2's reads go
    assert set(h.reads["m"]) == {"r0"} and h.view(T0 + 200)["models"]["m"][-1]["requests"] == 0


def test_a_history_stored_before_the_token_counters_is_still_read_back():
    old = {"since": T0, "restarts": [], "counters": {"m": [T0, 5]},
           "models": {"m": [{"t": T0, "requests": 3, "seconds": 30.0, "running": 1, "waiting": 0, "capacity": 8,
                             "resident": True}]}, "devices": {}, "wakes": {}}
    back = History.resume(json.dumps(old).encode(), T0 + 30)
    assert back.restarts == [T0 + 30] and back.models["m"][0].requests == 3
    (p,) = back.view(T0 + 30)["models"]["m"]
    assert p["generation_tokens_per_s"] == 0.0 and p["ttft_p50_s"] is None and p["requests_per_s"] == 0.1
