"""GET /admin/history's tokens/s and p50 TTFT (issue 31): the admin's keeper reads each replica's
cumulative counters (``EngineLoad``) through ``GET /admin/load``'s path and the history answers the
minute's rates, on the in-process admin of ``test_admin_app.py``."""

from __future__ import annotations

import pytest

from hive_apps.serving.engine.protocol import EngineCounters, EngineLoad
from tests.unit.control.test_admin_app import admin, eventually, sim_spec  # noqa: F401  (admin: the fixture)


async def test_history_answers_tokens_per_second_and_p50_ttft_from_the_engines_counters(admin):  # noqa: F811
    assert (await admin.deploy(**sim_spec("m", gpu="node-a:gpu0"))).status_code == 200
    keeper = admin.app.state.admin.history
    # its first turn reads the KV (a turn that failed, e.g. timed out behind a cold first plan, comes again in 10 s)
    assert await eventually(lambda: keeper.history is not None, timeout_s=30)
    c = EngineCounters()
    c.tokens(50, 4)  # before the first read: the baseline, not traffic
    c.first_token(0.01)
    admin.cluster.loads["m"] = EngineLoad(requests_total=1, max_num_seqs=8, **c.fields())
    await keeper.sample()
    c.tokens(600, 300)
    for _ in range(10):
        c.first_token(0.3)  # (0.25, 0.5]
    admin.cluster.loads["m"] = EngineLoad(requests_total=11, running=2, max_num_seqs=8, **c.fields())
    await keeper.sample()

    load = (await admin.client.get("/load")).json()["models"]["m"]["r0"]  # the counters as the keeper reads them
    assert load["generation_tokens_total"] == 304 and load["prompt_tokens_total"] == 650
    assert load["ttft"]["count"] == 11 and load["ttft"]["buckets"][-1] == 11

    r = await admin.client.get("/history")
    assert r.status_code == 200, r.text
    pts = r.json()["models"]["m"]
    assert sum(p["generation_tokens"] for p in pts) == 300 and sum(p["prompt_tokens"] for p in pts) == 600
    assert sum(p["requests"] for p in pts) == 10
    busy = [p for p in pts if p["ttft_count"]]
    assert len(busy) == 1 and busy[0]["ttft_count"] == 10
    assert busy[0]["ttft_p50_s"] == pytest.approx(0.25 + 0.25 * 5 / 10, abs=1e-4), "inside its bucket, linearly"
    assert busy[0]["ttft_mean_s"] == pytest.approx(0.3, abs=1e-4)
    assert busy[0]["generation_tokens_per_s"] > 0 and busy[0]["prompt_tokens_per_s"] > busy[0]["generation_tokens_per_s"]
    for p in pts:  # every point carries the fields, the open minute's buckets stay inside
        assert {"prompt_tokens_per_s", "generation_tokens_per_s", "ttft_p50_s", "ttft_count"} <= set(p)
        assert "ttft_buckets" not in p and "seconds" not in p
