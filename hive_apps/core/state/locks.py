"""Start locks: engines that share a device start one at a time.

vLLM profiles memory device-wide while it starts, so a neighbour that allocates or frees
memory meanwhile shrinks its KV cache or crashes its start. A holder takes the locks of
all its devices at once or none; a lease frees the locks of a holder that died.
"""

from __future__ import annotations

import time


class StartLocks:
    def __init__(self) -> None:
        self.held: dict[str, tuple[str, float]] = {}  # device id -> (holder, lease deadline)

    def _expire(self, now: float) -> None:
        for dev, (_, deadline) in list(self.held.items()):
            if deadline < now:
                del self.held[dev]

    def try_acquire(self, devices: list[str], holder: str, lease_s: float, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        self._expire(now)
        if any(self.held.get(d, (holder, 0))[0] != holder for d in devices):
            return False
        for d in devices:
            self.held[d] = (holder, now + lease_s)
        return True

    def release(self, holder_prefix: str) -> list[str]:
        """Free every lock whose holder starts with ``holder_prefix`` (a replica, or a whole model)."""
        freed = [d for d, (h, _) in self.held.items() if h == holder_prefix or h.startswith(holder_prefix + "/")]
        for d in freed:
            del self.held[d]
        return freed

    def holder_of(self, device: str, now: float | None = None) -> str | None:
        self._expire(time.time() if now is None else now)
        entry = self.held.get(device)
        return entry[0] if entry else None
