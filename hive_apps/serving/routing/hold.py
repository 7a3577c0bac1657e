"""Requests for a sleeping model wait here while it wakes, instead of being refused.

The gateway and each model's router keep one ``WakeHold`` fed with the registry's records
(``serving/routing/follow.py``). The first request for a sleeping model asks the registry for the
``wake`` transition; every request then waits until the record is serving again, bounded
in number per model (HIVE_HOLD_MAX_PER_MODEL: more get 429), per client (one API key holds
at most half of those slots: more get 429) and in time (HIVE_HOLD_TIMEOUT_S: then 503). A
wake that fails answers every held request with a 503 that says why. A streaming client gets
its response headers at once and an SSE comment every HIVE_HOLD_KEEPALIVE_S while it waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response, StreamingResponse

from hive_apps.control.cluster import Cluster, get_cluster
from hive_apps.core import names
from hive_apps.core.auth import bearer_token
from hive_apps.core.openai_errors import openai_error, sse_error
from hive_apps.core.settings import HiveSettings
from hive_apps.core.state.records import SERVING, ModelRecord, ModelStatus
from hive_apps.core.state.transitions import Wake
from hive_apps.ops import metrics
from hive_apps.serving.engine.protocol import ResponseStart

log = logging.getLogger("ray.serve")

RETRY_AFTER_S = 5


def client_slots(model_slots: int) -> int:
    """The hold slots one client may take of a model's HIVE_HOLD_MAX_PER_MODEL: half (at least
    one), so one API key cannot fill them all and lock every other client out of the wake."""
    return max(1, model_slots // 2)


def client_of(authorization: str | None) -> str | None:
    """Who holds, for the per-client share: a digest of the request's API key (the key itself is
    not kept). None without one (authentication off): then only the model's bound applies."""
    token = bearer_token(authorization)
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16] if token else None


def replica_slots(model_slots: int, replicas: int) -> int:
    """This entry replica's part of a model's HIVE_HOLD_MAX_PER_MODEL when ``replicas`` replicas of
    the same entry (the gateway's) share it: the bound holds for the entry as a whole, the way a
    client sees it, however many replicas Serve spreads requests over."""
    return -(-model_slots // replicas)  # ceil: every replica can hold at least one when the bound is not 0


class HoldRefused(Exception):
    """The request cannot wait (or waited in vain): answer with this response."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


def _refusal(status: int, message: str, retry_after: int | None = RETRY_AFTER_S) -> HoldRefused:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    return HoldRefused(openai_error(status, message, headers=headers))


def where_details_are(model_id: str, request_id: str | None) -> str:
    """What a client is told instead of why the model failed: the failure text (Serve's tracebacks,
    with file paths and node addresses) is for the operator's eyes, in the logs and the admin API."""
    asked = f" (request id {request_id})" if request_id else ""
    return f"the operator's logs and GET /admin/models/{model_id} have the details{asked}"


def gone_message(rec: ModelRecord | None, model_id: str, request_id: str | None = None) -> str | None:
    """Why a request for this model can never be served as things are (None: it can, now or after a wake)."""
    if rec is None:
        return None
    if rec.status is ModelStatus.DESTROYED:  # the message is the hive's own idle reason
        return (f"The model `{model_id}` was destroyed: {rec.message}. Deploy it again with POST /admin/models "
                f"to use it.")
    if rec.status is ModelStatus.DELETING:
        return f"The model `{model_id}` is being deleted."
    if rec.status is ModelStatus.FAILED:
        _log_refusal(request_id, rec)
        return (f"The model `{model_id}` failed to deploy: its engine failed or did not start in time; "
                f"{where_details_are(model_id, request_id)}.")
    return None


def _log_refusal(request_id: str | None, rec: ModelRecord) -> None:
    """Tie the id a client quotes to the model's failure; the full text is in the admin's own log."""
    log.info("request %s refused: model %s is %s: %.300s", request_id, rec.model_id, rec.status.value, rec.message)


class WakeHold:
    def __init__(self, settings: HiveSettings, ask_wake: Callable[[str], Awaitable[object]] | None = None, entry: str = "router",
                 clock: Callable[[], float] = time.time, replicas: int = 1, *, publisher: metrics.Publisher):
        self.settings = settings
        self.publisher = publisher  # rejections and held requests
        self.slots = replica_slots(settings.hold_max_per_model, replicas)  # of each model, in this replica
        self.clock = clock  # wall time, as the records' ``wake_failed_at`` has it
        self.entry = entry  # who holds (gateway or router), for hive_held_requests
        self.records: dict[str, ModelRecord] = {}
        self.held: dict[str, int] = {}
        self.held_by: dict[tuple[str, str], int] = {}  # (model id, client) -> requests held
        self._asked: dict[str, float] = {}  # model id -> when a wake was last asked for
        self._changed = asyncio.Condition()
        self._ask_wake = ask_wake or _ask_registry

    async def update(self, records: dict[str, ModelRecord]) -> None:
        async with self._changed:
            self.records = records
            self._changed.notify_all()

    def on_models(self, records: dict[str, ModelRecord]) -> None:
        """For synchronous followers: apply the records from the running loop."""
        asyncio.get_running_loop().create_task(self.update(records))

    async def wait(self, model_id: str, request_id: str | None = None, client: str | None = None) -> ModelRecord:
        """Hold one request until the model serves; its record then. Raises ``HoldRefused``.
        ``client``: who sent it (``client_of``), for the per-client share of the slots."""
        slots = self.slots
        if self.held.get(model_id, 0) >= slots:
            self.publisher.count("hive_rejected", model=model_id, code="429", reason="hold_full")
            raise _refusal(429, f"model '{model_id}' is waking and {slots} requests already wait for it here "
                                f"(HIVE_HOLD_MAX_PER_MODEL={self.settings.hold_max_per_model}, shared by this entry's "
                                f"replicas); retry after {RETRY_AFTER_S}s")
        mine = (model_id, client) if client is not None else None
        if mine is not None and self.held_by.get(mine, 0) >= client_slots(slots):
            self.publisher.count("hive_rejected", model=model_id, code="429", reason="client_share")
            raise _refusal(429, f"model '{model_id}' is waking and {client_slots(slots)} of your requests already wait "
                                f"for it (one API key holds at most half of the {slots} here, of HIVE_HOLD_MAX_PER_MODEL="
                                f"{self.settings.hold_max_per_model}); "
                                f"retry after {RETRY_AFTER_S}s")
        self.held[model_id] = self.held.get(model_id, 0) + 1
        if mine is not None:
            self.held_by[mine] = self.held_by.get(mine, 0) + 1
        self._publish_held()
        try:
            return await asyncio.wait_for(self._until_serving(model_id, self.clock(), request_id),
                                          self.settings.hold_timeout_s)
        except TimeoutError:
            rec = self.records.get(model_id)
            where = f"; it is {rec.status.value}, and {where_details_are(model_id, request_id)}" if rec else ""
            self.publisher.count("hive_rejected", model=model_id, code="503", reason="hold_timeout")
            raise _refusal(503, f"model '{model_id}' did not wake within {self.settings.hold_timeout_s:.0f}s "
                                f"(HIVE_HOLD_TIMEOUT_S){where}") from None
        finally:
            self.held[model_id] -= 1
            if mine is not None:
                self.held_by[mine] -= 1
                if not self.held_by[mine]:  # bounded by the requests held now, not by every client seen
                    del self.held_by[mine]
            self._publish_held()

    def _publish_held(self) -> None:
        self.publisher.gauges("held:" + self.entry, [
            metrics.sample("hive_held_requests", n, model=m, entry=self.entry) for m, n in self.held.items()])

    async def _until_serving(self, model_id: str, since: float, request_id: str | None) -> ModelRecord:
        async with self._changed:
            while True:
                rec = self.records.get(model_id)
                gone = gone_message(rec, model_id, request_id)
                if rec is None or gone:
                    raise _refusal(404, gone or f"The model `{model_id}` was deleted.", None)
                if rec.status in SERVING:
                    return rec
                if rec.status is ModelStatus.SLEEPING:
                    if rec.wake_failed_at is not None and rec.wake_failed_at >= since:
                        self.publisher.count("hive_rejected", model=model_id, code="503", reason="wake_failed")
                        _log_refusal(request_id, rec)
                        raise _refusal(503, f"model '{model_id}' could not wake: its engine failed or found no room; "
                                            f"{where_details_are(model_id, request_id)}")
                    if self.clock() - self._asked.get(model_id, 0.0) > 1.0:  # one ask for all waiters, at most 1/s
                        self._asked[model_id] = self.clock()
                        asyncio.get_running_loop().create_task(self._wake(model_id))
                await self._changed.wait()

    async def _wake(self, model_id: str) -> None:
        try:
            await self._ask_wake(model_id)
        except Exception as e:  # the registry is restarting: the next record change asks again
            log.warning("asking the registry to wake %s failed: %s", model_id, e)


def wake_asker(cluster: Cluster | None = None) -> Callable[[str], Awaitable[None]]:
    """Ask ``cluster``'s registry (None: the process's) for a model's wake."""
    return lambda model_id: _ask_registry(model_id, cluster)


async def _ask_registry(model_id: str, cluster: Cluster | None = None) -> None:
    outcome = await (cluster or get_cluster()).app_handle(names.REGISTRY_APP).transition.remote(Wake(model_id=model_id))
    if not outcome.ok:
        log.info("wake of %s refused: %s", model_id, outcome.message)


async def held_stream(hold: WakeHold, model_id: str, keepalive_s: float,
                      then: Callable[[ModelRecord], AsyncIterator[ResponseStart | bytes]],
                      request_id: str | None = None, client: str | None = None) -> Response:
    """A streamed answer for a sleeping model: headers now, SSE comments while it wakes, then the
    engine's events (an error event if the wake or the engine fails)."""

    async def body() -> AsyncIterator[bytes]:
        waiting = asyncio.ensure_future(hold.wait(model_id, request_id, client))
        try:
            while not waiting.done():
                done, _ = await asyncio.wait({waiting}, timeout=keepalive_s)
                if not done:
                    yield f": waiting for {model_id} to wake\n\n".encode()
            try:
                rec = waiting.result()
            except HoldRefused as e:
                yield sse_error(e.response.status_code, json.loads(bytes(e.response.body))["error"]["message"])
                return
            items = then(rec)
            start = await items.__anext__()
            assert isinstance(start, ResponseStart)  # an engine reply starts with its headers
            if start.status != 200:
                raw = b"".join([c async for c in items if isinstance(c, bytes)])
                yield sse_error(start.status, _message(raw))
                return
            async for chunk in items:
                if isinstance(chunk, bytes):
                    yield chunk
        finally:
            waiting.cancel()

    return StreamingResponse(body(), status_code=200, media_type="text/event-stream")


def _message(raw: bytes) -> str:
    """The message of an engine's error reply (OpenAI's shape), else its text."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")

