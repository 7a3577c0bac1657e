"""vLLM's own metrics beside the hive's: each engine hands vLLM the hive's load logger and vLLM's Ray
logger, and the dashboard names only series that logger exports (``ray_vllm_*``).

vLLM is not imported here (it takes seconds and the unit tier runs without it): the engine's glue
runs against stand-in modules, and the names are read from the installed vLLM's source. The real
export is checked end to end in tests/engine/test_vllm_metrics.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from hive_apps.ops.metrics import MetricDef

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "manifests" / "grafana-dashboard.json"


def vllm_source(relative: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """``vllm.v1.metrics.loggers`` and ``.ray_wrappers`` as two tiny modules: the engine imports only these."""
    loggers, wrappers = ModuleType("vllm.v1.metrics.loggers"), ModuleType("vllm.v1.metrics.ray_wrappers")
    loggers.StatLoggerBase = type("StatLoggerBase", (), {})
    wrappers.RayPrometheusStatLogger = type("RayPrometheusStatLogger", (), {})
    monkeypatch.setitem(sys.modules, loggers.__name__, loggers)
    monkeypatch.setitem(sys.modules, wrappers.__name__, wrappers)
    return SimpleNamespace(loggers=loggers, wrappers=wrappers)


def test_every_engine_reports_to_the_hives_logger_and_to_vllms_ray_logger(stand_in_vllm):
    from hive_apps.serving.engine.vllm_engine import LoadTracker, stat_loggers

    tracker = LoadTracker()
    hive_logger, ray_logger = stat_loggers(tracker)
    assert ray_logger is stand_in_vllm.wrappers.RayPrometheusStatLogger
    assert issubclass(hive_logger, stand_in_vllm.loggers.StatLoggerBase)
    # vLLM builds a per-engine logger as factory(vllm_config, engine_index): the hive's still feeds the router
    hive_logger(None, 0).record(SimpleNamespace(num_running_reqs=2, num_waiting_reqs=5, kv_cache_usage=0.5), None)
    assert (tracker.running, tracker.waiting, tracker.kv_cache_usage) == (2, 5, 0.5)
    # vLLM's prefix-cache counts per step add up in the load report (prompt tokens looked up, found)
    for queries, hits in ((300, 0), (340, 256)):
        stats = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1,
                                prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits))
        hive_logger(None, 0).record(stats, None)
    fields = tracker.counters.fields()
    assert (fields["prefix_cache_queries_total"], fields["prefix_cache_hits_total"]) == (640, 256)


def test_the_prefix_cache_stats_the_load_report_reads_are_vllms():
    stats = vllm_source("v1/metrics/stats.py")
    assert re.search(r"^\s+prefix_cache_stats: PrefixCacheStats", stats, re.M)
    assert re.search(r"^class BaseCacheStats:(.|\n)*?^\s+queries: int(.|\n)*?^\s+hits: int", stats, re.M)


def test_vllms_ray_logger_is_its_prometheus_logger_over_ray_metrics():
    """What the engine relies on in the installed vLLM: the Ray logger is an (aggregate) Prometheus
    logger, so vLLM builds it once for all engine indexes and adds no prometheus_client logger of its own."""
    wrappers = vllm_source("v1/metrics/ray_wrappers.py")
    assert re.search(r"^class RayPrometheusStatLogger\(PrometheusStatLogger\):", wrappers, re.M)
    loggers = vllm_source("v1/metrics/loggers.py")
    assert re.search(r"^class PrometheusStatLogger\(AggregateStatLoggerBase\):", loggers, re.M)
    assert "if isinstance(global_stat_logger, PrometheusStatLogger):" in loggers
    assert 'labelnames = ["model_name", "engine"]' in loggers


def vllm_exported_names() -> set[str]:
    """What Prometheus sees from vLLM's Ray logger: each ``vllm:<name>`` as Ray exports it
    (``:`` made ``_``, the ``ray_`` prefix, ``_total`` / ``_bucket`` ... suffixes as for the hive's own)."""
    found = re.findall(r'self\._(gauge|counter|histogram)_cls\(\s*name="vllm:(\w+)"', vllm_source("v1/metrics/loggers.py"))
    assert len(found) > 20, "vLLM's logger source no longer reads as expected"
    return {n for kind, name in found for n in MetricDef("vllm_" + name, kind, "", ()).exported()}


def test_the_dashboard_draws_vllm_ttft_and_kv_usage_with_names_vllm_exports():
    exported = vllm_exported_names()
    assert {"ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_prompt_tokens_total",
            "ray_vllm_kv_cache_usage_perc", "ray_vllm_e2e_request_latency_seconds_bucket"} <= exported
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    named = {n for e in exprs for n in re.findall(r"\bray_vllm_[a-z0-9_]+", e)}
    assert named <= exported, f"not exported by vLLM: {named - exported}"
    assert {"ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_kv_cache_usage_perc"} <= named
    ttft = [e for e in exprs if "time_to_first_token" in e]
    assert any("histogram_quantile(0.95" in e and "by (le, model_name)" in e for e in ttft), ttft


def test_the_dashboard_draws_vllm_latency_prefix_cache_and_queue_per_model():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]

    def quantiles(metric: str) -> set[str]:
        return {q for e in exprs if f"{metric}_bucket" in e and "by (le, model_name)" in e
                for q in re.findall(r"histogram_quantile\((0\.\d+)", e)}

    assert {"0.5", "0.95"} <= quantiles("ray_vllm_inter_token_latency_seconds")
    assert "0.95" in quantiles("ray_vllm_e2e_request_latency_seconds")
    assert "0.95" in quantiles("ray_vllm_request_queue_time_seconds")
    # hit rate: hits over queries (vLLM counts both in prompt tokens), per model
    assert any(re.search(r"sum by \(model_name\) \(rate\(ray_vllm_prefix_cache_hits_total\{.*\}\[\$__rate_interval\]\)\)"
                         r"\s*/\s*sum by \(model_name\) \(rate\(ray_vllm_prefix_cache_queries_total", e) for e in exprs)
    for state in ("running", "waiting"):
        assert any(f"sum by (model_name) (ray_vllm_num_requests_{state}" in e for e in exprs), state
    joined = []
    for p in panels:
        for t in p.get("targets", []):
            e = t["expr"]
            if "ray_vllm_" in e:  # the hive's $model picker filters vLLM's model_name (same values: the model id)
                assert 'model_name=~"$model"' in e, e
        mixed = [t["expr"] for t in p.get("targets", [])]
        if any("ray_hive_" in e for e in mixed) and any("ray_vllm_" in e for e in mixed):
            # a panel beside the hive's series names the model as the hive does: label "model"
            for e in mixed:
                assert "ray_hive_" in e or ('label_replace(' in e and '"model", "$1", "model_name", "(.*)")' in e), e
            assert all("{{model}}" in t["legendFormat"] for t in p["targets"]), p["title"]
            joined.append(p["title"])
    assert joined, "no panel draws vLLM's queue beside the hive's held requests"


def test_the_docs_name_what_vllm_exports():
    text = (ROOT / "docs" / "observability.md").read_text()
    named = set(re.findall(r"\bray_vllm_[a-z0-9_]+", text))
    assert {"ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_kv_cache_usage_perc"} <= named
    assert named <= vllm_exported_names(), named - vllm_exported_names()
