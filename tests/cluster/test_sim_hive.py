"""The whole control plane on a simulated three-node cluster, with the sim engine."""

import copy
import json
import time

import httpx
import openai
import pytest
import ray

from tests.cluster.conftest import SIM_MODEL
from tests.harness import API_KEY

pytestmark = pytest.mark.cluster


def sim_spec(model_id: str, **kw) -> dict:
    return {"model_id": model_id, "model": SIM_MODEL, "engine": "sim", "max_input_prompt_length": 512,
            "max_output_prompt_length": 128, "vllm_kwargs": {"sim_tokens_per_s": 500}, **kw}


def test_registry_lists_every_device(hive):
    gpus = hive.gpus()
    assert {"head:cpu", "node-a:gpu0", "node-a:gpu1", "node-b:gpu0", "node-b:gpu1", "node-b:gpu2"} <= set(gpus)
    a0 = gpus["node-a:gpu0"]
    assert a0["device"]["name"] == "H100-80GB" and a0["total_bytes"] == 80 * 2**30
    assert gpus["node-b:gpu2"]["device"]["name"] == "A10"
    assert gpus["head:cpu"]["device"]["kind"] == "cpu"
    for d in gpus.values():
        assert d["free_bytes"] + d["used_bytes"] == d["total_bytes"]


def test_deploy_chat_stream_delete(clean):
    hive = clean
    r = hive.deploy(**sim_spec("sim-chat", gpu="node-a:gpu0"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["route"] == "/sim-chat" and body["openai_v1"] == "/v1"
    r0 = body["replicas"]["r0"]
    assert r0["devices"] == ["node-a:gpu0"] and r0["settings"]["max_num_seqs"] >= 1
    reserved = hive.gpus()["node-a:gpu0"]
    assert reserved["reserved_bytes"] == r0["reservation_bytes"] > 0
    assert reserved["replicas"] == ["sim-chat/r0"]

    for base in (f"{hive.url}/v1", f"{hive.url}/sim-chat/v1"):
        client = openai.OpenAI(base_url=base, api_key=API_KEY)
        assert "sim-chat" in [m.id for m in client.models.list().data]
        out = client.chat.completions.create(model="sim-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.usage.completion_tokens == 4 and out.choices[0].message.content
        chunks = list(client.chat.completions.create(model="sim-chat", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 3
        comp = client.completions.create(model="sim-chat", prompt="once", max_tokens=2)
        assert comp.usage.completion_tokens == 2

    r = hive.admin.delete("/models/sim-chat")
    assert r.status_code == 200
    assert hive.gpus()["node-a:gpu0"]["reserved_bytes"] == 0
    assert "sim-chat" not in hive.wait_app_gone("sim-chat")
    models = httpx.get(f"{hive.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert "sim-chat" not in [m["id"] for m in models["data"]]


def test_pinned_replicas_on_different_cards_get_different_plans(clean):
    hive = clean
    r = hive.deploy(**sim_spec("sim-two", gpu=["node-a:gpu1", "node-b:gpu0"], replicas=2))
    assert r.status_code == 200, r.text
    reps = r.json()["replicas"]
    assert reps["r0"]["devices"] == ["node-a:gpu1"] and reps["r1"]["devices"] == ["node-b:gpu0"]
    assert reps["r0"]["settings"] != reps["r1"]["settings"]  # an H100 and an L4 are planned separately
    gpus = hive.gpus()
    assert gpus["node-a:gpu1"]["reserved_bytes"] > 0 and gpus["node-b:gpu0"]["reserved_bytes"] > 0
    client = openai.OpenAI(base_url=f"{hive.url}/v1", api_key=API_KEY)
    for _ in range(4):
        client.chat.completions.create(model="sim-two", messages=[{"role": "user", "content": "x"}], max_tokens=1)


def test_failed_deploy_leaves_nothing_behind(clean):
    hive = clean
    spec = sim_spec("sim-broken", gpu="node-b:gpu1")
    spec["vllm_kwargs"]["sim_fail_start"] = True
    before = hive.gpus()["node-b:gpu1"]["reserved_bytes"]
    r = hive.deploy(**spec)
    assert r.status_code == 422
    assert "sim_fail_start" in r.json()["error"]["message"]
    status = hive.admin.get("/models/sim-broken").json()
    assert status["status"] == "failed" and "sim_fail_start" in status["message"]
    assert hive.gpus()["node-b:gpu1"]["reserved_bytes"] == before
    assert "sim-broken" not in hive.serve_apps()
    # the same id can be deployed again once the cause is fixed
    spec["vllm_kwargs"]["sim_fail_start"] = False
    assert hive.deploy(**spec).status_code == 200


def test_async_deploy_returns_202_with_status_url(clean):
    hive = clean
    r = hive.deploy(wait=False, **sim_spec("sim-async"))
    assert r.status_code == 202
    url = r.json()["status_url"]
    assert url == "/admin/models/sim-async"
    deadline = time.time() + 120
    while hive.admin.get("/models/sim-async").json()["status"] != "ready":
        assert time.time() < deadline
        time.sleep(0.5)
    # auto placement of a sim engine picks a GPU, never the CPU node
    dev = hive.admin.get("/models/sim-async").json()["replicas"]["r0"]["devices"][0]
    assert ":gpu" in dev


def _kill_replica_of(app: str) -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{app}#" in a["name"]]
    assert names, f"no replica actor for {app}"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


@pytest.mark.parametrize("app", ["hive-registry", "hive-admin", "hive-gateway"])
def test_control_plane_restart_loses_nothing(clean, app):
    hive = clean
    assert hive.deploy(**sim_spec("durable", gpu="node-b:gpu0")).status_code == 200
    reserved = hive.gpus()["node-b:gpu0"]["reserved_bytes"]
    _kill_replica_of(app)
    deadline = time.time() + 90
    while True:
        try:
            r = hive.admin.get("/models/durable", timeout=5)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{app} did not come back"
        time.sleep(1)
    assert r.json()["status"] == "ready"
    assert hive.gpus()["node-b:gpu0"]["reserved_bytes"] == reserved
    out = hive.api.post("/v1/chat/completions", json={"model": "durable", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "still there?"}]})
    assert out.status_code == 200, out.text
    assert json.loads(out.text)["usage"]["completion_tokens"] == 2


def test_admin_openapi_docs(hive):
    assert httpx.get(f"{hive.url}/admin/docs").status_code == 200
    paths = httpx.get(f"{hive.url}/admin/openapi.json").json()["paths"]
    assert {"/models", "/models/{model_id}", "/plan", "/gpus", "/registry/reset", "/healthz"} <= set(paths)


def test_redeploying_the_base_config_and_reset_lose_nothing(clean):
    hive = clean
    assert hive.deploy(**sim_spec("keeper", gpu="node-b:gpu0")).status_code == 200
    before = {k: (v["reserved_bytes"], v["replicas"]) for k, v in hive.gpus().items()}
    hive.deploy_base_config()
    time.sleep(3)
    assert "keeper" in hive.serve_apps()
    assert hive.admin.get("/models/keeper").json()["status"] == "ready"
    assert {k: (v["reserved_bytes"], v["replicas"]) for k, v in hive.gpus().items()} == before
    r = hive.admin.post("/registry/reset")
    assert r.status_code == 200 and r.json()["reservations"] == 1
    from ray import serve

    (kept,) = serve.get_app_handle("hive-registry").reservations.remote("keeper").result()
    assert kept.state.value == "active"  # a running engine's reservation must not expire as pending
    assert {k: (v["reserved_bytes"], v["replicas"]) for k, v in hive.gpus().items()} == before
    out = hive.api.post("/keeper/v1/completions", json={"model": "keeper", "prompt": "x", "max_tokens": 1})
    assert out.status_code == 200


def with_declared(config: dict, models: list[dict]) -> dict:
    """The hive's Serve config with ``models`` in hive-admin's args."""
    out = copy.deepcopy(config)
    for app in out["applications"]:
        if app["name"] == "hive-admin":
            app["args"] = {"models": models}
    return out


def test_declared_models_follow_the_serve_config(clean):
    """A `serve deploy` that lists a model in hive-admin's args deploys it; one that no longer lists it
    deletes it; a model added with POST stays through both."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    hive = clean
    assert hive.deploy(**sim_spec("posted", gpu="node-b:gpu0")).status_code == 200
    serve_deploy = ServeSubmissionClient(hive.dashboard_url).deploy_applications
    try:
        serve_deploy(with_declared(hive.config, [sim_spec("listed", gpu="node-b:gpu1")]))
        deadline, body = time.time() + 120, {}
        while time.time() < deadline:
            r = hive.admin.get("/models/listed", timeout=10)
            body = r.json() if r.status_code == 200 else {}
            if body.get("status") == "ready":
                break
            time.sleep(1)
        assert body.get("status") == "ready" and body["origin"] == "declared", body
        report = hive.admin.get("/declared").json()
        assert report["declared"] and [e["outcome"] for e in report["entries"]] == ["deployed"], report
        out = hive.api.post("/v1/completions", json={"model": "listed", "prompt": "x", "max_tokens": 1})
        assert out.status_code == 200, out.text
    finally:
        hive.deploy_base_config()  # the list as shipped: empty
    deadline = time.time() + 120
    while time.time() < deadline and hive.admin.get("/models/listed", timeout=10).status_code != 404:
        time.sleep(1)
    assert hive.admin.get("/models/listed").status_code == 404
    posted = hive.admin.get("/models/posted").json()
    assert posted["status"] == "ready" and posted["origin"] == "api", posted
