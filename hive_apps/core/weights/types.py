"""Typed boundaries of getting weights onto nodes: where weights come from, what a source holds,
how far a node's fetch has got, and what a node's cache keeps. Pure: no Ray, no network.

A deploy's ``model`` names a source in one of three ways (``parse_source``):

* ``org/name`` or ``org/name@revision`` — a Hugging Face Hub repository; the revision is a branch,
  a tag or a commit (default ``main``). The deploy records the commit it resolved to.
* ``s3://bucket/prefix`` — every object under the prefix, through boto3 and the standard AWS
  variables (``AWS_ENDPOINT_URL`` included). The deploy records the set of ETags it saw.
* an absolute folder (``/models/qwen3``; ``~`` and ``./`` are expanded on the planner's node) —
  it must exist on every node an engine runs on (a shared volume): each node checks its own.
"""

from __future__ import annotations

import hashlib
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class SourceKind(str, Enum):
    HUB = "hub"
    S3 = "s3"
    LOCAL = "local"


class WeightSource(BaseModel):
    """One parsed ``model`` string."""

    model_config = ConfigDict(frozen=True)

    kind: SourceKind
    location: str  # hub: "org/name"; s3: "bucket/prefix" (no trailing slash); local: an absolute folder
    revision: str | None = None  # hub: the branch, tag or commit asked for (None = main); else None

    def __str__(self) -> str:
        if self.kind is SourceKind.HUB:
            return self.location + (f"@{self.revision}" if self.revision else "")
        if self.kind is SourceKind.S3:
            return f"s3://{self.location}"
        return self.location


class RemoteFile(BaseModel):
    """One file of a source, as its listing gives it: enough to download it and check it."""

    path: str  # relative to the source's root, "/"-separated
    size: int = Field(ge=0)
    sha256: str | None = None  # the Hub's LFS files
    etag: str | None = None  # S3 (quotes stripped); the Hub's git blob id for small files


class Manifest(BaseModel):
    """What a source holds at one resolved revision. A deploy, its wakes and its heals load exactly
    these files: the revision is pinned when the deploy is planned."""

    source: WeightSource
    revision: str  # hub: the commit sha; s3: "etags-<digest>" of every (path, ETag); local: "local"
    files: list[RemoteFile] = Field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the safetensors files: what the engine loads onto its devices (headers included)."""
        return sum(f.size for f in self.files if f.path.endswith(".safetensors"))

    @property
    def key(self) -> str:
        """The cache entry of this revision on a node: one folder, shared by every replica and every
        model that names the same source and revision."""
        if self.source.kind is SourceKind.LOCAL:
            return "local/" + hashlib.sha256(self.source.location.encode()).hexdigest()[:16]
        return f"{self.source.kind.value}/{self.source.location.replace('/', '--')}/{self.revision}"


def etag_revision(files: list[RemoteFile]) -> str:
    """The revision of an S3 prefix: a digest of every file's path and ETag, so any change of any
    object is a new revision and the same objects are always the same one."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.etag or ''}\0{f.size}\n".encode())
    return "etags-" + h.hexdigest()[:16]


class SourceError(Exception):
    """A source cannot be listed or fetched: ``status_code`` is the HTTP status the admin answers
    (404 unknown repo/revision/bucket, 401 no or bad credentials, 403 no access, 422 a source the hive
    cannot use, 502 the source did not answer). The message names the source and never a secret."""

    def __init__(self, message: str, status_code: int = 422):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


class FetchState(str, Enum):
    FETCHING = "fetching"
    READY = "ready"  # every file complete and verified in the node's cache
    FAILED = "failed"


class FetchProgress(BaseModel):
    """One node's fetch of one manifest."""

    key: str
    state: FetchState
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bytes_per_s: float = 0.0  # over the fetch so far
    files_done: int = 0
    files_total: int = 0
    attempts: int = 1  # a network failure is retried with back-off; this counts the tries
    error: str = ""  # why it failed (FAILED only)
    path: str = ""  # the folder the engine loads (READY only): on this node, never sent to another


class CachedWeights(BaseModel):
    """One entry of a node's weight cache (``GET /admin/weights``)."""

    key: str
    source: str  # the source as written (no credentials: they never appear in a source)
    revision: str
    bytes: int
    complete: bool
    last_used: float  # epoch seconds: fetched, loaded by an engine, or asked for by a deploy
    in_use: bool = False  # a deployed model names it: never evicted, DELETE refused


class CacheDisk(BaseModel):
    """The disk under a node's weight cache (``GET /admin/nodes``)."""

    root: str
    total_bytes: int
    free_bytes: int
    cached_bytes: int = 0  # held by cached weights (evictable unless in use)
