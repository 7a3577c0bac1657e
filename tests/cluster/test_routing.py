"""Router behaviour on the simulated cluster: backpressure and failover."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from tests.cluster.conftest import SIM_MODEL

pytestmark = pytest.mark.cluster


def wait_routed(hive, model_id: str, timeout_s: float = 30) -> None:
    """Until Serve's proxy routes ``/<model_id>``: it learns a new app's route from Serve's controller
    on its own schedule, which can trail the deploy's ready by seconds on a loaded box (``/v1``, the
    hive's own gateway, routes a ready model at once)."""
    deadline = time.time() + timeout_s
    while hive.api.get(f"/{model_id}/v1/models").status_code == 404 and time.time() < deadline:
        time.sleep(0.2)


def test_full_model_answers_429_with_retry_after(clean):
    hive = clean
    r = hive.deploy(model_id="narrow", model=SIM_MODEL, engine="sim", gpu="node-b:gpu1", max_queued_requests=2,
                    vllm_kwargs={"max_num_seqs": 2, "sim_tokens_per_s": 20})
    assert r.status_code == 200, r.text
    wait_routed(hive, "narrow")
    body = {"model": "narrow", "max_tokens": 30, "messages": [{"role": "user", "content": "slow"}]}
    with ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(lambda _: hive.api.post("/narrow/v1/chat/completions", json=body), range(10)))
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    rejected = next(a for a in answers if a.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["type"] == "RateLimitError"
    # once the queue drains the model takes requests again
    assert hive.api.post("/v1/chat/completions", json={**body, "max_tokens": 1}).status_code == 200


def test_dead_replica_is_retried_elsewhere(clean):
    hive = clean
    r = hive.deploy(model_id="pair", model=SIM_MODEL, engine="sim", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2,
                    vllm_kwargs={"sim_tokens_per_s": 1000})
    assert r.status_code == 200, r.text
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "pair#engine-r0#" in a["name"]]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    body = {"model": "pair", "max_tokens": 2, "messages": [{"role": "user", "content": "anyone there?"}]}
    codes = [hive.api.post("/v1/chat/completions", json=body).status_code for _ in range(20)]
    assert codes == [200] * 20


def test_prompt_lists_and_n_are_split_across_replicas(clean):
    hive = clean
    r = hive.deploy(model_id="wide", model=SIM_MODEL, engine="sim", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2,
                    vllm_kwargs={"sim_tokens_per_s": 200})
    assert r.status_code == 200, r.text
    prompts = [f"prompt number {i}" for i in range(6)]
    out = hive.api.post("/v1/completions", json={"model": "wide", "prompt": prompts, "max_tokens": 3})
    assert out.status_code == 200, out.text
    assert sorted(out.headers["x-hive-replica"].split(",")) == ["r0", "r1"]
    body = out.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"]["completion_tokens"] == 18

    chat = {"model": "wide", "n": 4, "max_tokens": 2, "messages": [{"role": "user", "content": "four ways"}]}
    out = hive.api.post("/wide/v1/chat/completions", json=chat)
    assert out.status_code == 200, out.text
    assert sorted(out.headers["x-hive-replica"].split(",")) == ["r0", "r1"]
    assert [c["index"] for c in out.json()["choices"]] == [0, 1, 2, 3]

    # a seed keeps the samples on one replica, so the answer stays reproducible
    out = hive.api.post("/v1/chat/completions", json={**chat, "seed": 3})
    assert out.status_code == 200 and out.headers["x-hive-replica"] in ("r0", "r1")
    assert len(out.json()["choices"]) == 4


def test_a_hot_prefix_spills_to_the_other_replica_once_its_own_is_full(clean):
    """Prefix affinity yields to capacity (issue 28): requests that share one long system prompt go to the
    replica that holds it until its planned max_num_seqs are busy, then spill to the other; none is
    refused while either has room."""
    hive = clean
    r = hive.deploy(model_id="hot", model=SIM_MODEL, engine="sim", gpu=["node-a:gpu0", "node-b:gpu0"], replicas=2,
                    vllm_kwargs={"max_num_seqs": 2, "sim_tokens_per_s": 20})
    assert r.status_code == 200, r.text
    wait_routed(hive, "hot")
    system = {"role": "system", "content": "The hive's shared rules for every forager, read before each trip. " * 20}

    def ask(i: int, max_tokens: int = 60):
        body = {"model": "hot", "max_tokens": max_tokens,
                "messages": [system, {"role": "user", "content": f"forager {i}: where now?"}]}
        return hive.api.post("/hot/v1/chat/completions", json=body, timeout=60)

    first = ask(-1, max_tokens=1)  # the prompt's blocks now live on one replica
    assert first.status_code == 200, first.text
    home = first.headers["x-hive-replica"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(ask, range(4)))  # ~3 s each: four at once, two slots per replica
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    routed = sorted((a.headers["x-hive-replica"], a.headers["x-hive-route"]) for a in answers)
    assert sum(1 for where, why in routed if (where, why) == (home, "prefix")) == 2, routed
    # past its two slots the next request spills to the other replica; what follows goes wherever the
    # pressure is lowest (the spilled request's uncached prefill counts against its replica's budget)
    assert any(where != home and why == "least-loaded" for where, why in routed), f"nothing spilled: {routed}"
