"""'Live replica' has one definition (serving/routing/liveness.py): replica choice, the queue bound, splitting
and the failover all ask it, and only the load poll and a failed request change it."""

import ast
import asyncio
import json
from pathlib import Path

from hive_apps.serving.engine.protocol import ForwardedRequest
from hive_apps.serving.routing import liveness
from hive_apps.serving.routing.liveness import is_live
from hive_apps.serving.routing.policy import choose_replica, queue_full
from hive_apps.serving.routing.replica_set import ReplicaSet
from hive_apps.serving.routing.split import COMPLETIONS, plan_split
from tests.unit.helpers import routing
from tests.unit.serving.test_engine_http import CHAT, FakeHandle, engine

ROUTING = Path(liveness.__file__).parent


def test_only_liveness_reads_or_writes_the_live_state():
    touching = sorted(
        f"{path.name}:{node.lineno}" for path in ROUTING.glob("*.py") if path.name != "liveness.py"
        for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute) and node.attr == "healthy")
    assert not touching, f"ask serving/routing/liveness.py (is_live, mark_failed) instead: {touching}"


async def test_a_replica_the_failover_marked_is_skipped_by_choice_bound_and_split_until_a_poll_answers():
    engines = [await engine(i, max_num_seqs=4, sim_tokens_per_s=5000) for i in range(2)]
    rs = ReplicaSet("sim-model", {i: FakeHandle(e) for i, e in enumerate(engines)}, [e.replica for e in engines], 8, **routing())
    await rs._refresh()
    await rs._refresh()  # the ports are known and answer
    assert all(is_live(v) for v in rs.views.values()) and all(rs.endpoints.values())
    assert choose_replica(rs.replica_views()).index == 0, "both idle: the tie goes to r0"

    await engines[0].http.stop()
    req = ForwardedRequest(path="/v1/chat/completions", headers=[("content-type", "application/json")],
                           body=json.dumps(CHAT).encode())
    start, _ = await rs.call(req, CHAT)  # r0 refuses: the failover marks it and r1 answers
    assert start.status == 200 and ("x-hive-replica", "r1") in start.headers
    r0, r1 = rs.views[0], rs.views[1]
    assert not is_live(r0) and is_live(r1)
    assert choose_replica(rs.replica_views()).index == 1
    assert [v.index for v, _, _ in rs._attempts(prefer=0)] == [1], "the failover does not prefer it either"
    assert plan_split(COMPLETIONS, {"prompt": ["a", "b", "c", "d"]}, rs.replica_views()) is None, "one live replica"
    r1.in_flight = r1.capacity + rs.queue_bound
    assert queue_full(rs.replica_views(), rs.queue_bound), "r0's free slots do not count"
    r1.in_flight = 0

    await rs._refresh()  # r0 answers its poll (over Serve: its port is gone)
    assert is_live(r0) and choose_replica(rs.replica_views()).index == 0
    assert await rs._any_live()
    rs.close()
    await asyncio.sleep(0)
    await engines[1].http.stop()


class Polled(liveness.LoadPoll):
    """A load poll whose replica 0 answers, or fails, as the test says."""

    def __init__(self):
        from hive_apps.serving.routing.policy import ReplicaView

        super().__init__({0: ReplicaView(index=0, capacity=4)})
        self.answer: Exception | None = None

    async def _poll_one(self, i):
        from hive_apps.serving.engine.protocol import EngineLoad

        if self.answer is not None:
            raise self.answer
        return EngineLoad(running=1, waiting=0)


async def test_one_late_poll_keeps_a_replica_live_two_in_a_row_or_a_refusal_do_not():
    poll = Polled()
    view = poll.views[0]
    poll.answer = TimeoutError()
    await poll._refresh()
    assert is_live(view), "one late answer: a busy engine"
    await poll._refresh()
    assert not is_live(view), "late twice in a row: dead or hung"
    poll.answer = None
    await poll._refresh()
    assert is_live(view) and view.engine_running == 1
    poll.answer = TimeoutError()
    await poll._refresh()
    poll.answer = None
    await poll._refresh()
    poll.answer = TimeoutError()
    await poll._refresh()
    assert is_live(view), "an answer in between: late once again, not twice"
    poll.answer = None
    await poll._refresh()
    poll.answer = ConnectionRefusedError()
    await poll._refresh()
    assert not is_live(view), "a refused poll: not live at once"
