"""vLLM's own metrics from a real engine replica reach Ray's metrics agent (issue #30): time to first
token, tokens, latencies and the scheduler's gauges, named ``ray_vllm_*`` and labelled with the
hive's model id, beside the hive's own series (its logger stays). See docs/observability.md.

Ray's processes report every 2 s here (the harness sets RAY_metrics_report_interval_ms) and the
agent exports what it got: the test polls with a deadline, as tests/cluster/test_observability.py does.
"""

import re
import threading
import time

import pytest

from tests.harness import scrape_metrics

pytestmark = pytest.mark.engine

PROMPT = "Count the bees in the metrics hive."
REQUESTS, MAX_TOKENS = 3, 4
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)(?: \d+)?$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def values(text: str, name: str, **labels: str) -> list[float]:
    """The value of every sample of ``name`` whose labels include ``labels``."""
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m["name"] == name and labels.items() <= dict(LABEL.findall(m["labels"])).items():
            out.append(float(m["value"]))
    return out


def label_sets(text: str, name: str, **labels: str) -> list[dict[str, str]]:
    return [dict(LABEL.findall(m["labels"])) for m in map(SAMPLE.match, text.splitlines())
            if m and m["name"] == name and labels.items() <= dict(LABEL.findall(m["labels"])).items()]


def test_vllms_own_metrics_reach_rays_metrics_agent_labelled_with_the_model(hive, tiny):
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    for _ in range(REQUESTS):
        r = hive.api.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS

    def total(text: str, name: str, **labels: str) -> float:
        return sum(values(text, name, **labels))

    # counts include the engine's warm-up and earlier tests' requests: ours are a lower bound. The
    # scheduler's gauges are exported only while vLLM records steps, so a little traffic goes on
    # while the agent is polled.
    gauges = ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc")
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            hive.api.post("/v1/chat/completions", json=body)
            stop.wait(0.5)

    background = threading.Thread(target=traffic, daemon=True)
    background.start()
    deadline = time.monotonic() + 60
    try:
        while True:
            text = scrape_metrics(hive)
            ttft = total(text, "ray_vllm_time_to_first_token_seconds_count", model_name="tiny")
            prompt = total(text, "ray_vllm_prompt_tokens_total", model_name="tiny")
            hive_in = total(text, "ray_hive_tokens_total", model="tiny", direction="in")
            generated = total(text, "ray_vllm_generation_tokens_total", model_name="tiny")
            # every series is exported on its own schedule: wait for the slowest one we check below
            if (ttft >= REQUESTS and prompt > 0 and hive_in > 0 and generated >= REQUESTS * MAX_TOKENS
                    and all(values(text, g, model_name="tiny") for g in gauges)) or time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        stop.set()
        background.join(timeout=30)
    vllm_names = sorted({m["name"] for m in map(SAMPLE.match, text.splitlines()) if m and m["name"].startswith("ray_vllm_")})
    assert ttft >= REQUESTS, ("vLLM's TTFT histogram did not reach Ray's metrics agent", vllm_names)
    assert prompt > 0, ("vLLM's prompt token counter did not reach Ray's metrics agent", vllm_names)
    assert hive_in > 0, "the hive's own token counter stopped: its stat logger must stay beside vLLM's"

    # labelled as vLLM labels them: the served model name (the hive's model id) and the engine index
    (ttft_labels, *_) = label_sets(text, "ray_vllm_time_to_first_token_seconds_count", model_name="tiny")
    assert ttft_labels["engine"] == "0" and ttft_labels.get("ReplicaId"), ttft_labels  # the Serve replica
    assert values(text, "ray_vllm_time_to_first_token_seconds_bucket", model_name="tiny", le="+Inf")
    assert total(text, "ray_vllm_time_to_first_token_seconds_sum", model_name="tiny") > 0
    assert total(text, "ray_vllm_e2e_request_latency_seconds_count", model_name="tiny") >= REQUESTS
    assert total(text, "ray_vllm_inter_token_latency_seconds_count", model_name="tiny") >= REQUESTS  # a decode step each
    assert total(text, "ray_vllm_generation_tokens_total", model_name="tiny") >= REQUESTS * MAX_TOKENS
    for gauge in gauges:
        assert values(text, gauge, model_name="tiny"), f"{gauge} not exported"
    assert PROMPT not in text, "a prompt must never become a label"
