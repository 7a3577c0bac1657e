"""Which replica gets the next request: least loaded relative to its planned capacity.

load     = requests this router has in flight to the replica
           + the engine's own running and waiting requests not already counted
           + requests it sent through the edge in the last EDGE_PICK_TTL_S and since the last load
             poll began (their answers bypass the router: the engine's counts are all it sees of
             them), so requests between two polls spread instead of piling onto one replica; the
             queue bound (a 429) counts only what a poll or this router saw, never these estimates
capacity = the replica's planned max_num_seqs
score    = the larger of load / capacity and queued prompt tokens / max_num_batched_tokens
           (prompts this router sent that have not started answering: a few huge prompts
           fill a replica's prefill budget long before its sequence slots);
           ties go to the lower absolute load, then to the faster replica (planned tokens/s
           per sequence), then to the larger one, then to the lower index.

A replica with max_num_seqs 256 on an H100 therefore takes about eight times the
requests of one with 32 on an L4 before they look equally busy.
"""

from __future__ import annotations

from pydantic import BaseModel

from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.serving.routing.liveness import is_live


class ReplicaView(BaseModel):
    index: int
    capacity: int  # planned max_num_seqs
    in_flight: int = 0  # from this router
    engine_running: int = 0
    engine_waiting: int = 0
    healthy: bool = True  # serving/routing/liveness.py's to set; read it with is_live
    late: bool = False  # its last load poll timed out (liveness.py's): one more and it is not live
    seq_tokens_per_s: float = 0.0  # the plan's throughput estimate / max_num_seqs
    queued_tokens: int = 0  # prompt tokens sent by this router and not yet answering
    token_budget: int = 8192  # planned max_num_batched_tokens
    adapters: frozenset[str] = frozenset()  # LoRA adapters its engine reported loaded
    edge_sent: list[float] = []  # monotonic times of requests sent through the edge, until a poll counts them

    @classmethod
    def of_plan(cls, rp: ReplicaPlan) -> ReplicaView:
        seqs = max(1, rp.settings.max_num_seqs)
        return cls(index=rp.index, capacity=seqs, seq_tokens_per_s=(rp.expected_tokens_per_s or 0.0) / seqs,
                   token_budget=max(1, rp.settings.max_num_batched_tokens))

    @property
    def seen_load(self) -> int:
        # The engine's counts include this router's requests once they reach it.
        return max(self.in_flight, self.engine_running + self.engine_waiting)

    @property
    def load(self) -> int:
        return self.seen_load + len(self.edge_sent)

    @property
    def pressure(self) -> float:
        return max(self.load / max(1, self.capacity), self.queued_tokens / max(1, self.token_budget))


EDGE_PICK_TTL_S = 0.25
"""How long a request the edge sent counts on its replica (``ReplicaView.edge_sent``) without a poll:
one load poll period. A chat turn is often answered within it, so counting it longer overstates the load."""


def queue_full(replicas: list[ReplicaView], bound: int) -> bool:
    """Every live replica is at capacity and ``bound`` requests already wait beyond it."""
    live = [r for r in replicas if is_live(r)]
    if not live or any(r.seen_load < r.capacity for r in live):
        return False
    return sum(r.seen_load - r.capacity for r in live) >= bound


def choose_replica(replicas: list[ReplicaView], exclude: set[int] | frozenset[int] = frozenset()) -> ReplicaView | None:
    candidates = [r for r in replicas if is_live(r) and r.index not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.pressure, r.load, -r.seq_tokens_per_s, -r.capacity, r.index))


def prompt_tokens_estimate(body: bytes) -> int:
    """A cheap upper-side guess of a request's prompt tokens: about four bytes per token."""
    return len(body) // 4
