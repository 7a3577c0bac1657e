"""Router behaviour on the simulated cluster: backpressure and failover."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from tests.cluster.conftest import SIM_MODEL

pytestmark = pytest.mark.cluster


def test_full_model_answers_429_with_retry_after(clean):
    hive = clean
    r = hive.deploy(model_id="narrow", model=SIM_MODEL, engine="sim", gpu="node-b:gpu1", max_queued_requests=2,
                    vllm_kwargs={"max_num_seqs": 2, "sim_tokens_per_s": 20})
    assert r.status_code == 200, r.text
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
