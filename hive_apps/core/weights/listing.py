"""What a weight source holds, and the few small files the planner reads, fetched before any weight.

The planner lists a deploy's source once (``list_source``): the listing pins the revision every
replica will load and gives the checkpoint's size (``Manifest.weight_bytes``) without downloading a
weight. ``fetch_metadata`` then brings only the config, tokenizer and index files the planner reads.
No Ray here: this runs wherever the planner runs, and shares its clients with the nodes' fetch
(``clients``).

Credentials come from the environment at call time (``HF_TOKEN``; boto3's standard ``AWS_*``
variables), so a rotated key needs no restart, and no message ever carries one. The Hub is asked
even where ``HF_HUB_OFFLINE`` keeps the engines off it: only the calling thread goes online, as in
the nodes' fetch (``clients.hub_online``).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoSibling
from huggingface_hub.utils import tqdm as hf_tqdm

from hive_apps.core.weights.clients import hub_endpoint, hub_online, hub_token, s3_client, s3_location, scrub
from hive_apps.core.weights.types import Manifest, RemoteFile, SourceError, SourceKind, WeightSource, etag_revision

HUB_TIMEOUT_S = 30.0
MAX_METADATA_BYTES = 64 * 1024 * 1024

# The top-level files the planner (and the engine's tokenizer) read: configs, the safetensors index,
# Mistral's params.json, chat templates and tokenizer files. Matched against a file's name at the
# source's root; a weight file is never metadata, whatever its name.
METADATA_PATTERNS: tuple[str, ...] = (
    "config.json", "generation_config.json", "*config.json",  # hf_quant_config, quantize_config, processor...
    "*.safetensors.index.json", "params.json", "chat_template*",
    "tokenizer.json", "tokenizer.model", "tekken.json", "*.tiktoken", "vocab.*", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "spiece.model", "sentencepiece*.model",
    "modules.json", "config_sentence_transformers.json",
)
WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack",
                                    "*.onnx", "*.ckpt")

_S3_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
              "ExpiredToken", "InvalidToken", "AccountProblem"}


def is_metadata(path: str) -> bool:
    """Whether the planner reads this file: a top-level config, index, template or tokenizer file."""
    return "/" not in path and not _matches(path, WEIGHT_PATTERNS) and _matches(path, METADATA_PATTERNS)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# -- listing -----------------------------------------------------------------------------------


def list_source(source: WeightSource) -> Manifest:
    """Every file of the source at one resolved revision (a Hub commit, an S3 ETag set, or "local"),
    with sizes; no weight is read. ``SourceError`` when it cannot be listed, or when a Hub or S3
    source holds no safetensors (a folder is the operator's own: whatever vLLM loads from it)."""
    listers: dict[SourceKind, Callable[[WeightSource], Manifest]] = {
        SourceKind.HUB: _list_hub, SourceKind.S3: _list_s3, SourceKind.LOCAL: _list_local}
    manifest = listers[source.kind](source)
    if source.kind is not SourceKind.LOCAL and not any(f.path.endswith(".safetensors") for f in manifest.files):
        raise SourceError(f"{source} has no safetensors weights; the hive loads safetensors only", 422)
    return manifest


def _list_hub(source: WeightSource) -> Manifest:
    api = HfApi(endpoint=hub_endpoint(), token=hub_token() or False)
    with _asking_hub(source):
        info = api.model_info(source.location, revision=source.revision or "main", files_metadata=True,
                              timeout=HUB_TIMEOUT_S)
    if not info.sha:
        raise SourceError(f"the Hub at {hub_endpoint()} gave no commit for {source}", 502)
    manifest = Manifest(source=source, revision=info.sha, files=[_hub_file(source, s) for s in info.siblings or []])
    if info.gated and manifest.files:
        # A gated repo lists for anyone; only its files need access. Ask for one file's headers now, so
        # a missing grant is the deploy's 401/403 and not every node's failed fetch.
        probe = next((f for f in manifest.files if f.path.endswith(".safetensors")), manifest.files[0])
        with _asking_hub(source, probe.path):
            get_hf_file_metadata(hf_hub_url(source.location, probe.path, revision=info.sha, endpoint=hub_endpoint()),
                                 token=hub_token() or False, timeout=HUB_TIMEOUT_S)
    return manifest


def _hub_file(source: WeightSource, sibling: RepoSibling) -> RemoteFile:
    size = sibling.lfs.size if sibling.lfs else sibling.size
    if size is None:
        raise SourceError(f"the Hub at {hub_endpoint()} listed {source} without file sizes", 502)
    if sibling.lfs:
        return RemoteFile(path=sibling.rfilename, size=size, sha256=sibling.lfs.sha256)
    return RemoteFile(path=sibling.rfilename, size=size, etag=sibling.blob_id)


def _list_s3(source: WeightSource) -> Manifest:
    bucket, prefix = s3_location(source)
    files = []
    with s3_errors(source):
        for page in s3_client(retries=True).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                if not obj["Key"].endswith("/"):  # a console "folder" marker holds nothing
                    files.append(RemoteFile(path=obj["Key"][len(prefix):], size=obj["Size"],
                                            etag=obj["ETag"].strip('"')))
    if not files:
        raise SourceError(f"{source} holds no objects", 404)
    return Manifest(source=source, revision=etag_revision(files), files=files)


def _list_local(source: WeightSource) -> Manifest:
    """Sizes only: hashing a local checkpoint would read every weight, and the folder is the
    operator's, not a copy to verify."""
    root = Path(source.location)
    if not root.is_dir():
        # 422 as before sources had kinds: the body names a path this node cannot use
        raise SourceError(f"local folder {root} does not exist on node {socket.gethostname()}", 422)

    def refuse(error: OSError) -> None:
        raise error

    files = []
    try:
        for folder, subfolders, names in os.walk(root, onerror=refuse):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))  # .git, .cache
            for name in sorted(n for n in names if not n.startswith(".")):
                path = Path(folder, name)
                files.append(RemoteFile(path=path.relative_to(root).as_posix(), size=path.stat().st_size))
    except OSError as e:
        raise SourceError(f"local folder {root} cannot be read on node {socket.gethostname()}: "
                          f"{e.strerror or e}", 403) from e
    return Manifest(source=source, revision="local", files=files)


# -- metadata ----------------------------------------------------------------------------------


class _Silent(hf_tqdm):
    """No progress bars for a few small files in a service's log."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def fetch_metadata(manifest: Manifest, dest_root: Path) -> Path:
    """The folder ``dest_root / manifest.key`` holding the manifest's metadata files (never a weight),
    each renamed into place only once complete and checked; files already there are kept. A local
    source is its own folder."""
    if manifest.source.kind is SourceKind.LOCAL:
        return Path(manifest.source.location)
    wanted = [f for f in manifest.files if is_metadata(f.path)]
    for f in wanted:
        if f.size > MAX_METADATA_BYTES:
            raise SourceError(f"{manifest.source}: {f.path} is {f.size} bytes; a metadata file may be at most "
                              f"{MAX_METADATA_BYTES // 2**20} MiB", 422)
    folder = dest_root / manifest.key
    folder.mkdir(parents=True, exist_ok=True)
    missing = [f for f in wanted if not ((folder / f.path).is_file() and (folder / f.path).stat().st_size == f.size)]
    if not missing:
        return folder
    scratch = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:8]}.part"  # same disk: renames are atomic
    scratch.mkdir()
    download: Callable[[Manifest, RemoteFile, Path], Path] = (
        _hub_download if manifest.source.kind is SourceKind.HUB
        else functools.partial(_s3_download, s3_client(retries=True)))
    try:
        for f in missing:
            part = download(manifest, f, scratch)
            problem = _check(manifest.source, f, part)
            if problem:
                raise SourceError(f"{manifest.source}: {f.path} {problem}", 502)
            os.replace(part, folder / f.path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _hub_download(manifest: Manifest, file: RemoteFile, scratch: Path) -> Path:
    with _asking_hub(manifest.source, file.path):
        return Path(hf_hub_download(manifest.source.location, file.path, revision=manifest.revision,
                                    local_dir=scratch, endpoint=hub_endpoint(), token=hub_token() or False,
                                    tqdm_class=_Silent))


def _s3_download(client: Any, manifest: Manifest, file: RemoteFile, scratch: Path) -> Path:
    bucket, prefix = s3_location(manifest.source)
    part = scratch / file.path
    with s3_errors(manifest.source), open(part, "wb") as out:
        body = client.get_object(Bucket=bucket, Key=prefix + file.path, IfMatch=f'"{file.etag}"')["Body"]
        out.writelines(body.iter_chunks(1 << 20))
    return part


def _check(source: WeightSource, file: RemoteFile, path: Path) -> str | None:
    """Why the downloaded bytes are not the listed file, or None."""
    size = path.stat().st_size
    if size != file.size:
        return f"arrived with {size} bytes, listed with {file.size}"
    if file.sha256:
        h, want = hashlib.sha256(), file.sha256
    elif source.kind is SourceKind.HUB and file.etag:
        h, want = hashlib.sha1(f"blob {size}\0".encode()), file.etag  # the git blob id
    else:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return None if h.hexdigest() == want else "arrived with other bytes than the listing's hash"


# -- errors ------------------------------------------------------------------------------------


def _causes(error: BaseException | None) -> Iterator[BaseException]:
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


@contextmanager
def _asking_hub(source: WeightSource, file: str | None = None) -> Iterator[None]:
    """One call to the Hub on the hive's behalf: online in this thread, its failures ``SourceError``."""
    with hub_errors(source, file), hub_online():
        yield


@contextmanager
def hub_errors(source: WeightSource, file: str | None = None) -> Iterator[None]:
    """Turns huggingface_hub's failures into ``SourceError``: 404 unknown repo, revision or file; 401
    no token or a refused one; 403 a token without access; 502 the Hub did not answer."""
    try:
        yield
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:  # OSError: a failed HEAD, offline mode, the disk
        raise _hub_error(source, file, e) from e


def _hub_error(source: WeightSource, file: str | None, error: BaseException) -> SourceError:
    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        error = error.__cause__  # hf_hub_download's wrapper around the HEAD request that failed
    repo, token = source.location, hub_token()
    status = error.response.status_code if isinstance(error, HfHubHTTPError) else 0
    if isinstance(error, RevisionNotFoundError):
        return SourceError(f"Hub repo {repo} has no revision {source.revision or 'main'!r} (a branch, tag or commit)",
                           404)
    if isinstance(error, GatedRepoError):
        if token is None:
            return SourceError(f"Hub repo {repo} is gated: set HF_TOKEN to a token that was granted access", 401)
        return SourceError(f"HF_TOKEN has not been granted access to the gated Hub repo {repo}: request access "
                           "on its page", 403)
    if isinstance(error, RepositoryNotFoundError) and status != 401:
        return SourceError(f"Hub repo {repo} was not found" + (" (or HF_TOKEN cannot see it)" if token else ""), 404)
    if isinstance(error, RemoteEntryNotFoundError):
        return SourceError(f"Hub repo {source} has no file {file} at the listed revision", 404)
    if status == 401 and token is None:  # the Hub hides private repos from anonymous callers
        return SourceError(f"Hub repo {repo} was not found, or it is private or gated and HF_TOKEN is not set", 401)
    if status == 401:
        return SourceError(f"the Hub refused HF_TOKEN for {repo} (invalid or expired)", 401)
    if status == 403:
        return SourceError(f"HF_TOKEN has no access to Hub repo {repo}", 403)
    if status:
        return SourceError(f"the Hub at {hub_endpoint()} answered {status} for {source}", 502)
    network = next((e for e in _causes(error) if isinstance(e, (httpx2.HTTPError, ConnectionError, TimeoutError))),
                   None)
    if network is not None:
        return SourceError(f"the Hub at {hub_endpoint()} could not be reached for {source}: {scrub(str(network))}",
                           502)
    return SourceError(f"fetching {source} from the Hub at {hub_endpoint()} failed: {scrub(str(error))}", 502)


@contextmanager
def s3_errors(source: WeightSource) -> Iterator[None]:
    """Turns boto3's failures into ``SourceError``: 404 no bucket or object, 401 no credentials, 403
    refused credentials, 502 S3 did not answer."""
    bucket, _ = s3_location(source)
    try:
        yield
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code == "NoSuchBucket":
            raise SourceError(f"S3 bucket {bucket!r} does not exist ({source})", 404) from e
        if code in ("NoSuchKey", "404", "PreconditionFailed") or status in (404, 412):
            raise SourceError(f"{source} changed since it was listed ({code or status}): deploy it again", 404) from e
        if code in _S3_DENIED or status == 403:
            raise SourceError(f"S3 refused the credentials for {source} ({code or status}): check the AWS_* "
                              "variables or the node's role", 403) from e
        raise SourceError(f"S3 answered {code or status} for {source}", 502) from e
    except (NoCredentialsError, PartialCredentialsError) as e:
        raise SourceError(f"no AWS credentials on node {socket.gethostname()} for {source}: set AWS_ACCESS_KEY_ID "
                          "and AWS_SECRET_ACCESS_KEY, or give the node a role", 401) from e
    except BotoCoreError as e:
        raise SourceError(f"S3 did not answer for {source}: {scrub(str(e))}", 502) from e
