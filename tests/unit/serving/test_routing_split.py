from hive_apps.serving.routing.policy import ReplicaView
from hive_apps.serving.routing.split import CHAT, COMPLETIONS, merge_answers, plan_split, proportional_shares


def view(index: int, capacity: int, load: int = 0, healthy: bool = True) -> ReplicaView:
    return ReplicaView(index=index, capacity=capacity, in_flight=load, healthy=healthy)


def test_shares_follow_free_capacity_and_add_up():
    assert proportional_shares([24, 8], 8) == [6, 2]
    assert proportional_shares([1, 1, 1], 4) == [2, 1, 1]
    assert proportional_shares([5, 0], 3) == [3, 0]
    assert proportional_shares([0, 0], 3) == [3, 0]
    for free, total in [([3, 7, 11], 13), ([1, 100], 2), ([9, 9], 1)]:
        assert sum(proportional_shares(free, total)) == total


def test_prompt_list_is_cut_in_order_by_free_room():
    views = [view(0, capacity=32, load=8), view(1, capacity=8)]  # free 24 and 8
    body = {"model": "m", "prompt": [f"p{i}" for i in range(8)], "max_tokens": 4, "n": 2}
    split = plan_split(COMPLETIONS, body, views)
    assert split.kind == "prompts"
    assert [(p.replica, p.body["prompt"], p.choices) for p in split.parts] == [
        (0, [f"p{i}" for i in range(6)], 12), (1, ["p6", "p7"], 4)]
    assert all(p.body["max_tokens"] == 4 and p.body["n"] == 2 for p in split.parts)


def test_n_is_cut_for_chat_and_completions():
    views = [view(0, 4), view(1, 4), view(2, 4, load=4)]  # the third is full
    split = plan_split(CHAT, {"model": "m", "messages": [], "n": 5}, views)
    assert split.kind == "n" and [(p.replica, p.body["n"]) for p in split.parts] == [(0, 3), (1, 2)]
    split = plan_split(COMPLETIONS, {"model": "m", "prompt": "one", "n": 2}, views)
    assert [p.body["n"] for p in split.parts] == [1, 1]


def test_what_is_never_split():
    two = [view(0, 4), view(1, 4)]
    many = {"model": "m", "prompt": ["a", "b", "c"]}
    assert plan_split(COMPLETIONS, {**many, "stream": True}, two) is None
    assert plan_split(COMPLETIONS, {**many, "seed": 7}, two) is None
    assert plan_split(COMPLETIONS, many, [view(0, 4), view(1, 4, load=4)]) is None  # one replica has room
    assert plan_split(COMPLETIONS, many, [view(0, 4), view(1, 4, healthy=False)]) is None
    assert plan_split(COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}, two) is None  # one tokenized prompt
    assert plan_split(CHAT, {"model": "m", "messages": [], "n": 1}, two) is None
    assert plan_split("/v1/embeddings", {"model": "m", "input": ["a", "b"]}, two) is None
    assert plan_split(CHAT, {"model": "m", "messages": [], "n": "2"}, two) is None
    assert plan_split(COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]]}, two).kind == "prompts"


def test_merge_renumbers_choices_and_adds_usage():
    views = [view(0, 4), view(1, 4)]
    split = plan_split(COMPLETIONS, {"model": "m", "prompt": ["a", "b", "c"], "n": 2}, views)
    first = {"id": "cmpl-1", "object": "text_completion", "model": "m",
             "choices": [{"index": i, "text": f"a{i}"} for i in (1, 0, 3, 2)],
             "usage": {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}}
    second = {"id": "cmpl-2", "object": "text_completion", "model": "m",
              "choices": [{"index": i, "text": f"b{i}"} for i in (0, 1)],
              "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}}
    merged = merge_answers(split, [first, second])
    assert merged["id"] == "cmpl-1"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a0"), (1, "a1"), (2, "a2"), (3, "a3"), (4, "b0"), (5, "b1")]
    assert merged["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}

    nsplit = plan_split(CHAT, {"model": "m", "messages": [], "n": 2}, views)
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    merged = merge_answers(nsplit, [{"choices": [{"index": 0}], "usage": usage}, {"choices": [{"index": 0}], "usage": usage}])
    assert [c["index"] for c in merged["choices"]] == [0, 1]
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_n_and_the_prompts_of_one_request_are_capped_before_any_split():
    """vLLM caps n and the prompt list per engine request; a split request is several, so the hive
    caps them once for the whole request (n = 2000 was served)."""
    from hive_apps.serving.routing.paths import body_problem
    from hive_apps.serving.routing.split import MAX_N, MAX_PROMPTS

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in ((CHAT, {**chat, "n": 2000}), (COMPLETIONS, {"model": "m", "prompt": "x", "n": MAX_N + 1})):
        message, param = body_problem(path, body)
        assert param == "n" and f"at most {MAX_N}" in message
    assert body_problem(CHAT, {**chat, "n": MAX_N}) is None
    for path, field, prompts in ((COMPLETIONS, "prompt", ["p"] * (MAX_PROMPTS + 1)),
                                 (COMPLETIONS, "prompt", [[1, 2]] * (MAX_PROMPTS + 1)),
                                 ("/v1/embeddings", "input", ["a"] * (MAX_PROMPTS + 1))):
        message, param = body_problem(path, {"model": "m", field: prompts})
        assert param == field and f"at most {MAX_PROMPTS} prompts" in message
    assert body_problem(COMPLETIONS, {"model": "m", "prompt": ["p"] * MAX_PROMPTS}) is None
    assert body_problem(COMPLETIONS, {"model": "m", "prompt": list(range(50_000))}) is None  # one tokenized prompt
    assert MAX_N == 128 and MAX_PROMPTS == 1024
