"""The minimum residency (``hive_apps/core/lifecycle.py``): ski rental on both sides of an eviction.
A model that became ready is kept its own wake cost, and the model waiting for room honours that
its own wake cost, each at most HIVE_MIN_RESIDENCY_S. So the wait behind another model's residency
is at most one wake, and two models that alternate cannot swap faster than they wake."""

from __future__ import annotations

import random

import pytest

from hive_apps.core.lifecycle import eviction_order, protection_ends, protection_s
from tests.unit.core.test_lifecycle import cand

CAP = 60.0


def evictable(c, now: float, waited: float, waiter_wake: float | None, cap: float = CAP) -> bool:
    order, _ = eviction_order([c], now, cap, waited, waiter_wake)
    return [x.model_id for x in order] == [c.model_id]


def test_a_model_that_woke_is_kept_its_own_wake_cost_at_most_the_cap():
    assert protection_s(20.0, CAP) == 20.0 and protection_s(100.0, CAP) == CAP and protection_s(None, CAP) == CAP
    cheap, dear = cand("cheap", wake_cost_s=20.0, resident_since=1000.0), cand("dear", wake_cost_s=500.0, resident_since=1000.0)
    assert not evictable(cheap, 1019.9, 0.0, 500.0) and evictable(cheap, 1020.0, 0.0, 500.0)
    assert not evictable(dear, 1059.9, 0.0, 500.0) and evictable(dear, 1060.0, 0.0, 500.0)  # the cap
    assert evictable(dear, 1000.0, 0.0, 500.0, cap=0.0)  # HIVE_MIN_RESIDENCY_S=0: no protection at all


def test_the_waiter_stops_honouring_protections_once_it_waited_its_own_wake():
    fresh = cand("fresh", wake_cost_s=500.0, resident_since=1000.0)  # kept 60 s
    assert not evictable(fresh, 1001.0, 22.9, 23.0) and evictable(fresh, 1001.0, 23.0, 23.0)
    assert not evictable(fresh, 1001.0, 59.9, 500.0) and evictable(fresh, 1001.0, 60.0, 500.0)  # the cap
    assert not evictable(fresh, 1001.0, 59.9, None) and evictable(fresh, 1001.0, 60.0, None)  # unknown: the cap


def test_the_refusal_says_how_long_is_left_for_this_waiter():
    fresh = cand("fresh", wake_cost_s=40.0, resident_since=1000.0)
    _, refused = eviction_order([fresh], 1010.0, CAP, waited_s=5.0, waiter_wake_s=30.0)
    assert "woke 10s ago" in refused[0].reason and "minimum residency, 25s left" in refused[0].reason  # its waiter
    _, refused = eviction_order([fresh], 1010.0, CAP, waited_s=5.0, waiter_wake_s=100.0)
    assert "minimum residency, 30s left" in refused[0].reason  # its own wake
    assert protection_ends([fresh], 1010.0, CAP, 1005.0, 30.0) == pytest.approx(1035.0)
    assert protection_ends([fresh], 1010.0, CAP, 1005.0, 100.0) == pytest.approx(1040.0)
    assert protection_ends([fresh], 1010.0, CAP, 980.0, 30.0) is None  # it waited its wake: nothing holds it


def test_keep_resident_no_sleep_timeout_and_in_flight_hold_however_long_the_waiter_waited():
    others = [cand("pinned", keep_resident=True), cand("static", can_sleep=False), cand("serving", in_flight=1)]
    order, refused = eviction_order(others, 1e6, CAP, waited_s=1e5, waiter_wake_s=1.0)
    assert order == [] and {r.model_id for r in refused} == {"pinned", "static", "serving"}
    assert "keep_resident" in refused[0].reason and "1 requests in flight" in refused[2].reason
    assert protection_ends(others, 1e6, CAP, 0.0, 1.0) is None  # no protection to wait out: a request must end


def test_the_wait_behind_any_residencies_is_at_most_one_wake_of_the_waiter():
    """Random candidates (some just woke, with any wake cost): a waiter that retries when
    ``protection_ends`` says has every protected one evictable within its own wake (capped)."""
    rng = random.Random(7)
    for _ in range(500):
        start = 1000.0
        cands = [cand(f"m{i}", wake_cost_s=rng.uniform(0.5, 150.0), resident_since=start - rng.uniform(0, 80))
                 for i in range(rng.randint(1, 5))]
        own = rng.choice([None, rng.uniform(0.5, 150.0)])
        since = start - rng.uniform(0, 30)
        t, tries = start, 0
        while len(eviction_order(cands, t, CAP, t - since, own)[0]) < len(cands):
            nxt = protection_ends(cands, t, CAP, since, own)
            assert nxt is not None and nxt > t  # something still protected: it says when that ends
            t, tries = nxt + 1e-9, tries + 1
            assert tries <= len(cands) + 1
        assert t - since <= max(protection_s(own, CAP), start - since) + 1e-6
        for c in cands:  # and none went before its own protection, unless the waiter had waited its own
            assert t - c.resident_since >= protection_s(c.wake_cost_s, CAP) - 1e-6 or \
                t - since >= protection_s(own, CAP) - 1e-6 or t == start


def alternate(wake: dict[str, float], serve_s: float, think_s: float, seconds: float) -> list[tuple[float, str, float]]:
    """Two models share one slot and want it in turn: the evicted one asks again ``think_s`` after
    its eviction (0: at once, the worst case), and the one that woke serves its held requests for
    ``serve_s``. Eviction by the product's rules; the waiter retries when ``protection_ends`` says,
    or when the requests in flight end. Returns (evicted at, victim, resident for)."""
    resident, waiter = "a", "b"
    ready, since, t = 0.0, think_s, think_s
    out = []
    while t < seconds:
        c = cand(resident, wake_cost_s=wake[resident], resident_since=ready, in_flight=int(t < ready + serve_s))
        order, _ = eviction_order([c], t, CAP, t - since, wake[waiter])
        if order:
            out.append((t, resident, t - ready))
            resident, waiter, ready, since = waiter, resident, t + wake[waiter], t + think_s
            t = max(since, ready)  # nothing to decide before the evicted one asks again, or the other is ready
        else:
            t = max(t + 1e-6, protection_ends([c], t, CAP, since, wake[waiter]) or ready + serve_s)
    return out


@pytest.mark.parametrize("wa,wb", [(20.0, 20.0), (3.0, 40.0), (90.0, 25.0), (100.0, 120.0)])
def test_two_alternating_models_cannot_swap_faster_than_they_wake(wa, wb):
    wake = {"a": wa, "b": wb}
    swaps = alternate(wake, serve_s=1.0, think_s=0.0, seconds=7200.0)
    for (t0, _, _), (t1, victim, _) in zip(swaps, swaps[1:]):
        assert t1 - t0 >= wake[victim] + 1.0 - 1e-6  # each swap waits for the other's whole wake and its requests
    assert len(swaps) <= 7200.0 / min(wa, wb) + 1
    # and when each asks again only once the other is serving, each stays its protection, capped
    swaps = alternate(wake, serve_s=1.0, think_s=max(wa, wb) + 1.0, seconds=7200.0)
    assert len(swaps) > 10
    for _, victim, stayed in swaps[1:]:
        other = "b" if victim == "a" else "a"
        assert stayed >= min(protection_s(wake[victim], CAP), protection_s(wake[other], CAP)) - 1e-6


def test_a_request_waits_at_most_one_wake_behind_a_model_that_just_woke():
    """The black-box run: a small model asked for while a large one (wake over the cap) just woke.
    Before, it waited the whole 60 s minimum residency; now at most its own wake."""
    big = cand("big", wake_cost_s=113.0, resident_since=1000.0)
    assert protection_ends([big], 1000.0, CAP, 1000.0, 23.0) == pytest.approx(1023.0)
    assert evictable(big, 1023.0, 23.0, 23.0)
    assert protection_ends([big], 1000.0, CAP, 1000.0, None) == pytest.approx(1060.0)  # a waiter of unknown wake: the cap
