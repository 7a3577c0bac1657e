import importlib.util
import re
from pathlib import Path

from hive_apps.serving.routing.paths import ENGINE_ROUTES, engine_route, is_models_list, missing_model, model_object_id

# what a client sends (on /v1, or below /<model_id>) -> the vLLM 0.32 route it reaches
ROUTE_TABLE = {
    ("POST", "/v1/chat/completions"): "/v1/chat/completions",
    ("POST", "/v1/completions"): "/v1/completions",
    ("POST", "/v1/embeddings"): "/v1/embeddings",
    ("POST", "/v1/responses"): "/v1/responses",
    ("GET", "/v1/responses/resp_0a1b2c"): "/v1/responses/resp_0a1b2c",
    ("POST", "/v1/responses/resp_0a1b2c/cancel"): "/v1/responses/resp_0a1b2c/cancel",
    ("POST", "/v1/audio/transcriptions"): "/v1/audio/transcriptions",
    ("POST", "/v1/audio/translations"): "/v1/audio/translations",
    ("POST", "/v1/score"): "/score", ("POST", "/score"): "/score",
    ("POST", "/v1/rerank"): "/rerank", ("POST", "/rerank"): "/rerank", ("POST", "/v2/rerank"): "/v2/rerank",
    ("POST", "/v1/classify"): "/classify", ("POST", "/classify"): "/classify",
    ("POST", "/v1/tokenize"): "/tokenize", ("POST", "/tokenize"): "/tokenize",
    ("POST", "/v1/detokenize"): "/detokenize", ("POST", "/detokenize"): "/detokenize",
}


def test_each_openai_route_reaches_vllms_own():
    for (method, path), vllm_route in ROUTE_TABLE.items():
        assert engine_route(method, path) == vllm_route, (method, path)
        assert engine_route(method, path + "/") == vllm_route, (method, path)


def test_every_route_the_hive_forwards_to_is_one_vllm_serves():
    """Read from the installed vLLM's routers, so a vLLM upgrade that moves a route fails here."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    vllm = Path(spec.origin).parent / "entrypoints"
    declared = set()
    for router in vllm.rglob("api_router.py"):
        text = router.read_text()
        for method, route in re.findall(r'@router\.(post|get)\(\s*"([^"]+)"', text):
            declared.add((method.upper(), route.replace("{response_id}", "resp_0a1b2c")))
    for (method, _), vllm_route in ROUTE_TABLE.items():
        assert (method, vllm_route) in declared, (method, vllm_route)
    assert set(ENGINE_ROUTES.values()) <= {r for _, r in declared}


def test_only_openai_routes_reach_an_engine():
    assert engine_route("POST", "/v1/chat/completions") == "/v1/chat/completions"
    assert engine_route("POST", "/v1/embeddings/") == "/v1/embeddings"
    for method, path in [("POST", "/hive/load"), ("GET", "/hive/load"), ("GET", "/tokenize"), ("GET", "/metrics"),
                         ("GET", "/v1/responses"), ("POST", "/v1/responses/resp_1"), ("GET", "/v1/responses/resp_1/cancel"),
                         ("GET", "/v1/responses/../models"), ("GET", "/v1/responses/a%2fb"), ("GET", "/v1/responses/a.b"),
                         ("POST", "/pooling"), ("POST", "/v2/embed"), ("POST", "/v1/chat/completions/batch"),
                         ("GET", "/tokenizer_info"), ("POST", "/v1/messages"), ("GET", "/server_info"),
                         ("POST", "/v1/../hive/load"), ("POST", "/v1/./chat/completions"), ("POST", "//v1/completions"),
                         ("POST", "/v1/chat%2fcompletions"), ("POST", "/v1\\chat/completions"), ("GET", "/v1/completions"),
                         ("POST", "/v1/load_lora_adapter"), ("POST", "/sleep"), ("POST", "/v1/chat/completions/..")]:
        assert engine_route(method, path) is None, (method, path)


def test_models_routes():
    assert is_models_list("GET", "/v1/models") and is_models_list("GET", "/v1/models/")
    assert not is_models_list("POST", "/v1/models")
    assert model_object_id("GET", "/v1/models/qwen3") == "qwen3"
    assert model_object_id("GET", "/v1/models/") is None and model_object_id("GET", "/v1/models/../x") is None


def test_bodies_openai_would_refuse_are_400s():
    from hive_apps.serving.routing.paths import body_problem

    chat = "/v1/chat/completions"
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert body_problem(chat, ok) is None
    assert body_problem(chat, None)[1] == "body"
    assert body_problem(chat, {"messages": ok["messages"]})[1] == "model"
    msg, param = body_problem(chat, {**ok, "messages": [{"role": "wizard", "content": "x"}]})
    assert "'wizard'" in msg and param == "messages.[0].role"
    assert body_problem(chat, {**ok, "messages": []})[1] == "messages"
    assert body_problem("/v1/completions", {"model": "m", "prompt": "x"}) is None
    assert body_problem("/v1/audio/transcriptions", None) is None  # multipart: the engine checks it
    assert body_problem("/v1/responses/resp_1/cancel", None) is None  # a response id: no body
    for route in ("/tokenize", "/detokenize", "/classify", "/score", "/rerank", "/v2/rerank"):
        assert body_problem(route, {"prompt": "x"})[1] == "model", route


def test_a_request_without_a_model_is_told_where_to_name_one():
    assert "?model=" in missing_model("GET", "/v1/responses/resp_1")
    assert "multipart form" in missing_model("POST", "/v1/audio/transcriptions")
    assert "JSON" in missing_model("POST", "/v1/tokenize")
