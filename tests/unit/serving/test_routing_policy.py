from hive_apps.serving.routing.policy import ReplicaView, choose_replica, queue_full


def test_relative_load_beats_absolute_load():
    big = ReplicaView(index=0, capacity=256, in_flight=40)
    small = ReplicaView(index=1, capacity=32, in_flight=8)
    assert choose_replica([big, small]).index == 0  # 40/256 < 8/32


def test_ties_go_to_lower_absolute_load_then_index():
    a = ReplicaView(index=0, capacity=100, in_flight=10)
    b = ReplicaView(index=1, capacity=10, in_flight=1)
    assert choose_replica([a, b]).index == 1
    c = ReplicaView(index=2, capacity=10, in_flight=1)
    assert choose_replica([c, b]).index == 1


def test_engine_reported_load_counts():
    a = ReplicaView(index=0, capacity=10, in_flight=0, engine_running=9, engine_waiting=3)
    b = ReplicaView(index=1, capacity=10, in_flight=2)
    assert a.load == 12
    assert choose_replica([a, b]).index == 1


def test_unhealthy_and_excluded_are_skipped():
    a = ReplicaView(index=0, capacity=10, healthy=False)
    b = ReplicaView(index=1, capacity=10, in_flight=5)
    assert choose_replica([a, b]).index == 1
    assert choose_replica([a, b], exclude={1}) is None


def test_queue_full_only_when_every_replica_is_full_and_bound_reached():
    full = [ReplicaView(index=0, capacity=4, in_flight=6), ReplicaView(index=1, capacity=2, in_flight=3)]
    assert queue_full(full, bound=3)  # 2 + 1 waiting beyond capacity
    assert not queue_full(full, bound=4)
    one_free = [ReplicaView(index=0, capacity=4, in_flight=20), ReplicaView(index=1, capacity=2, in_flight=1)]
    assert not queue_full(one_free, bound=0)
    dead = [ReplicaView(index=0, capacity=1, in_flight=0, healthy=False)]
    assert not queue_full(dead, bound=0)  # no healthy replica is a 503, not a 429


def test_idle_fleet_sends_the_first_request_to_the_fastest_replica():
    slow_big = ReplicaView(index=0, capacity=17, seq_tokens_per_s=32)
    fast = ReplicaView(index=1, capacity=32, seq_tokens_per_s=120)
    same_speed_small = ReplicaView(index=2, capacity=7, seq_tokens_per_s=120)
    assert choose_replica([slow_big, same_speed_small, fast]).index == 1


def test_queued_prompt_tokens_count_against_the_prefill_budget():
    from hive_apps.serving.routing.policy import ReplicaView, choose_replica

    # r0 has two requests in flight but they carry long prompts; r1 has three short ones
    r0 = ReplicaView(index=0, capacity=16, in_flight=2, queued_tokens=7000, token_budget=8192)
    r1 = ReplicaView(index=1, capacity=16, in_flight=3, queued_tokens=300, token_budget=8192)
    assert r0.pressure > r1.pressure
    assert choose_replica([r0, r1]).index == 1
    r0.queued_tokens = 0
    assert choose_replica([r0, r1]).index == 0


def test_requests_the_edge_sent_steer_the_choice_but_never_fill_the_queue_bound():
    """Between two polls the edge's picks count on their replica (the next request goes elsewhere),
    but a 429 needs load a poll or the router saw: a stale estimate must not refuse anyone."""
    a, b = ReplicaView(index=0, capacity=4), ReplicaView(index=1, capacity=4)
    a.edge_sent = [0.0, 0.0]
    assert choose_replica([a, b]) is b
    full = ReplicaView(index=0, capacity=4, engine_running=4, edge_sent=[0.0] * 50)
    assert not queue_full([full], bound=1)
    full.engine_waiting = 1
    assert queue_full([full], bound=1)
