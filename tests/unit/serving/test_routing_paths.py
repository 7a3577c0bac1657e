from hive_apps.serving.routing.paths import engine_route, is_models_list, model_object_id


def test_only_openai_routes_reach_an_engine():
    assert engine_route("POST", "/v1/chat/completions") == "/v1/chat/completions"
    assert engine_route("POST", "/v1/embeddings/") == "/v1/embeddings"
    for method, path in [("POST", "/hive/load"), ("GET", "/hive/load"), ("POST", "/tokenize"), ("GET", "/metrics"),
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
