"""A node's weight cache and its fetch (``hive_apps/core/weights/{cache,fetch,fetcher}.py``) against S3's real
protocol (moto's server, boto3) and a Hub-compatible server (``tests/fixtures/fake_hub.py``), with
``HF_HUB_OFFLINE`` on as engines and CI run: the fetch must get through it and leave it on."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import httpx2
import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub import hf_hub_download, try_to_load_from_cache

from hive_apps.core.weights import fetch as fetch_mod
from hive_apps.core.weights import fetcher as fetcher_mod
from hive_apps.core.weights.cache import NodeCache
from hive_apps.core.weights.fetch import fetch
from hive_apps.core.weights.fetcher import WeightFetcher
from hive_apps.core.weights.types import (
    FetchState,
    Manifest,
    RemoteFile,
    SourceError,
    SourceKind,
    WeightSource,
    etag_revision,
)
from tests.fixtures.fake_hub import FakeHub, fake_safetensors

KiB, MiB = 2**10, 2**20
HF_SECRET = "hf_" + "Zq8" * 12
AWS_SECRET = "aws/" + "Xy7" * 12
NODE = "node-a"


class _Killed(BaseException):
    """The process died here: nothing below may clean up (no ``except Exception`` catches it)."""


@pytest.fixture(scope="module")
def hub(fake_hub):
    return fake_hub


@pytest.fixture(scope="module")
def s3_url(moto_s3_url):
    return moto_s3_url


@pytest.fixture(autouse=True)
def env(monkeypatch, hub, s3_url):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)  # as read at import with HF_HUB_OFFLINE=1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for name, value in {"AWS_ENDPOINT_URL": s3_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_SECRET_ACCESS_KEY": AWS_SECRET}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 64 * KiB)  # a few writes per file, so a kill lands mid-file
    monkeypatch.setattr(fetch_mod, "PROGRESS_EVERY_S", 0.0)


@pytest.fixture
def cache(tmp_path) -> NodeCache:
    return NodeCache(tmp_path / "cache", NODE)


def model_files(tag: str, shards: int = 2, shard_bytes: int = 512 * KiB) -> dict[str, bytes]:
    files = {"config.json": b'{"model_type": "llama", "tag": "%s"}' % tag.encode()}
    for i in range(shards):
        files[f"model-{i + 1:05d}-of-{shards:05d}.safetensors"] = fake_safetensors(f"{tag}-{i}", shard_bytes)
    return files


# -- the two sources: a model on each, and the bytes each sent -------------------------------------


def hub_model(hub: FakeHub, files: dict[str, bytes], repo: str | None = None) -> Manifest:
    """A repo on the fake Hub and its manifest as the listing gives it (LFS: sha256; else git blob id)."""
    repo = repo or f"org/m-{uuid.uuid4().hex[:8]}"
    sha = hub.add_repo(repo, files)
    remote = [RemoteFile(path=p, size=len(d), sha256=hashlib.sha256(d).hexdigest()) if p.endswith(".safetensors")
              else RemoteFile(path=p, size=len(d), etag=hashlib.sha1(b"blob %d\0" % len(d) + d).hexdigest())
              for p, d in files.items()]
    return Manifest(source=WeightSource(kind=SourceKind.HUB, location=repo), revision=sha, files=remote)


def s3_model(files: dict[str, bytes], multipart: tuple[str, ...] = ()) -> Manifest:
    """Objects under a fresh bucket's prefix (``multipart``: uploaded in one part of a multipart
    upload, so their ETag is ``<md5 of md5s>-1``), and their manifest as the listing gives it."""
    client = boto3.client("s3")
    bucket, prefix = f"b-{uuid.uuid4().hex[:10]}", "models/tiny"
    client.create_bucket(Bucket=bucket)
    remote = []
    for path, data in files.items():
        key = f"{prefix}/{path}"
        if path in multipart:
            upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                             MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
        else:
            client.put_object(Bucket=bucket, Key=key, Body=data)
        etag = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        remote.append(RemoteFile(path=path, size=len(data), etag=etag))
    return Manifest(source=WeightSource(kind=SourceKind.S3, location=f"{bucket}/{prefix}"),
                    revision=etag_revision(remote), files=remote)


class S3Wire:
    """The fetch's S3 clients, watched: the body bytes read per object, and a planted connection drop
    after some bytes of one object's next body. One for the module: the fetch keeps its clients."""

    def __init__(self):
        self.served: Counter[str] = Counter()
        self.cuts: dict[str, int] = {}

    def watch(self, client: Any) -> Any:
        """Idempotent: the same client is watched once."""
        def after(parsed: dict, model: Any, context: dict, **_: Any) -> None:
            key = context["hive_key"]
            parsed["Body"] = _Body(parsed["Body"], self, key, self.cuts.pop(key, None))

        def before(params: dict, context: dict, **_: Any) -> None:
            context["hive_key"] = params["Key"].rsplit("/", 1)[-1]

        client.meta.events.register("before-parameter-build.s3.GetObject", before, unique_id="test-wire-before")
        client.meta.events.register("after-call.s3.GetObject", after, unique_id="test-wire-after")
        return client


class _Body:
    def __init__(self, body: Any, wire: S3Wire, key: str, cut: int | None):
        self.body, self.wire, self.key, self.left = body, wire, key, cut

    def iter_chunks(self, size: int):
        for chunk in self.body.iter_chunks(size):
            if self.left is not None:
                chunk = chunk[:self.left]
                self.left -= len(chunk)
            self.wire.served[self.key] += len(chunk)
            yield chunk
            if self.left == 0:
                raise botocore.exceptions.ResponseStreamingError(error="connection reset by peer")

    def close(self) -> None:
        self.body.close()


WIRE = S3Wire()


@pytest.fixture
def s3_wire(monkeypatch) -> S3Wire:
    WIRE.served.clear()
    WIRE.cuts.clear()
    real = fetch_mod.s3_client
    monkeypatch.setattr(fetch_mod, "s3_client", lambda retries: WIRE.watch(real(retries)))
    return WIRE


@pytest.fixture
def source(request, hub, s3_wire):
    """(make a model, bytes sent for one of its files, plant a drop in a file) for the parametrized kind."""
    if request.param == "hub":
        def make(files: dict[str, bytes]) -> Manifest:
            return hub_model(hub, files)

        def served(m: Manifest, path: str) -> int:
            return hub.served_bytes[(m.source.location, path)]

        def drop(m: Manifest, path: str, after: int) -> None:
            hub.fail_once(m.source.location, path, after)
    else:
        make = s3_model

        def served(m: Manifest, path: str) -> int:
            return s3_wire.served[path]

        def drop(m: Manifest, path: str, after: int) -> None:
            s3_wire.cuts[path] = after
    return make, served, drop


both = pytest.mark.parametrize("source", ["hub", "s3"], indirect=True)


def shard(m: Manifest) -> RemoteFile:
    return next(f for f in m.files if f.path.endswith(".safetensors"))


def content(files: dict[str, bytes], folder: Path) -> dict[str, bytes]:
    return {p: (folder / p).read_bytes() for p in files}


# -- layout ----------------------------------------------------------------------------------------


def test_hub_model_lands_in_the_hf_cache_layout_with_files_in_parallel(hub, cache, monkeypatch):
    files = model_files("layout", shards=3)
    m = hub_model(hub, files)
    in_flight, peak, lock = [0], [0], threading.Lock()
    real_get = fetch_mod.http_get

    def slow_get(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.1)
        try:
            return real_get(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(fetch_mod, "http_get", slow_get)
    folder = fetch(m, cache, workers=4)

    repo = cache.root / "hub" / f"models--{m.source.location.replace('/', '--')}"
    assert folder == repo / "snapshots" / m.revision
    assert content(files, folder) == files
    for f in m.files:  # snapshot links into blobs named by the Hub's ETag: the library reads it as its own
        assert (folder / f.path).is_symlink()
        assert Path(os.path.realpath(folder / f.path)) == repo / "blobs" / (f.sha256 or f.etag)
        assert try_to_load_from_cache(m.source.location, f.path, cache_dir=cache.root / "hub",
                                      revision=m.revision) == str(folder / f.path)
    assert peak[0] >= 3, "the files were fetched one after the other"
    assert not list((repo / "blobs").glob("*.incomplete"))
    assert cache.is_complete(m)
    # offline mode was lifted for the fetch's own threads only: this thread is still offline
    assert hf_constants.is_offline_mode()
    with pytest.raises(Exception, match="offline|local_files_only|cannot find"):
        hf_hub_download(m.source.location, "config.json", revision=m.revision, cache_dir=cache.root / "other")


def test_s3_model_lands_in_its_revision_folder_checked_by_etag(s3_wire, cache):
    files = model_files("s3-layout") | {"big.safetensors": fake_safetensors("multi", 300 * KiB)}
    m = s3_model(files, multipart=("big.safetensors",))
    assert next(f for f in m.files if f.path == "big.safetensors").etag.endswith("-1")

    folder = fetch(m, cache)

    assert folder == cache.root / "s3" / m.source.location.replace("/", "--") / m.revision
    assert content(files, folder) == files
    assert not list(folder.rglob("*.incomplete"))
    record = cache.record(m.key)
    assert record.verified["big.safetensors"].sha256 == hashlib.sha256(files["big.safetensors"]).hexdigest()


def test_local_folder_is_loaded_in_place_or_named_missing(tmp_path):
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    fetcher = WeightFetcher(tmp_path / "cache", NODE)
    here = Manifest(source=WeightSource(kind=SourceKind.LOCAL, location=str(folder)), revision="local")
    gone = Manifest(source=WeightSource(kind=SourceKind.LOCAL, location=str(tmp_path / "nowhere")), revision="local")

    ready = fetcher.ensure(here)
    failed = fetcher.ensure(gone)

    assert (ready.state, ready.path) == (FetchState.READY, str(folder))
    assert failed.state is FetchState.FAILED
    assert str(tmp_path / "nowhere") in failed.error and NODE in failed.error
    assert fetcher.entries() == [] and not list((tmp_path / "cache").glob("hub")) and not list((tmp_path / "cache").glob("s3"))


# -- once, and only once -------------------------------------------------------------------------


@both
def test_a_cached_manifest_downloads_nothing_again(source, tmp_path):
    make, served, _ = source
    files = model_files("twice")
    m = make(files)
    fetch(m, NodeCache(tmp_path, NODE))
    sent = {f.path: served(m, f.path) for f in m.files}
    assert sent == {f.path: f.size for f in m.files}

    fetcher = WeightFetcher(tmp_path, NODE)  # as after a restart of the node's actor
    progress = fetcher.ensure(m)

    assert progress.state is FetchState.READY and progress.bytes_done == m.total_bytes
    assert content(files, Path(progress.path)) == files
    assert fetch(m, NodeCache(tmp_path, NODE)) == Path(progress.path)
    assert {f.path: served(m, f.path) for f in m.files} == sent


def test_concurrent_ensures_share_one_fetch(hub, tmp_path, monkeypatch):
    files = model_files("shared", shards=2)
    m = hub_model(hub, files)
    fetcher = WeightFetcher(tmp_path, NODE)
    runs, real_fetch = [], fetcher_mod.fetch

    def counted(*args, **kwargs):
        runs.append(threading.current_thread().name)
        time.sleep(0.2)  # still running while the others ask
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(fetcher_mod, "fetch", counted)
    answers, start = [], threading.Barrier(6)

    def ask():
        start.wait()
        answers.append(fetcher.ensure(m, {"other/key"}))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = fetcher.wait(m.key, 10)

    assert len(runs) == 1
    assert {a.state for a in answers} == {FetchState.FETCHING}
    assert done.state is FetchState.READY and done.files_done == done.files_total == len(files)
    assert all(hub.served_bytes[(m.source.location, f.path)] == f.size for f in m.files)
    assert fetcher.ensure(m).state is FetchState.READY and len(runs) == 1


# -- broken networks, killed processes -----------------------------------------------------------


@both
def test_a_dropped_connection_resumes_mid_file(source, cache):
    make, served, drop = source
    files = model_files("drop", shards=1, shard_bytes=1 * MiB)
    m = make(files)
    drop(m, shard(m).path, 300 * KiB)

    folder = fetch(m, cache, backoff_s=0.01)

    assert content(files, folder) == files
    # the rest, from the last byte written (a chunk that was still in a buffer comes again): not the file twice
    assert shard(m).size <= served(m, shard(m).path) < shard(m).size + 64 * KiB


@both
def test_a_killed_fetch_resumes_from_what_is_on_disk(source, tmp_path):
    make, served, _ = source
    files = model_files("kill", shards=1, shard_bytes=2 * MiB)
    m = make(files)
    big = shard(m)

    def die_midway(progress):
        if progress.bytes_done > 600 * KiB:
            raise _Killed

    with pytest.raises(_Killed):
        fetch(m, NodeCache(tmp_path, NODE), workers=1, on_progress=die_midway)
    cache = NodeCache(tmp_path, NODE)  # a new process
    partial = cache.partial_path(m, big)
    kept = partial.stat().st_size
    assert 0 < kept < big.size and not cache.is_complete(m)
    sent_before = served(m, big.path)

    folder = fetch(m, cache)

    assert content(files, folder) == files
    assert served(m, big.path) - sent_before == big.size - kept  # only what was missing
    assert not partial.exists()


def test_retries_then_fails_removing_only_its_partial_files(hub, tmp_path):
    fetcher = WeightFetcher(tmp_path, NODE, workers=2, attempts=3, backoff_s=0.01)
    other = hub_model(hub, model_files("other", shards=1))
    assert fetcher.wait(fetcher.ensure(other).key, 10).state is FetchState.READY
    m = hub_model(hub, model_files("outage", shards=1, shard_bytes=1 * MiB))
    hub.fail_once(m.source.location, shard(m).path, 200 * KiB)
    partial = fetcher.cache.partial_path(m, shard(m))
    real_set = fetch_mod._Progress.set

    def hub_goes_down(self, path, n_bytes, *, fetched):  # once the shard has bytes on disk
        real_set(self, path, n_bytes, fetched=fetched)
        if path == shard(m).path and n_bytes > 0:
            hub.outage(503)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fetch_mod._Progress, "set", hub_goes_down)
            fetcher.ensure(m)
            failed = fetcher.wait(m.key, 20)
    finally:
        hub.outage(None)

    assert failed.state is FetchState.FAILED and failed.attempts == 3
    assert "failed 3 times on node-a" in failed.error and "503" in failed.error
    assert not partial.exists()
    assert fetcher.cache.is_complete(other)  # another entry's files stay
    assert fetcher.ensure(m).state is FetchState.FAILED  # the caller hears of the failure once...
    assert fetcher.ensure(m).state is FetchState.FETCHING  # ...and the next call tries again
    assert fetcher.wait(m.key, 10).state is FetchState.READY


def test_s3_unreachable_fails_after_its_tries_and_drops_a_partial(monkeypatch, cache, s3_wire):
    m = s3_model(model_files("unreachable", shards=1))
    partial = cache.partial_path(m, shard(m))
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"x" * 1000)  # what a killed fetch left
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    tries = []

    with pytest.raises(SourceError) as failure:
        fetch(m, cache, attempts=3, backoff_s=0.01, on_progress=lambda p: tries.append(p.attempts))

    assert failure.value.status_code == 502 and "failed 3 times on node-a" in failure.value.message
    assert max(tries) == 3
    assert not partial.exists()


# -- corruption ----------------------------------------------------------------------------------


@both
def test_a_corrupt_cached_file_is_found_by_its_checksum_and_fetched_again(source, tmp_path):
    make, served, _ = source
    files = model_files("rot", shards=2)
    m = make(files)
    fetcher = WeightFetcher(tmp_path, NODE)
    folder = Path(fetcher.wait(fetcher.ensure(m).key, 10).path)
    bad, touched = [f for f in m.files if f.path.endswith(".safetensors")]
    (folder / bad.path).write_bytes(b"\0" * bad.size)  # same size, other bytes (through the Hub's link)
    os.utime(folder / touched.path)  # a new mtime, the same bytes
    sent = {f.path: served(m, f.path) for f in m.files}

    assert fetcher.ensure(m).state is FetchState.FETCHING  # never READY with a file it cannot vouch for
    again = fetcher.wait(m.key, 10)

    assert again.state is FetchState.READY
    assert content(files, folder) == files
    assert served(m, bad.path) - sent[bad.path] == bad.size
    assert served(m, touched.path) == sent[touched.path]  # hashed again, found right, not fetched


def test_corrupt_bytes_from_the_source_never_take_the_files_name(hub, cache):
    m = hub_model(hub, model_files("liar", shards=1))
    hub.corrupt(m.source.location, shard(m).path)
    try:
        with pytest.raises(SourceError) as failure:
            fetch(m, cache, attempts=2, backoff_s=0.01)
    finally:
        hub.corrupt(m.source.location, shard(m).path, on=False)

    assert "sha256" in failure.value.message and "failed 2 times" in failure.value.message
    assert not cache.file_path(m, shard(m)).exists()
    assert not cache.hub_blob(m, shard(m).sha256).exists()
    assert not cache.partial_path(m, shard(m)).exists()


def test_an_s3_object_changed_since_listing_is_refused(cache):
    files = model_files("moved", shards=1)
    m = s3_model(files)
    bucket, prefix = m.source.location.split("/", 1)
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{shard(m).path}", Body=b"new weights")

    with pytest.raises(SourceError) as failure:
        fetch(m, cache, backoff_s=0.01)

    assert failure.value.status_code == 409 and "changed since it was listed" in failure.value.message


# -- disk ----------------------------------------------------------------------------------------


def fake_disk(monkeypatch, capacity: int) -> None:
    """A disk of ``capacity`` bytes holding what is under the cache (blobs once: links are not files)."""
    def disk_usage(path):
        used = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())
        return shutil._ntuple_diskusage(capacity, used, capacity - used)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_lru_eviction_spares_entries_in_use_and_says_what_is_missing(monkeypatch, tmp_path, s3_wire):
    cache = NodeCache(tmp_path, NODE)
    a, b, c, d = (s3_model(model_files(tag, shards=1, shard_bytes=400 * KiB)) for tag in "abcd")
    fake_disk(monkeypatch, capacity=a.total_bytes * 2 + 100 * KiB)
    fetch(a, cache)
    fetch(b, cache)
    cache.touch(b.key)
    time.sleep(0.01)
    cache.touch(a.key)  # b is now the least recently used, a the most

    fetch(c, cache, in_use={b.key})  # b is in use: a goes, though it was used later

    assert {e.key for e in cache.entries() if e.complete} == {b.key, c.key}
    assert not cache.folder(a).exists() and cache.is_complete(b) and cache.is_complete(c)
    with pytest.raises(SourceError) as short:
        fetch(d, cache, in_use={b.key, c.key})
    assert short.value.status_code == 507
    assert "more on node-a:" in short.value.message and "free," in short.value.message
    assert "to fetch" in short.value.message
    assert cache.is_complete(b) and cache.is_complete(c)  # nothing evicted for a fetch that could not fit
    assert {e.key: e.in_use for e in cache.entries({b.key})} == {b.key: True, c.key: False}  # d got no file


def test_insufficient_disk_message_in_gib(monkeypatch, cache, s3_wire):
    m = s3_model(model_files("huge", shards=1, shard_bytes=4 * KiB))
    m = m.model_copy(update={"files": [f.model_copy(update={"size": 52 * 2**30 + 300 * MiB}) if f is shard(m) else f
                                       for f in m.files]})
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 * 2**30, 60 * 2**30, 40 * 2**30))

    with pytest.raises(SourceError, match=r"needs 12\.3 GiB more on node-a: 40\.0 GiB free, 52\.3 GiB to fetch"):
        fetch(m, cache)


def test_removing_a_revision_keeps_blobs_another_revision_links(hub, cache):
    repo = f"org/m-{uuid.uuid4().hex[:8]}"
    v1_files = model_files("v1", shards=2)
    v2_files = {**v1_files, "model-00002-of-00002.safetensors": fake_safetensors("v2-changed", 512 * KiB)}
    v1, v2 = hub_model(hub, v1_files, repo), hub_model(hub, v2_files, repo)
    fetch(v1, cache)
    fetch(v2, cache)
    shared = cache.hub_blob(v1, v1.files[1].sha256)
    only_v1 = cache.hub_blob(v1, v1.files[2].sha256)
    assert cache.disk().cached_bytes == v1.total_bytes + v2.files[2].size  # shared blobs counted once

    with pytest.raises(SourceError, match="in use by chat-model"):
        cache.remove(v1.key, {v1.key: ["chat-model"]})
    assert cache.remove(v1.key)

    assert cache.is_complete(v2) and content(v2_files, cache.folder(v2)) == v2_files
    assert shared.exists() and not only_v1.exists()
    assert not cache.folder(v1).exists() and cache.record(v1.key) is None
    assert [e.key for e in cache.entries()] == [v2.key]
    assert cache.remove(v1.key) is False


# -- secrets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hub", "s3"])
def test_secrets_never_reach_errors_or_logs(kind, hub, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    if kind == "hub":
        m = hub_model(hub, model_files("secret", shards=1))

        def leaky(*args, **kwargs):
            raise httpx2.ConnectError(f"https://user:{HF_SECRET}@hub/ refused (Authorization: Bearer {HF_SECRET})")

        monkeypatch.setattr(fetch_mod, "get_hf_file_metadata", leaky)
    else:
        m = s3_model(model_files("secret", shards=1))
        real = fetch_mod.s3_client

        class Leaky:  # the fetch's own client (shared, kept) behind it, untouched
            def __init__(self, retries: bool):
                self.retries = retries

            def __getattr__(self, name: str) -> Any:
                return getattr(real(self.retries), name)

            def head_object(self, **kwargs: Any) -> None:
                raise botocore.exceptions.ClientError(
                    {"Error": {"Code": "SlowDown", "Message": f"signed with {AWS_SECRET}"},
                     "ResponseMetadata": {"HTTPStatusCode": 503}}, "HeadObject")

        monkeypatch.setattr(fetch_mod, "s3_client", Leaky)
    fetcher = WeightFetcher(tmp_path, NODE, attempts=2, backoff_s=0.01)

    with caplog.at_level(logging.DEBUG):
        fetcher.ensure(m)
        failed = fetcher.wait(m.key, 10)
        with pytest.raises(SourceError) as raised:
            fetch(m, NodeCache(tmp_path, NODE), attempts=1)

    assert failed.state is FetchState.FAILED and "***" in failed.error
    for text in (failed.error, raised.value.message, str(raised.value), caplog.text):
        assert HF_SECRET not in text and AWS_SECRET not in text


def test_a_key_no_file_can_be_named_after_is_no_entry(tmp_path):
    """The admin's DELETE /weights?key=... passes the key to each node's cache: one longer than a file
    name may be (ENAMETOOLONG) answered 500 in the API fuzzer; it is simply not cached."""
    cache = NodeCache(tmp_path, NODE)
    assert cache.record("x" * 4000) is None
    assert cache.remove("x" * 4000) is False
