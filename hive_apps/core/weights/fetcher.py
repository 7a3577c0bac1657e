"""One node's fetch service, which that node's Ray actor wraps: the admin and the reconciler ask it
(many times over, from several models) to have a revision ready before an engine starts there.

Every method returns at once: a fetch runs in a background thread of its own, one per cache key,
however many replicas or models ask for the same revision. No Ray here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from hive_apps.core.weights.cache import NodeCache
from hive_apps.core.weights.clients import scrub
from hive_apps.core.weights.fetch import fetch
from hive_apps.core.weights.types import (
    CacheDisk,
    CachedWeights,
    FetchProgress,
    FetchState,
    Manifest,
    SourceError,
    SourceKind,
)

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """The latest fetch of one key: running, or its outcome."""

    progress: FetchProgress
    done: threading.Event = field(default_factory=threading.Event)
    reported: bool = False  # an ensure answered its failure: the next ensure tries again


def _ready(manifest: Manifest, path: Path) -> FetchProgress:
    return FetchProgress(key=manifest.key, state=FetchState.READY, bytes_done=manifest.total_bytes,
                         bytes_total=manifest.total_bytes, files_done=len(manifest.files),
                         files_total=len(manifest.files), path=str(path))


class WeightFetcher:
    """Fills one node's cache. Thread-safe."""

    def __init__(self, root: Path, node_name: str, workers: int = 8, *, attempts: int = 5, backoff_s: float = 0.5):
        self.node_name = node_name
        self.workers, self.attempts, self.backoff_s = workers, attempts, backoff_s
        self.cache = NodeCache(Path(root), node_name)
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}

    def ensure(self, manifest: Manifest, in_use: Collection[str] = frozenset()) -> FetchProgress:
        """Have ``manifest``'s files on this node. READY (with ``path``) when they are complete and
        verified; FETCHING while a fetch runs (started by the first call); FAILED once, to the first
        call after a fetch failed, and the call after that tries again. ``in_use``: the keys deployed
        models name, never evicted to make room."""
        key = manifest.key
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.done.is_set():
                return job.progress
            if job is not None and job.progress.state is FetchState.FAILED and not job.reported:
                job.reported = True
                return job.progress
        try:
            if manifest.source.kind is SourceKind.LOCAL:  # nothing to fetch: a stat answers at once
                path = self.cache.local_folder(manifest)
            elif self.cache.is_complete(manifest):
                path = self.cache.folder(manifest)
            else:
                return self._start(manifest, in_use)
        except SourceError as e:
            return self._settle(FetchProgress(key=key, state=FetchState.FAILED, error=e.message))
        self.cache.touch(key)
        return self._settle(_ready(manifest, path))

    def _settle(self, progress: FetchProgress) -> FetchProgress:
        """Keep an answer given without a fetch, unless a fetch of that key started meanwhile."""
        with self._lock:
            job = self._jobs.get(progress.key)
            if job is not None and not job.done.is_set():
                return job.progress
            job = self._jobs[progress.key] = _Job(progress, reported=True)
            job.done.set()
            return progress

    def _start(self, manifest: Manifest, in_use: Collection[str]) -> FetchProgress:
        key = manifest.key
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.done.is_set():  # another caller started it meanwhile
                return job.progress
            job = self._jobs[key] = _Job(FetchProgress(key=key, state=FetchState.FETCHING,
                                                       bytes_total=manifest.total_bytes,
                                                       files_total=len(manifest.files)))
            busy = {k for k, j in self._jobs.items() if not j.done.is_set()}
        threading.Thread(target=self._run, args=(job, manifest, {*in_use, *busy}), name=f"hive-fetch {key}",
                         daemon=True).start()
        return job.progress

    def _run(self, job: _Job, manifest: Manifest, in_use: set[str]) -> None:
        def report(progress: FetchProgress) -> None:
            with self._lock:
                job.progress = progress

        try:
            path = fetch(manifest, self.cache, workers=self.workers, attempts=self.attempts, backoff_s=self.backoff_s,
                         on_progress=report, in_use=in_use)
            final = _ready(manifest, path).model_copy(update={"rate_bytes_per_s": job.progress.rate_bytes_per_s,
                                                              "attempts": job.progress.attempts})
        except Exception as e:  # noqa: BLE001 - fetch raises SourceError; anything else is a bug, reported the same way
            error = e.message if isinstance(e, SourceError) else scrub(f"{type(e).__name__}: {e}")
            log.warning("%s: fetch failed on %s: %s", manifest.source, self.node_name, error)
            final = job.progress.model_copy(update={"state": FetchState.FAILED, "error": error})
        with self._lock:
            job.progress = final
            job.done.set()

    def progress(self, key: str) -> FetchProgress | None:
        """The latest fetch of ``key`` on this node, or READY from the cache's record when it was
        fetched before this process started; None when this node knows nothing of it."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                return job.progress
        record = self.cache.record(key)
        if record is not None and self.cache.is_complete(record.manifest):
            return _ready(record.manifest, self.cache.folder(record.manifest))
        return None

    def wait(self, key: str, timeout: float | None = None) -> FetchProgress:
        """Block until the fetch of ``key`` ends (or ``timeout``): for tests and benchmarks."""
        with self._lock:
            job = self._jobs.get(key)
        if job is None:
            progress = self.progress(key)
            if progress is None:
                raise KeyError(f"no fetch of {key} on {self.node_name}")
            return progress
        job.done.wait(timeout)
        with self._lock:
            return job.progress

    def entries(self, in_use: Collection[str] = frozenset()) -> list[CachedWeights]:
        return self.cache.entries(in_use)

    def remove(self, key: str, in_use: Collection[str] = frozenset()) -> bool:
        """Delete a cached revision from this node. Refused (``SourceError`` 409) while a model uses it
        or it is being fetched; False when this node does not have it."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.done.is_set():
                raise SourceError(f"{key} is being fetched on {self.node_name}", 409)
            removed = self.cache.remove(key, in_use)
            self._jobs.pop(key, None)
        return removed

    def disk(self) -> CacheDisk:
        return self.cache.disk()
