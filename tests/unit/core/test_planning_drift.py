"""The plan against what vLLM's workers loaded (issue #24: vLLM measures nothing once
kv_cache_memory_bytes is set, so the engine compares for it)."""

from hive_apps.core.planning.drift import DRIFT_TOLERANCE, Loaded, loaded_drift

GIB = 1024**3


def test_a_plan_that_holds_reports_nothing():
    ranks = [Loaded(weights_bytes=int(1.02 * GIB), cuda_graph_bytes=int(0.95 * GIB))]
    assert loaded_drift(GIB, GIB, ranks) == {}


def test_weights_above_the_plan_are_an_under_estimate():
    out = loaded_drift(GIB, 0, [Loaded(weights_bytes=int(1.25 * GIB))])
    assert list(out) == ["weights"]
    assert "+25%" in out["weights"] and "above the plan" in out["weights"] and "under-estimate" in out["weights"]


def test_the_largest_rank_counts_and_graphs_below_the_plan_are_reported_too():
    ranks = [Loaded(weights_bytes=GIB, cuda_graph_bytes=GIB // 4), Loaded(weights_bytes=GIB, cuda_graph_bytes=GIB // 2)]
    out = loaded_drift(GIB, GIB, ranks)
    assert list(out) == ["cuda_graphs"] and "-50%" in out["cuda_graphs"] and "below the plan" in out["cuda_graphs"]


def test_no_graph_pool_is_not_compared_and_the_tolerance_is_a_bound():
    edge = int(GIB * (1 + DRIFT_TOLERANCE)) - 1
    assert loaded_drift(GIB, 2 * GIB, [Loaded(weights_bytes=edge, cuda_graph_bytes=None)]) == {}
    assert "cuda_graphs" in loaded_drift(0, 0, [Loaded(weights_bytes=0, cuda_graph_bytes=GIB)])
    assert loaded_drift(GIB, 0, []) == {}
    assert loaded_drift(GIB, GIB, [Loaded()]) == {}  # vLLM's CPU runner measures neither term
