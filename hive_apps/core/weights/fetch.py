"""The download of one manifest into a node's cache: the missing files in parallel, each resumed from
what an earlier try or a killed process left on disk, checked before it takes its final name, and
retried with bounded back-off while the failure is the network's.

Checks, per source (size always):

* Hub: LFS files against their sha256; other files against their git blob id (sha1 of
  ``blob <size>\\0`` + bytes), which is the Hub's ETag for them.
* S3: a single-part ETag is the object's md5; a multipart ETag (``<md5 of md5s>-<parts>``) cannot be
  recomputed without the part size, so such an object is checked against S3's ``ChecksumSHA256``
  when it has a full-object one, else by size only.

Every file's sha256 is computed as it streams in and kept in the entry's record, so a cached file
whose stat later moves is hashed again and compared with the source's digest or, lacking one, with
what was verified when it arrived.

Why not ``hf_hub_download``: in huggingface_hub 2.4 it downloads to a process-unique temporary file
that it deletes on failure, so a killed process starts the file again from zero; it moves a blob into
place before anyone checks its sha256; and on a flaky Hub its own HEAD retries add up to ~23 s per
file on top of these tries. So the Hub's pieces are used one by one: ``get_hf_file_metadata`` (the
ETag that names the blob, the download address), ``http_get`` resumed into this cache's stable
``blobs/<etag>.incomplete`` under the lock ``hf_hub_download`` takes for that blob, and the
snapshot link as ``hf_hub_download`` makes it (``NodeCache.link_hub_file``): the result is the
Hugging Face cache layout, which ``huggingface_hub`` and the engines read as their own. Within one
try, ``http_get`` itself resumes a body the network broke (up to five times, a second apart).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import botocore.exceptions
import httpx2
from filelock import Timeout as LockTimeout
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import WeakFileLock, build_hf_headers, silent_tqdm

from hive_apps.core.weights.cache import PARTIAL_SUFFIX, NodeCache
from hive_apps.core.weights.clients import hub_endpoint, hub_online, hub_token, s3_client, s3_location, scrub
from hive_apps.core.weights.types import (
    FetchProgress,
    FetchState,
    Manifest,
    RemoteFile,
    SourceError,
    SourceKind,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_BACKOFF_S = 30.0
PROGRESS_EVERY_S = 0.2
_MD5 = re.compile(r"[0-9a-f]{32}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
_RETRY_STATUS = frozenset({408, 429})

ProgressCallback = Callable[[FetchProgress], None]


# -- checks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Expected:
    """What a file must be: its size and whichever digests its source vouches for."""

    size: int
    sha256: str | None = None
    md5: str | None = None  # an S3 single-part ETag
    git_sha1: str | None = None  # the Hub's blob id of a file outside LFS


def _expected(manifest: Manifest, file: RemoteFile, sha256: str | None = None) -> _Expected:
    etag, kind = file.etag or "", manifest.source.kind
    return _Expected(size=file.size, sha256=file.sha256 or sha256,
                     md5=etag if kind is SourceKind.S3 and _MD5.fullmatch(etag) else None,
                     git_sha1=etag if kind is SourceKind.HUB and not file.sha256 and _SHA1.fullmatch(etag) else None)


def _s3_sha256(head: dict[str, Any]) -> str | None:
    """S3's full-object sha256 (hex), or None: a composite one (``<b64>-<parts>``) is a digest of the
    parts' digests, which the bytes alone do not give."""
    value = head.get("ChecksumSHA256")
    if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    return base64.b64decode(value).hex()


class _Hashes:
    """The running digests of one file's bytes."""

    def __init__(self, expected: _Expected):
        self.expected = expected
        self.reset()

    def reset(self) -> None:
        self.sha256 = hashlib.sha256()
        self._md5 = hashlib.md5(usedforsecurity=False) if self.expected.md5 else None
        self._git = (hashlib.sha1(f"blob {self.expected.size}\0".encode(), usedforsecurity=False)
                     if self.expected.git_sha1 else None)

    def update(self, chunk: bytes) -> None:
        for h in (self.sha256, self._md5, self._git):
            if h is not None:
                h.update(chunk)

    def mismatch(self, size: int) -> str | None:
        """Why these bytes are not the file, or None when they are."""
        if size != self.expected.size:
            return f"{size} bytes, expected {self.expected.size}"
        for name, want, h in (("sha256", self.expected.sha256, self.sha256), ("md5", self.expected.md5, self._md5),
                              ("git blob id", self.expected.git_sha1, self._git)):
            if want and h is not None and h.hexdigest() != want:
                return f"{name} {h.hexdigest()}, expected {want}"
        return None


def _verified_sha256(path: Path, expected: _Expected) -> str | None:
    """The sha256 of the file at ``path`` when it is the expected file, else None."""
    hashes = _Hashes(expected)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                hashes.update(chunk)
        size = path.stat().st_size
    except OSError:
        return None
    return None if hashes.mismatch(size) else hashes.sha256.hexdigest()


class _Corrupt(Exception):
    """The bytes that arrived are not the file's: worth fetching it again, from its first byte."""


class _Stopped(Exception):
    """Another file failed for good: this one stops without a reason of its own."""


def _explain(exc: Exception) -> tuple[str, int, bool]:
    """(reason, HTTP status the admin answers, worth another try) of one failed try."""
    if isinstance(exc, SourceError):
        return exc.message, exc.status_code, False
    if isinstance(exc, _Corrupt):
        return str(exc), 502, True
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 502
        reason = " ".join(str(exc).split())[:400]
        return reason, status if status in (401, 403, 404) else 502, status >= 500 or status in _RETRY_STATUS
    if isinstance(exc, botocore.exceptions.ClientError):
        error, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
        code, status = error.get("Code", ""), int(meta.get("HTTPStatusCode") or 502)
        reason = f"{code}: {error.get('Message', '')}"
        if status == 412 or code == "PreconditionFailed":
            return "the object changed since it was listed: deploy again to pin its new revision", 409, False
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
            return reason, 401, False
        retry = status >= 500 or status in _RETRY_STATUS or code in ("SlowDown", "Throttling", "RequestTimeout")
        return reason, status if status in (403, 404) else 502, retry
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return "no AWS credentials on this node", 401, False
    if isinstance(exc, (httpx2.TransportError, botocore.exceptions.BotoCoreError, ConnectionError, TimeoutError)):
        return f"{type(exc).__name__}: {exc}", 502, True
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full: {exc}", 507, False
    if isinstance(exc, OSError) and exc.errno is None:  # huggingface_hub's "Consistency check failed"
        return str(exc), 502, True
    return f"{type(exc).__name__}: {exc}", 502, False


# -- one fetch -------------------------------------------------------------------------------------


class _Progress:
    """A running fetch as ``FetchProgress`` says it: bytes on disk (verified files and partial ones),
    files verified, the most tries any file took."""

    def __init__(self, manifest: Manifest, on_progress: ProgressCallback | None):
        self._key, self._total, self._files_total = manifest.key, manifest.total_bytes, len(manifest.files)
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._on_disk: dict[str, int] = {}
        self._bytes = self._jobed = self._files_done = 0
        self._attempts = 1
        self._started = time.monotonic()
        self._emitted = 0.0

    def set(self, path: str, n_bytes: int, *, fetched: bool) -> None:
        """``path`` has ``n_bytes`` on disk now; ``fetched``: the growth came over the network."""
        with self._lock:
            grown = n_bytes - self._on_disk.get(path, 0)
            self._on_disk[path] = n_bytes
            self._bytes += grown
            self._jobed += max(grown, 0) if fetched else 0
        self.emit()

    def file_done(self, path: str, size: int) -> None:
        self.set(path, size, fetched=False)
        with self._lock:
            self._files_done += 1
        self.emit(force=True)

    def tried(self, attempt: int) -> None:
        with self._lock:
            self._attempts = max(self._attempts, attempt)
        if attempt > 1:
            self.emit(force=True)

    def snapshot(self) -> FetchProgress:
        with self._lock:
            elapsed = max(time.monotonic() - self._started, 1e-6)
            return FetchProgress(key=self._key, state=FetchState.FETCHING, bytes_done=self._bytes,
                                 bytes_total=self._total, rate_bytes_per_s=self._jobed / elapsed,
                                 files_done=self._files_done, files_total=self._files_total, attempts=self._attempts)

    def emit(self, force: bool = False) -> None:
        if self._on_progress is None:
            return
        now = time.monotonic()
        if not force and now - self._emitted < PROGRESS_EVERY_S:
            return
        self._emitted = now
        self._on_progress(self.snapshot())


@dataclass
class _Fetch:
    """What every worker of one fetch shares."""

    manifest: Manifest
    cache: NodeCache
    attempts: int
    backoff_s: float
    progress: _Progress
    endpoint: str | None = None
    token: str | None = None
    s3: Any = None
    stop: threading.Event = field(default_factory=threading.Event)
    partials: set[Path] = field(default_factory=set)  # written by this fetch: removed if it fails
    lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, partial: Path) -> None:
        with self.lock:
            self.partials.add(partial)


class _PartialFile:
    """A download's ``.incomplete`` file, reopened where an earlier try or a killed process left it and
    hashed as its bytes arrive; it takes its final name only once size and digests match. It is the
    file object ``http_get`` writes to (write, tell, seek, truncate)."""

    def __init__(self, path: Path, expected: _Expected, job: _Fetch, name: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        job.track(path)
        self.path, self._job, self._name = path, job, name
        self._hashes = _Hashes(expected)
        self._file = open(path, "ab")  # noqa: SIM115 - closed by finish() or __exit__
        if self._file.tell() > expected.size:
            self.truncate(0)
        else:
            self._rehash()

    @property
    def size(self) -> int:
        return self._file.tell()

    def write(self, chunk: bytes) -> int:
        if self._job.stop.is_set():
            raise _Stopped
        self._file.write(chunk)
        self._hashes.update(chunk)
        self._job.progress.set(self._name, self.size, fetched=True)
        return len(chunk)

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        """The server ignored a Range request: what is kept is hashed again."""
        size = self._file.truncate(size)
        self._file.seek(size)
        self._rehash()
        return size

    def _rehash(self) -> None:
        self._file.flush()
        self._hashes.reset()
        with open(self.path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                self._hashes.update(chunk)
        self._job.progress.set(self._name, self.size, fetched=False)

    def finish(self, final: Path) -> str:
        """Move the file to ``final`` if it is the expected one; returns its sha256. Not fsynced: a
        record of this boot vouches for it, a later boot checks it again (``cache.boot_id``)."""
        self._file.flush()
        size = self.size
        self._file.close()
        if (wrong := self._hashes.mismatch(size)) is not None:
            self.path.unlink(missing_ok=True)
            self._job.progress.set(self._name, 0, fetched=False)
            raise _Corrupt(f"the bytes that arrived are not the file ({wrong})")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path, final)
        return self._hashes.sha256.hexdigest()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _download_hub(job: _Fetch, file: RemoteFile) -> str:
    """One Hub file into ``blobs/<etag>`` (resumed, verified), then linked into the snapshot. A blob
    another revision brought is checked and linked, not downloaded. Returns its sha256."""
    manifest, cache = job.manifest, job.cache
    expected = _expected(manifest, file)
    with hub_online():
        url = hf_hub_url(manifest.source.location, file.path, revision=manifest.revision, endpoint=job.endpoint)
        meta = get_hf_file_metadata(url, token=job.token, endpoint=job.endpoint)
    if not meta.etag:
        raise SourceError("the Hub sent no ETag", 502)
    blob = cache.hub_blob(manifest, meta.etag)
    with WeakFileLock(cache.hub_lock(manifest, meta.etag)):
        sha256 = _verified_sha256(blob, expected) if blob.exists() else None
        if sha256 is None:
            blob.unlink(missing_ok=True)
            headers = build_hf_headers(token=job.token)
            if urlsplit(meta.location).netloc != urlsplit(url).netloc:
                headers.pop("authorization", None)  # a signed CDN address: the token stays with the Hub
            partial = cache.partial_path(manifest, file, meta.etag)
            assert partial is not None
            with hub_online(), _PartialFile(partial, expected, job, file.path) as out:
                http_get(meta.location, out,  # type: ignore[arg-type]  # a file-like wrapper around the partial file
                         resume_size=out.size, headers=headers, expected_size=file.size,
                         displayed_filename=file.path, tqdm_class=silent_tqdm)
                sha256 = out.finish(blob)
        cache.link_hub_file(manifest, file, meta.etag)
    if not cache.file_path(manifest, file).exists():
        raise _Corrupt("its blob was removed meanwhile")  # another revision's removal: fetch it again
    return sha256


def _download_s3(job: _Fetch, file: RemoteFile) -> str:
    """One S3 object, resumed with a Range request under ``If-Match`` (the bytes already on disk must
    belong to the same object), hashed as it streams. Returns its sha256."""
    manifest = job.manifest
    bucket, prefix = s3_location(manifest.source)
    key = prefix + file.path
    head = job.s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    etag = head["ETag"].strip('"')
    if file.etag and etag != file.etag:
        raise SourceError(f"s3://{bucket}/{key} changed since it was listed (ETag {etag}, listed {file.etag}): "
                          "deploy again to pin its new revision", 409)
    partial = job.cache.partial_path(manifest, file)
    assert partial is not None
    with _PartialFile(partial, _expected(manifest, file, _s3_sha256(head)), job, file.path) as out:
        if out.size < file.size:
            ranged = {"Range": f"bytes={out.size}-"} if out.size else {}
            response = job.s3.get_object(Bucket=bucket, Key=key, IfMatch=head["ETag"], **ranged)
            if ranged and "ContentRange" not in response:
                out.truncate(0)  # the whole object came back
            with closing(response["Body"]) as body:
                for chunk in body.iter_chunks(CHUNK_BYTES):
                    out.write(chunk)
        return out.finish(job.cache.file_path(manifest, file))


def _fetch_file(job: _Fetch, file: RemoteFile) -> None:
    """Bring one file into place, trying again with doubling pauses while the failure is transient."""
    download = _download_hub if job.manifest.source.kind is SourceKind.HUB else _download_s3
    where = f"{job.manifest.source}: {file.path}"
    for attempt in range(1, job.attempts + 1):
        if job.stop.is_set():
            raise _Stopped
        job.progress.tried(attempt)
        try:
            sha256 = download(job, file)
            break
        except _Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - _explain sorts every failure into retry or not
            reason, status, retry = _explain(exc)
            reason = scrub(reason)
            if not retry:
                raise SourceError(f"{where}: {reason}", status) from None
            if attempt == job.attempts:
                raise SourceError(f"{where}: failed {attempt} times on {job.cache.node_name}: {reason}", 502) from None
            delay = min(job.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
            log.warning("%s: try %d of %d failed (%s); next try in %.1f s", where, attempt, job.attempts, reason,
                        delay)
            if job.stop.wait(delay):
                raise _Stopped from None
    job.cache.mark_verified(job.manifest, file, sha256)
    job.progress.file_done(file.path, file.size)


def _recheck(job: _Fetch, file: RemoteFile) -> None:
    """A file on disk that the record does not vouch for (new to it, or its stat moved) is hashed; one
    that is not the file is deleted, to be fetched again."""
    if job.stop.is_set():
        raise _Stopped
    manifest, cache = job.manifest, job.cache
    record = cache.record(manifest.key)
    seen = record.verified.get(file.path) if record is not None else None
    sha256 = _verified_sha256(cache.file_path(manifest, file), _expected(manifest, file, seen.sha256 if seen is not None else None))
    if sha256 is None:
        log.warning("%s: %s on %s is corrupt: fetching it again", manifest.source, file.path, cache.node_name)
        cache.discard(manifest, file)
        return
    cache.mark_verified(manifest, file, sha256)
    job.progress.file_done(file.path, file.size)


def _for_each(job: _Fetch, workers: int, files: list[RemoteFile],
              task: Callable[[_Fetch, RemoteFile], None]) -> None:
    """``task`` on every file in a pool; the first lasting failure stops the others and is raised."""
    if not files:
        return
    failure: Exception | None = None
    with ThreadPoolExecutor(max_workers=min(workers, len(files)), thread_name_prefix="hive-fetch") as pool:
        for future in as_completed([pool.submit(task, job, f) for f in files]):
            try:
                future.result()
            except _Stopped:
                continue
            except Exception as exc:  # noqa: BLE001 - the first failure is raised once the pool is done
                if failure is None:
                    failure = exc
                    job.stop.set()
    if failure is not None:
        raise failure


def _partial_bytes(job: _Fetch, file: RemoteFile) -> int:
    partial = job.cache.partial_path(job.manifest, file)
    try:
        return partial.stat().st_size if partial is not None else 0
    except OSError:
        return 0


def _bytes_to_fetch(job: _Fetch, files: list[RemoteFile]) -> int:
    """What the pending files still need on disk: less what partial files hold, and nothing for a Hub
    blob another revision already brought."""
    manifest, cache = job.manifest, job.cache
    need = 0
    for file in files:
        blob_id = cache.hub_blob_id(file) if manifest.source.kind is SourceKind.HUB else None
        if not (blob_id and cache.hub_blob(manifest, blob_id).exists()):
            need += max(file.size - _partial_bytes(job, file), 0)
    return need


def _discard_partials(job: _Fetch) -> None:
    """A failed fetch leaves no partial file (complete, verified files stay). A Hub blob's partial is
    left alone while another fetch (another revision sharing it) holds its lock."""
    manifest, cache = job.manifest, job.cache
    partials = set(job.partials) | {p for f in manifest.files if (p := cache.partial_path(manifest, f))}
    for partial in partials:
        if manifest.source.kind is not SourceKind.HUB:
            partial.unlink(missing_ok=True)
            continue
        try:
            with WeakFileLock(cache.hub_lock(manifest, partial.name.removesuffix(PARTIAL_SUFFIX)), timeout=0.1):
                partial.unlink(missing_ok=True)
        except LockTimeout:
            pass


def fetch(manifest: Manifest, cache: NodeCache, *, workers: int = 8, attempts: int = 5, backoff_s: float = 0.5,
          on_progress: ProgressCallback | None = None, in_use: Collection[str] = frozenset()) -> Path:
    """Fill ``cache`` with ``manifest``'s files and return the folder an engine loads. Verified files
    are kept, partial ones resumed, changed ones hashed again; room is made by evicting entries not in
    ``in_use``. Raises ``SourceError`` (its message free of secrets) when the files cannot all be had;
    the partial files of this fetch are then removed."""
    if manifest.source.kind is SourceKind.LOCAL:
        return cache.local_folder(manifest)
    job = _Fetch(manifest, cache, attempts, backoff_s, _Progress(manifest, on_progress))
    try:
        if manifest.source.kind is SourceKind.HUB:
            job.endpoint, job.token = hub_endpoint(), hub_token()
        else:
            job.s3 = s3_client(retries=False)  # the fetch retries, and counts the tries, itself
        record = cache.record(manifest.key)  # made with the first verified file: a fetch that gets none leaves none
        pending = []
        for file in manifest.files:
            if cache.is_verified(manifest, file, record):
                job.progress.file_done(file.path, file.size)
            else:
                pending.append(file)
                job.progress.set(file.path, _partial_bytes(job, file), fetched=False)
        log.info("%s: fetching %d of %d files on %s", manifest.source, len(pending), len(manifest.files),
                 cache.node_name)
        _for_each(job, workers, [f for f in pending if cache.file_path(manifest, f).exists()], _recheck)
        pending = [f for f in pending if not cache.is_verified(manifest, f)]
        evicted = cache.make_room(_bytes_to_fetch(job, pending), {*in_use, manifest.key})
        if evicted:
            log.info("%s: evicted %s on %s to make room", manifest.source, ", ".join(evicted), cache.node_name)
        _for_each(job, workers, pending, _fetch_file)
    except Exception as exc:  # noqa: BLE001 - a failed fetch leaves no partial file, whatever failed
        _discard_partials(job)
        error = exc if isinstance(exc, SourceError) else SourceError(scrub(f"{manifest.source}: {exc}"), 500)
        log.warning("%s: fetch failed on %s: %s", manifest.source, cache.node_name, error.message)
        raise error from None
    cache.touch(manifest.key)
    job.progress.emit(force=True)
    return cache.folder(manifest)
