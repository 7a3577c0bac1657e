"""A deploy's ``model`` names a weight source; the planner lists it and fetches only its metadata.
The real huggingface_hub and boto3 clients talk to a fake Hub and to moto's S3 server on 127.0.0.1:
no test reaches the internet."""

import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import boto3
import httpx
import pytest
from huggingface_hub import HfApi, constants, file_download, hf_hub_download, snapshot_download
from huggingface_hub.errors import OfflineModeIsEnabled

from hive_apps.core.weights.listing import MAX_METADATA_BYTES, fetch_metadata, is_metadata, list_source
from hive_apps.core.weights.source import parse_source
from hive_apps.core.weights.types import Manifest, RemoteFile, SourceError, SourceKind, WeightSource, etag_revision
from tests.fixtures.fake_hub import FakeHub, fake_safetensors

TOKEN = "hf_fake_token_0123456789"
SECRET = "fake/secret+key/0123456789abcdef"
QWEN_CONFIG = (Path(__file__).parents[2] / "fixtures/model_configs/Qwen__Qwen3-0.6B/config.json").read_bytes()
METADATA = {
    "config.json": QWEN_CONFIG,
    "generation_config.json": b'{"do_sample": true}',
    "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
    "tokenizer.json": b'{"model": {"type": "BPE"}}',
    "hf_quant_config.json": b'{"quantization": {"quant_algo": "FP8"}}',
    "chat_template.jinja": b"{{ messages }}",
    "model.safetensors.index.json": b'{"metadata": {"total_size": 8192}, "weight_map": {}}',
}
WEIGHTS = {"model-00001-of-00002.safetensors": fake_safetensors("a"),
           "model-00002-of-00002.safetensors": fake_safetensors("b")}
OTHERS = {"README.md": b"# qwen", "pytorch_model.bin": b"\0" * 64, "original/params.json": b"{}"}


@pytest.fixture(scope="module")
def hub():
    with FakeHub(token=TOKEN) as hub:
        hub.v1 = hub.add_repo("Qwen/Qwen3-0.6B", {**METADATA, **WEIGHTS, **OTHERS})
        hub.add_tag("Qwen/Qwen3-0.6B", "v1.0", hub.v1)
        hub.dev = hub.add_repo("Qwen/Qwen3-0.6B", {**METADATA, **WEIGHTS}, branch="dev")
        hub.main = hub.add_repo("Qwen/Qwen3-0.6B", {**METADATA, "config.json": b'{"v": 2}', **WEIGHTS})
        hub.add_repo("tiny", {"config.json": b"{}", "model.safetensors": fake_safetensors("tiny")})
        hub.add_repo("org/private", {"config.json": b"{}", "model.safetensors": fake_safetensors("p")}, private=True)
        hub.add_repo("org/gated", {"config.json": b"{}", "model.safetensors": fake_safetensors("g")}, gated=True)
        hub.add_repo("org/pickles", {"config.json": b"{}", "pytorch_model.bin": b"\0" * 64})
        yield hub


@pytest.fixture
def online(hub, monkeypatch):
    """The Hub client pointed at the fake Hub. Online, for the tests that call huggingface_hub
    directly, although the test run exports HF_HUB_OFFLINE=1 (it is read once, at import)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return hub


@pytest.fixture(scope="module")
def s3_url(moto_s3_url):
    url = moto_s3_url
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                      aws_access_key_id="setup", aws_secret_access_key="setup")
    s3.create_bucket(Bucket="weights")
    for path, data in {"config.json": QWEN_CONFIG, "tokenizer.json": b"{}", "model.safetensors": fake_safetensors("s3"),
                       "sub/extra.txt": b"x"}.items():
        s3.put_object(Bucket="weights", Key=f"qwen3/{path}", Body=data)
    s3.put_object(Bucket="weights", Key="qwen3/", Body=b"")  # a console folder marker
    s3.put_object(Bucket="weights", Key="pickles/pytorch_model.bin", Body=b"\0" * 64)
    s3.put_object(Bucket="weights", Key="qwen3-other/model.safetensors", Body=b"not under qwen3/")
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    return types.SimpleNamespace(url=url, client=s3, key_id=key["AccessKeyId"], secret=key["SecretAccessKey"])


@pytest.fixture
def aws(s3_url, monkeypatch, tmp_path):
    """boto3's standard variables, pointed at moto; nothing from the developer's ~/.aws."""
    for name, value in {"AWS_ENDPOINT_URL": s3_url.url, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ACCESS_KEY_ID": "AKIAFAKE", "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return s3_url


def source_error(model: str) -> SourceError:
    with pytest.raises(SourceError) as caught:
        list_source(parse_source(model))
    return caught.value


# -- parse_source ------------------------------------------------------------------------------


@pytest.mark.parametrize("model, kind, location, revision", [
    ("Qwen/Qwen3-0.6B", SourceKind.HUB, "Qwen/Qwen3-0.6B", None),
    ("gpt2", SourceKind.HUB, "gpt2", None),
    ("Qwen/Qwen3-0.6B@v1.0", SourceKind.HUB, "Qwen/Qwen3-0.6B", "v1.0"),
    ("org/name@refs/pr/1", SourceKind.HUB, "org/name", "refs/pr/1"),
    ("org/my_model.v2@" + "a" * 40, SourceKind.HUB, "org/my_model.v2", "a" * 40),
    ("s3://weights/qwen3/", SourceKind.S3, "weights/qwen3", None),
    ("s3://weights/a/b", SourceKind.S3, "weights/a/b", None),
    ("s3://weights", SourceKind.S3, "weights", None),
    ("/models/qwen3/", SourceKind.LOCAL, "/models/qwen3", None),
    ("~/models/qwen3", SourceKind.LOCAL, os.path.expanduser("~/models/qwen3"), None),
    ("./models/qwen3", SourceKind.LOCAL, os.path.abspath("models/qwen3"), None),
])
def test_each_form_names_its_source(model, kind, location, revision):
    assert parse_source(model) == WeightSource(kind=kind, location=location, revision=revision)


@pytest.mark.parametrize("model, says", [
    ("gs://bucket/qwen3", "'gs://'"),
    ("https://huggingface.co/Qwen/Qwen3-0.6B", "'https://'"),
    ("s3://", "bucket"),
    ("s3:///qwen3", "bucket"),
    ("/models/../etc", "'..'"),
    ("./a/../../etc", "'..'"),
    ("Qwen/Qwen3/extra", "org/name"),
    ("models/../qwen", "org/name"),
    ("org--name", "no '--'"),
    ("-org/name", "org/name"),
    ("org/name@", "revision"),
    ("org/name@bad rev", "revision"),
    ("org/name@a..b", "revision"),
    ("", "empty"),
])
def test_anything_else_is_422_saying_how_to_write_a_source(model, says):
    with pytest.raises(SourceError) as caught:
        parse_source(model)
    assert caught.value.status_code == 422 and says in caught.value.message
    if "://" in model and not model.startswith("s3"):
        assert all(form in caught.value.message for form in ("org/name", "s3://bucket/prefix", "absolute path"))


# -- the Hub -----------------------------------------------------------------------------------


@pytest.mark.parametrize("revision, commit", [("", "main"), ("@main", "main"), ("@dev", "dev"), ("@v1.0", "v1"),
                                               ("@{sha}", "v1")])
def test_hub_listing_pins_the_commit_a_branch_tag_or_sha_resolves_to(online, revision, commit):
    sha = getattr(online, commit)
    manifest = list_source(parse_source("Qwen/Qwen3-0.6B" + revision.format(sha=sha)))
    assert manifest.revision == sha
    files = {f.path: f for f in manifest.files}
    assert manifest.weight_bytes == sum(len(w) for w in WEIGHTS.values())
    shard = files["model-00001-of-00002.safetensors"]
    assert shard.size == len(WEIGHTS[shard.path]) and len(shard.sha256) == 64 and shard.etag is None
    assert files["config.json"].sha256 is None and len(files["config.json"].etag) == 40
    assert ("README.md" in files) == (commit == "v1")


def test_hub_repo_without_an_org_and_a_private_repo_with_its_token(online, monkeypatch):
    assert list_source(parse_source("tiny")).key.startswith("hub/tiny/")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert [f.path for f in list_source(parse_source("org/private")).files] == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("model, token, status, says", [
    ("org/unknown", None, 404, "org/unknown was not found"),
    ("Qwen/Qwen3-0.6B@no-such-branch", None, 404, "no revision 'no-such-branch'"),
    ("org/private", None, 401, "HF_TOKEN is not set"),
    ("org/private", "hf_wrong_token_999", 401, "refused HF_TOKEN"),
    ("org/gated", None, 401, "gated"),
    ("org/gated", TOKEN, 403, "not been granted access"),
    ("org/pickles", None, 422, "has no safetensors weights; the hive loads safetensors only"),
])
def test_hub_failures_keep_their_status_and_never_show_the_token(online, monkeypatch, model, token, status, says):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    error = source_error(model)
    assert (error.status_code, says in error.message) == (status, True), error.message
    assert model.split("@")[0] in error.message and TOKEN not in error.message and "hf_wrong" not in error.message


def test_a_hub_that_is_down_or_unreachable_is_502(online, monkeypatch):
    online.outage(503)
    try:
        error = source_error("tiny")
    finally:
        online.outage(None)
    assert (error.status_code, "answered 503" in error.message) == (502, True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    error = source_error("tiny")
    assert (error.status_code, "could not be reached" in error.message) == (502, True)


def test_the_hive_asks_the_hub_while_engines_stay_offline(online, monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as tests/run.sh and the engines' env have it
    manifest = list_source(parse_source("tiny"))
    assert (fetch_metadata(manifest, tmp_path) / "config.json").read_bytes() == b"{}"
    with pytest.raises(OfflineModeIsEnabled):  # only the hive's own calls went online
        HfApi(endpoint=online.url, token=False).model_info("tiny")


# -- S3 ----------------------------------------------------------------------------------------


def test_s3_listing_is_relative_to_the_prefix_and_its_revision_is_the_etag_set(aws):
    manifest = list_source(parse_source("s3://weights/qwen3/"))
    files = {f.path: f for f in manifest.files}
    assert sorted(files) == ["config.json", "model.safetensors", "sub/extra.txt", "tokenizer.json"]
    assert files["config.json"].size == len(QWEN_CONFIG) and '"' not in files["config.json"].etag
    assert manifest.revision == etag_revision(manifest.files) == list_source(parse_source("s3://weights/qwen3")).revision
    assert manifest.key == f"s3/weights--qwen3/{manifest.revision}"


@pytest.mark.parametrize("model, status, says", [
    ("s3://no-such-bucket/qwen3", 404, "'no-such-bucket' does not exist"),
    ("s3://weights/nothing-here", 404, "holds no objects"),
    ("s3://weights/pickles", 422, "has no safetensors weights"),
])
def test_s3_unknown_bucket_empty_prefix_and_no_safetensors(aws, model, status, says):
    error = source_error(model)
    assert (error.status_code, says in error.message) == (status, True), error.message


@pytest.mark.parametrize("who", ["unknown key", "wrong secret", "no permission"])
def test_s3_refused_credentials_are_403_without_the_secret(aws, monkeypatch, who):
    import moto.settings

    key, secret = {"unknown key": ("AKIAUNKNOWN", SECRET), "wrong secret": (aws.key_id, SECRET),
                   "no permission": (aws.key_id, aws.secret)}[who]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks signatures from now on
    error = source_error("s3://weights/qwen3")
    assert error.status_code == 403 and "weights/qwen3" in error.message, error.message
    assert secret not in error.message and aws.secret not in error.message


def test_s3_without_credentials_is_401(aws, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    error = source_error("s3://weights/qwen3")
    assert (error.status_code, "no AWS credentials" in error.message) == (401, True)


# -- a local folder ----------------------------------------------------------------------------


def test_local_folder_lists_sizes_and_is_its_own_metadata(tmp_path):
    (tmp_path / "m" / ".cache").mkdir(parents=True)
    (tmp_path / "m" / ".cache" / "junk").write_bytes(b"x")
    (tmp_path / "m" / "config.json").write_bytes(QWEN_CONFIG)
    (tmp_path / "m" / "model.safetensors").write_bytes(WEIGHTS["model-00001-of-00002.safetensors"])
    manifest = list_source(parse_source(str(tmp_path / "m") + "/"))
    assert manifest.revision == "local" and manifest.key.startswith("local/")
    assert {f.path: f.size for f in manifest.files} == {"config.json": len(QWEN_CONFIG), "model.safetensors": 4176}
    assert fetch_metadata(manifest, tmp_path / "cache") == tmp_path / "m"
    assert not (tmp_path / "cache").exists()


def test_local_folder_missing_or_without_safetensors(tmp_path):
    error = source_error(str(tmp_path / "absent"))
    assert error.status_code == 422 and str(tmp_path / "absent") in error.message
    assert socket.gethostname() in error.message
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"\0")
    # the operator's own folder is whatever vLLM loads from it; only Hub and S3 sources need safetensors
    assert [f.path for f in list_source(parse_source(str(tmp_path / "bin"))).files] == ["pytorch_model.bin"]


# -- metadata ----------------------------------------------------------------------------------


def test_metadata_patterns_take_configs_tokenizers_and_templates_never_weights():
    assert all(is_metadata(name) for name in [*METADATA, "params.json", "preprocessor_config.json",
                                              "processor_config.json", "quantize_config.json", "tokenizer.model",
                                              "vocab.json", "merges.txt", "chat_template.json"])
    assert not any(is_metadata(name) for name in ["model.safetensors", "pytorch_model.bin", "x.pt", "m.gguf",
                                                  "README.md", "original/params.json", "chat_template.bin"])


def test_fetch_metadata_brings_only_metadata_and_never_a_weight(online, tmp_path):
    before = online.served_bytes.copy()
    manifest = list_source(parse_source("Qwen/Qwen3-0.6B@v1.0"))
    folder = fetch_metadata(manifest, tmp_path)
    assert folder == tmp_path / manifest.key
    assert sorted(p.name for p in folder.iterdir()) == sorted(METADATA)
    assert (folder / "config.json").read_bytes() == QWEN_CONFIG
    served = {path: n for (repo, path), n in (online.served_bytes - before).items() if repo == "Qwen/Qwen3-0.6B"}
    assert served == {path: len(data) for path, data in METADATA.items()}
    after = online.served_bytes.copy()
    assert fetch_metadata(manifest, tmp_path) == folder
    assert online.served_bytes == after  # present with the listed size: nothing is asked again
    assert [p.name for p in folder.parent.iterdir()] == [manifest.revision]  # no scratch left behind


def test_fetch_metadata_refuses_bytes_that_do_not_match_the_listing(online, tmp_path):
    manifest = list_source(parse_source("tiny"))
    online.corrupt("tiny", "config.json")
    try:
        with pytest.raises(SourceError) as caught:
            fetch_metadata(manifest, tmp_path)
    finally:
        online.corrupt("tiny", "config.json", on=False)
    assert caught.value.status_code == 502 and "config.json" in caught.value.message
    assert not (tmp_path / manifest.key / "config.json").exists()
    assert (fetch_metadata(manifest, tmp_path) / "config.json").read_bytes() == b"{}"


def test_fetch_metadata_failures_are_source_errors_and_leave_nothing_behind(online, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    manifest = list_source(parse_source("org/private"))
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(SourceError) as caught:
        fetch_metadata(manifest, tmp_path)
    assert (caught.value.status_code, "org/private" in caught.value.message) == (401, True)
    assert not list((tmp_path / manifest.key).iterdir()) and not list((tmp_path / manifest.key).parent.glob(".*"))


def test_fetch_metadata_refuses_an_oversized_metadata_file(tmp_path):
    source = WeightSource(kind=SourceKind.HUB, location="org/huge")
    files = [RemoteFile(path="tokenizer.json", size=MAX_METADATA_BYTES + 1, etag="0" * 40)]
    with pytest.raises(SourceError) as caught:
        fetch_metadata(Manifest(source=source, revision="0" * 40, files=files), tmp_path)
    assert caught.value.status_code == 422 and "tokenizer.json" in caught.value.message


def test_fetch_metadata_from_s3(aws, tmp_path):
    manifest = list_source(parse_source("s3://weights/qwen3"))
    folder = fetch_metadata(manifest, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json"]
    assert (folder / "config.json").read_bytes() == QWEN_CONFIG


# -- the fake Hub serves the real client -------------------------------------------------------


def test_fake_hub_serves_hf_hub_download_and_snapshot_download(online, tmp_path):
    api = HfApi(endpoint=online.url, token=False)
    assert api.repo_info("Qwen/Qwen3-0.6B", revision="v1.0").sha == online.v1
    tree = {f.path for f in api.list_repo_tree("Qwen/Qwen3-0.6B", revision=online.v1, recursive=True)}
    assert {"original", "original/params.json", "README.md"} <= tree
    for revision in ("v1.0", "dev", online.main):
        path = hf_hub_download("Qwen/Qwen3-0.6B", "config.json", revision=revision, cache_dir=tmp_path,
                               endpoint=online.url, token=False)
        assert Path(path).read_bytes() == (b'{"v": 2}' if revision == online.main else QWEN_CONFIG)
    folder = Path(snapshot_download("Qwen/Qwen3-0.6B", revision="dev", cache_dir=tmp_path, endpoint=online.url,
                                   token=False, max_workers=8))
    assert folder.name == online.dev and sorted(p.name for p in folder.iterdir()) == sorted({**METADATA, **WEIGHTS})
    assert (folder / "model-00002-of-00002.safetensors").read_bytes() == WEIGHTS["model-00002-of-00002.safetensors"]


def test_fake_hub_download_resumes_with_a_range_after_a_dropped_connection(online, tmp_path, monkeypatch):
    big = fake_safetensors("big", 12 * 2**20)  # past huggingface_hub's 10 MiB read chunk, so a resume has bytes
    online.add_repo("org/big", {"config.json": b"{}", "model.safetensors": big})
    online.fail_once("org/big", "model.safetensors", after_bytes=11 * 2**20)
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda _s: None))  # its 1 s retry pause
    path = hf_hub_download("org/big", "model.safetensors", cache_dir=tmp_path, endpoint=online.url, token=False)
    assert Path(path).read_bytes() == big
    sent = online.served_bytes[("org/big", "model.safetensors")]
    assert sent == 11 * 2**20 + len(big) - 10 * 2**20  # the second GET asked only for what was missing
    ranged = httpx.get(f"{online.url}/org/big/resolve/main/model.safetensors", headers={"Range": "bytes=10-19"})
    assert (ranged.status_code, ranged.content, ranged.headers["Content-Range"]) == (206, big[10:20],
                                                                                     f"bytes 10-19/{len(big)}")


def test_fake_hub_serves_the_hf_download_cli(online, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": online.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "home"),
           "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_TOKEN": TOKEN}
    env.pop("TRANSFORMERS_OFFLINE", None)
    hf = Path(sys.executable).parent / "hf"
    done = subprocess.run([str(hf), "download", "org/private", "--local-dir", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == fake_safetensors("p")
