"""One node's weight cache: where each source's files live, which of them were verified, and what
may be evicted. Engines load from ``folder(manifest)`` with no network, so nothing reaches an engine
unless this cache vouches for every byte of it.

Layout under ``root``::

    hub/models--org--name/{blobs,snapshots/<sha>,refs}   the Hugging Face cache layout, so engines
                                                          and ``huggingface_hub`` read it as their own
    s3/<bucket--prefix>/<etags-revision>/<path>           one folder per S3 revision (``manifest.key``)
    .hive/<quoted key>.json                               one record per entry (``EntryRecord``)

A file is "verified" when its record holds its (size, mtime_ns) and sha256: a file whose stat still
matches is trusted without reading it; one whose stat moved is hashed again before anyone uses it.
Shared-volume (LOCAL) sources are never copied and have no entry.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from huggingface_hub.file_download import repo_folder_name
from pydantic import BaseModel, Field

from hive_apps.core.weights.types import (
    CacheDisk,
    CachedWeights,
    Manifest,
    RemoteFile,
    SourceError,
    SourceKind,
)

PARTIAL_SUFFIX = ".incomplete"
_BLOB_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")


def boot_id() -> str:
    """This machine's boot (Linux); files are not fsynced as they arrive (``hf download`` does not
    either, and it cost a fifth of the throughput), so a file verified before a crash or a power
    loss may not hold those bytes after it: a record from another boot is checked again."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = boot_id()


class VerifiedFile(BaseModel):
    """A file whose bytes were checked: the stat that proves it has not changed since (in this boot),
    and its sha256 (the digest to compare with when the stat moved and the source vouches for none,
    e.g. a multipart S3 object)."""

    size: int
    mtime_ns: int
    sha256: str
    boot: str = ""


class EntryRecord(BaseModel):
    """What a node keeps about one cache entry (``<root>/.hive/<quoted key>.json``)."""

    key: str
    source: str
    revision: str
    manifest: Manifest
    last_used: float = Field(default_factory=time.time)
    verified: dict[str, VerifiedFile] = Field(default_factory=dict)  # by RemoteFile.path

    @property
    def bytes(self) -> int:
        return sum(v.size for v in self.verified.values())


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _users(in_use: Collection[str], key: str) -> str:
    """Who holds ``key``, for a refusal: the model ids when the caller passed a key -> models mapping."""
    models = in_use.get(key) if isinstance(in_use, Mapping) else None
    return ", ".join(models) if models else "a deployed model"


class NodeCache:
    """The weight cache of one node. Thread-safe: records are read and rewritten under one lock per
    folder and replaced atomically on disk, so a killed process leaves the old record or the new one."""

    def __init__(self, root: Path, node_name: str | None = None):
        self.root = Path(root)
        self.node_name = node_name or socket.gethostname()
        self._records = self.root / ".hive"
        self._records.mkdir(parents=True, exist_ok=True)
        self._lock = _root_lock(self.root)

    # -- layout ---------------------------------------------------------------------------------

    @property
    def hub_dir(self) -> Path:
        """The ``cache_dir`` handed to ``huggingface_hub``."""
        return self.root / "hub"

    def _hub_repo(self, manifest: Manifest) -> Path:
        return self.hub_dir / repo_folder_name(repo_id=manifest.source.location, repo_type="model")

    def folder(self, manifest: Manifest) -> Path:
        """The folder an engine loads: the Hub snapshot, the S3 revision's folder, or the shared folder."""
        kind = manifest.source.kind
        if kind is SourceKind.HUB:
            return self._hub_repo(manifest) / "snapshots" / manifest.revision
        if kind is SourceKind.S3:
            return self.root / manifest.key
        return Path(manifest.source.location)

    def file_path(self, manifest: Manifest, file: RemoteFile) -> Path:
        """Where ``file`` is loaded from; a listed path that would leave the folder is refused."""
        parts = PurePosixPath(file.path).parts
        if not parts or file.path.startswith("/") or ".." in parts:
            raise SourceError(f"{manifest.source} lists {file.path!r}, which is not a path inside it", 422)
        return self.folder(manifest).joinpath(*parts)

    def hub_blob(self, manifest: Manifest, blob_id: str) -> Path:
        """A blob, named by the Hub's ETag: a name that is not a plain file name is refused."""
        if not _BLOB_ID.fullmatch(blob_id):
            raise SourceError(f"the Hub named a blob of {manifest.source} {blob_id!r}", 502)
        return self._hub_repo(manifest) / "blobs" / blob_id

    def hub_lock(self, manifest: Manifest, blob_id: str) -> Path:
        """The lock ``hf_hub_download`` takes for that blob, so neither side writes it under the other."""
        return self.hub_dir / ".locks" / self._hub_repo(manifest).name / f"{blob_id}.lock"

    def link_hub_file(self, manifest: Manifest, file: RemoteFile, blob_id: str) -> None:
        """Point the snapshot's file at its blob with a relative symlink, as ``huggingface_hub`` does;
        replaced atomically, so a reader sees the old link or the new one."""
        pointer = self.file_path(manifest, file)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        tmp = pointer.with_name(f".{pointer.name}.{uuid.uuid4().hex[:8]}.link")
        os.symlink(os.path.relpath(self.hub_blob(manifest, blob_id), pointer.parent), tmp)
        os.replace(tmp, pointer)

    @staticmethod
    def hub_blob_id(file: RemoteFile) -> str | None:
        """The blob a Hub file is stored as, as its listing names it (LFS sha256, else git blob id):
        the Hub's ETag for that file, which ``huggingface_hub`` names blobs by."""
        return file.sha256 or file.etag

    def partial_path(self, manifest: Manifest, file: RemoteFile, blob_id: str | None = None) -> Path | None:
        """Where an unfinished download of ``file`` lives: next to its final name, never under it."""
        if manifest.source.kind is SourceKind.S3:
            return self.file_path(manifest, file).with_name(Path(file.path).name + PARTIAL_SUFFIX)
        if manifest.source.kind is SourceKind.HUB and (blob_id := blob_id or self.hub_blob_id(file)):
            return self.hub_blob(manifest, blob_id).with_name(blob_id + PARTIAL_SUFFIX)
        return None

    def local_folder(self, manifest: Manifest) -> Path:
        """A shared-volume source as this node sees it: it is loaded in place, never copied."""
        folder = Path(manifest.source.location)
        if not folder.is_dir():
            raise SourceError(f"{folder} is not on node {self.node_name}: a folder source must be on every node "
                              "that runs it (a shared volume)", 404)
        if not (folder / "config.json").is_file():
            raise SourceError(f"{folder} on node {self.node_name} has no config.json", 422)
        return folder

    # -- records --------------------------------------------------------------------------------

    def _record_path(self, key: str) -> Path:
        return self._records / (quote(key, safe="") + ".json")

    def record(self, key: str) -> EntryRecord | None:
        try:
            return EntryRecord.model_validate_json(self._record_path(key).read_bytes())
        except (OSError, ValueError):  # none, or a key no file can be named after (too long: ENAMETOOLONG)
            return None

    def _save(self, record: EntryRecord) -> None:
        path = self._record_path(record.key)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(record.model_dump_json())
        os.replace(tmp, path)

    def _records_all(self) -> list[EntryRecord]:
        records = []
        for path in sorted(self._records.glob("*.json")):
            try:
                records.append(EntryRecord.model_validate_json(path.read_bytes()))
            except (OSError, ValueError):
                continue  # a record being replaced: the next listing sees it
        return records

    def _open_entry(self, manifest: Manifest) -> EntryRecord:
        """The record of ``manifest``'s entry, created with its first verified file."""
        with self._lock:
            record = self.record(manifest.key)
            if record is None:
                record = EntryRecord(key=manifest.key, source=str(manifest.source), revision=manifest.revision,
                                     manifest=manifest)
                self._save(record)
            return record

    def mark_verified(self, manifest: Manifest, file: RemoteFile, sha256: str) -> None:
        """``file`` is in place and its bytes were checked just now."""
        st = self.file_path(manifest, file).stat()
        with self._lock:
            record = self._open_entry(manifest)
            record.verified[file.path] = VerifiedFile(size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=sha256,
                                                      boot=BOOT_ID)
            self._save(record)

    def discard(self, manifest: Manifest, file: RemoteFile) -> None:
        """Delete a file that failed its check, with the Hub blob behind it: no engine may load it, and
        another revision linking the same blob would load the same wrong bytes."""
        path = self.file_path(manifest, file)
        if path.is_symlink():
            Path(os.path.realpath(path)).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        self.forget(manifest, file)

    def forget(self, manifest: Manifest, file: RemoteFile) -> None:
        with self._lock:
            record = self.record(manifest.key)
            if record is not None and record.verified.pop(file.path, None) is not None:
                self._save(record)

    def is_verified(self, manifest: Manifest, file: RemoteFile, record: EntryRecord | None = None) -> bool:
        """Cheap: the record and one stat (following the Hub's snapshot link to its blob)."""
        record = record if record is not None else self.record(manifest.key)
        seen = record.verified.get(file.path) if record is not None else None
        if seen is None or seen.size != file.size or seen.boot != BOOT_ID:
            return False
        try:
            st = self.file_path(manifest, file).stat()
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns) == (seen.size, seen.mtime_ns)

    def is_complete(self, manifest: Manifest) -> bool:
        if manifest.source.kind is SourceKind.LOCAL:
            return (Path(manifest.source.location) / "config.json").is_file()
        record = self.record(manifest.key)
        return record is not None and all(self.is_verified(manifest, f, record) for f in manifest.files)

    def touch(self, key: str) -> None:
        """An engine loads it or a deploy asks for it: it moves to the back of the eviction line."""
        with self._lock:
            record = self.record(key)
            if record is not None:
                record.last_used = time.time()
                self._save(record)

    # -- listing, removal, eviction -------------------------------------------------------------

    def entries(self, in_use: Collection[str] = frozenset()) -> list[CachedWeights]:
        return [CachedWeights(key=r.key, source=r.source, revision=r.revision, bytes=r.bytes,
                              complete=self.is_complete(r.manifest), last_used=r.last_used, in_use=r.key in in_use)
                for r in self._records_all()]

    def remove(self, key: str, in_use: Collection[str] = frozenset()) -> bool:
        """Delete an entry's files and record; False when there is no such entry. ``in_use`` may map
        keys to the model ids that use them, for the refusal to name them."""
        if key in in_use:
            raise SourceError(f"{key} is in use by {_users(in_use, key)}: delete the model first", 409)
        with self._lock:
            record = self.record(key)
            if record is None:
                return False
            manifest = record.manifest
            if manifest.source.kind is SourceKind.HUB:
                self._remove_hub_revision(manifest)
            elif manifest.source.kind is SourceKind.S3:
                shutil.rmtree(self.folder(manifest), ignore_errors=True)
                self._prune_empty(self.folder(manifest).parent, stop=self.root)
            self._record_path(key).unlink(missing_ok=True)
            return True

    def _remove_hub_revision(self, manifest: Manifest) -> None:
        """Drop one snapshot, and only the blobs no other snapshot of the repo links to: revisions of a
        repo share the blobs of the files they have in common."""
        repo = self._hub_repo(manifest)
        snapshot = self.folder(manifest)
        doomed = _link_targets([snapshot])
        others = [s for s in (repo / "snapshots").glob("*") if s != snapshot]
        blobs = Path(os.path.realpath(repo / "blobs"))
        for blob in doomed - _link_targets(others):
            if blob.parent == blobs:
                blob.unlink(missing_ok=True)
        for file in manifest.files:  # what a killed fetch of this revision left
            if (partial := self.partial_path(manifest, file)) is not None:
                partial.unlink(missing_ok=True)
        shutil.rmtree(snapshot, ignore_errors=True)
        for ref in (repo / "refs").rglob("*") if (repo / "refs").is_dir() else ():
            if ref.is_file() and ref.read_text().strip() == manifest.revision:
                ref.unlink()
        for folder in ("snapshots", "refs", "blobs", ""):
            self._prune_empty(repo / folder, stop=self.hub_dir)

    @staticmethod
    def _prune_empty(folder: Path, stop: Path) -> None:
        """Remove ``folder`` and its parents below ``stop`` while they are empty."""
        while folder != stop and stop in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    def evict_for(self, need_bytes: int, in_use: Collection[str] = frozenset()) -> list[str]:
        """Free room for ``need_bytes`` by removing whole complete entries that no model uses, least
        recently used first. Evicts nothing when even every candidate would not make room."""
        with self._lock:
            free = shutil.disk_usage(self.root).free
            if free >= need_bytes:
                return []
            candidates = sorted((r for r in self._records_all()
                                 if r.key not in in_use and self.is_complete(r.manifest)),
                                key=lambda r: r.last_used)
            if free + sum(r.bytes for r in candidates) < need_bytes:
                return []
            evicted = []
            for record in candidates:
                self.remove(record.key, in_use)
                evicted.append(record.key)
                if shutil.disk_usage(self.root).free >= need_bytes:
                    break
            return evicted

    def make_room(self, need_bytes: int, in_use: Collection[str] = frozenset()) -> list[str]:
        """``evict_for``, then a refusal that says how much this node lacks when it is still short."""
        evicted = self.evict_for(need_bytes, in_use)
        free = shutil.disk_usage(self.root).free
        if free < need_bytes:
            raise SourceError(f"needs {format_bytes(need_bytes - free)} more on {self.node_name}: "
                              f"{format_bytes(free)} free, {format_bytes(need_bytes)} to fetch", 507)
        return evicted

    def disk(self) -> CacheDisk:
        usage = shutil.disk_usage(self.root)
        return CacheDisk(root=str(self.root), total_bytes=usage.total, free_bytes=usage.free,
                         cached_bytes=self._cached_bytes())

    def _cached_bytes(self) -> int:
        """Bytes of verified files, each blob once however many Hub revisions link to it."""
        seen: dict[tuple[int, int], int] = {}
        for record in self._records_all():
            for file in record.manifest.files:
                if file.path in record.verified:
                    try:
                        st = self.file_path(record.manifest, file).stat()
                    except OSError:
                        continue
                    seen[(st.st_dev, st.st_ino)] = st.st_size
        return sum(seen.values())


_root_locks: dict[Path, threading.RLock] = {}
_root_locks_guard = threading.Lock()


def _root_lock(root: Path) -> threading.RLock:
    """One lock per cache folder in this process, however many ``NodeCache`` objects open it (the
    fetcher's, and an engine's ``touch``): a record is read, changed and rewritten under it."""
    with _root_locks_guard:
        return _root_locks.setdefault(root.resolve(), threading.RLock())


def _link_targets(snapshots: Iterable[Path]) -> set[Path]:
    """The blobs the snapshot folders' links point to."""
    targets = set()
    for snapshot in snapshots:
        for path in snapshot.rglob("*"):
            if path.is_symlink():
                targets.add(Path(os.path.realpath(path)))
    return targets
