"""A LoRA adapter checked against its base before it is served (``core/planning/lora.py``,
``core/planning/adapter_source.py``): each way it can be wrong is a 4xx that names the problem. The
adapters are ``build_tiny_lora``'s, read from a folder, the (fake) Hub and (moto's) S3."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

from hive_apps.core.planning.adapter_source import adapter_or_error, read_adapter
from hive_apps.core.planning.lora import AdapterError
from hive_apps.core.spec import AdapterSpec, ModelSpec
from hive_apps.core.weights.header import read_header
from hive_apps.core.weights.listing import list_source
from hive_apps.core.weights.source import parse_source
from hive_apps.core.weights.types import SourceError
from hive_apps.models.tiny import build_tiny_lora
from tests.unit.planning_fixtures import fixture_path

TINY = fixture_path("tiny-qwen2")  # hidden 128, 2 layers: the tiny chat model's shape
QWEN3 = fixture_path("Qwen__Qwen3-0.6B")


def base(model: str = TINY, **lora) -> ModelSpec:
    return ModelSpec(model_id="base", model=model, engine="sim", lora={"max_lora_rank": 8, **lora})


def adapter(source: str | Path) -> AdapterSpec:
    return AdapterSpec(model_id="a1", base="base", source=str(source))


def check(source: str | Path, spec: ModelSpec | None = None):
    return read_adapter(adapter(source), spec or base(), None, metadata=None)


def refused(source: str | Path, spec: ModelSpec | None = None) -> AdapterError:
    with pytest.raises(AdapterError) as caught:
        check(source, spec)
    return caught.value


@pytest.fixture
def good(tmp_path) -> Path:
    return build_tiny_lora(TINY, tmp_path / "good", rank=8, seed=1)


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_tiny_adapter_fits_the_tiny_base_and_its_manifest_is_its_two_files(good):
    info, manifest = check(good)
    assert (info.rank, info.alpha, info.target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    assert info.base_model_name == "hive-test/tiny-chat" and info.bytes == 2 * ((8 * 128 + 128 * 8) + (8 * 128 + 64 * 8)) * 2
    assert sorted(f.path for f in manifest.files) == ["adapter_config.json", "adapter_model.safetensors"]
    header = read_header(list_source(parse_source(str(good))), "adapter_model.safetensors")
    assert header["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (64, 8)


def test_a_rank_above_the_bases_max_lora_rank_is_refused(tmp_path):
    e = refused(build_tiny_lora(TINY, tmp_path / "r16", rank=16))
    assert e.status_code == 422 and "rank 16 is above the base's max_lora_rank=8" in e.message
    assert "max_lora_rank >= 16" in e.message


def test_target_modules_the_base_does_not_have_are_refused(good):
    e = refused(edit_config(good, target_modules=["q_proj", "c_attn"]))
    assert "target modules ['c_attn'] are not modules of the base (Qwen2ForCausalLM)" in e.message
    assert "q_proj" in e.message.split("it has")[1]
    e = refused(edit_config(good, target_modules=["lm_head"]))  # Qwen2 has no LoRA on its embeddings in vLLM
    assert "['lm_head'] are not modules of the base" in e.message
    e = refused(edit_config(good, target_modules=r".*\.wqkv"))
    assert "matches no module of the base" in e.message
    info, _ = check(edit_config(good, target_modules=r".*\.(q_proj|v_proj)"))  # PEFT's regex form
    assert info.target_modules == ["q_proj", "v_proj"]


def test_an_adapter_for_another_hidden_size_or_depth_is_refused(tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir()
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 256, "num_attention_heads": 8}))
    e = refused(build_tiny_lora(wide, tmp_path / "for-wide", rank=8))
    assert "hidden_size=128" in e.message and "made for another base" in e.message
    assert "lora_A.weight is [8, 256]" in e.message and "needs [8, 128]" in e.message
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    e = refused(build_tiny_lora(deep, tmp_path / "for-deep", rank=8))
    assert "the adapter has layer 2" in e.message and "the base has 2 layers" in e.message


def test_an_adapter_named_for_another_family_is_refused_even_with_fitting_shapes(good):
    e = refused(edit_config(good, base_model_name_or_path="meta-llama/Llama-3.1-8B"))
    assert "made for 'meta-llama/Llama-3.1-8B' (llama)" in e.message and "Qwen2ForCausalLM" in e.message
    assert check(edit_config(good, base_model_name_or_path="/data/my-renamed-base"))[0].rank == 8  # loosely
    assert check(edit_config(good, base_model_name_or_path="Qwen/Qwen2.5-0.5B"))[0].rank == 8


@pytest.mark.parametrize("content, words", [
    (b"{not json", "adapter_config.json is malformed: not JSON"),
    (b"[1, 2]", "adapter_config.json is malformed: not a JSON object"),
    (b'{"target_modules": ["q_proj"]}', "adapter_config.json is malformed: r: Field required"),
    (b'{"r": "eight", "target_modules": ["q_proj"]}', "adapter_config.json is malformed: r:"),
    (b'{"r": 8}', "target_modules: Field required"),
    (b'{"r": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}', "peft_type 'IA3' is not a LoRA adapter"),
    (b'{"r": 8, "target_modules": ["q_proj"], "use_dora": true}', "DoRA (use_dora)"),
    (b'{"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}', "modules_to_save"),
])
def test_a_malformed_or_unsupported_adapter_config_is_refused(good, content, words):
    (good / "adapter_config.json").write_bytes(content)
    e = refused(good)
    assert e.status_code == 422 and words in e.message, e.message


def test_a_folder_without_the_adapter_files_or_with_a_broken_header(tmp_path, good):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "lacks adapter_config.json, adapter_model.safetensors" in refused(empty).message
    (good / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    assert "is not a safetensors file" in refused(good).message
    save_file({"model.layers.0.mlp.weird": torch.zeros(2, 2)}, str(good / "adapter_model.safetensors"))
    assert "is not a LoRA weight" in refused(good).message


def test_a_base_without_lora_or_that_cannot_serve_lora(good):
    e = refused(good, ModelSpec(model_id="base", model=TINY, engine="sim"))
    assert e.field == "base" and "deployed without lora" in e.message and "recreate=true" in e.message
    answer = adapter_or_error(adapter(good), ModelSpec(model_id="base", model=TINY, engine="sim"), None, None)
    assert answer.info is None and answer.field == "base" and answer.status_code == 422
    bge = ModelSpec(model_id="base", model=fixture_path("BAAI__bge-m3"), engine="sim", max_output_prompt_length=0)
    bge.lora = base().lora  # as a record written before the spec refused it
    assert "pooling model" in refused(good, bge).message


def test_a_qwen3_adapter_fits_qwen3_and_not_the_tiny_base(tmp_path):
    qwen = build_tiny_lora(QWEN3, tmp_path / "q", rank=8, base_name="Qwen/Qwen3-0.6B")
    assert check(qwen, base(QWEN3))[0].target_modules == ["q_proj", "v_proj"]
    assert "made for another base" in refused(qwen).message


@pytest.fixture
def hub_adapter(fake_hub, tmp_path, monkeypatch):
    folder = build_tiny_lora(TINY, tmp_path / "hub", rank=8, seed=2)
    (folder / "README.md").write_text("# a tiny adapter")
    fake_hub.add_repo("hive-test/tiny-lora", folder)
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as engines and tests run: the hive goes online itself
    return fake_hub


def test_a_hub_adapter_is_checked_from_its_config_and_a_ranged_read_of_its_header(hub_adapter, tmp_path):
    info, manifest = read_adapter(AdapterSpec(model_id="a1", base="base", source="hive-test/tiny-lora"), base(), None,
                                  metadata=tmp_path / "meta")
    assert info.rank == 8 and manifest.revision != "local" and len(manifest.files) == 2  # README.md left out
    assert (tmp_path / "meta" / manifest.key / "adapter_config.json").is_file()
    assert not any(p.name.endswith(".safetensors") for p in (tmp_path / "meta").rglob("*"))  # never downloaded
    with pytest.raises(AdapterError) as caught:
        read_adapter(AdapterSpec(model_id="a1", base="base", source="hive-test/no-such"), base(), None,
                     metadata=tmp_path / "meta")
    assert caught.value.status_code == 404


def test_an_s3_adapter_header_is_read_by_range(moto_s3_url, monkeypatch, tmp_path):
    for name, value in {"AWS_ENDPOINT_URL": moto_s3_url, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    s3 = boto3.client("s3", endpoint_url=moto_s3_url, region_name="us-east-1", aws_access_key_id="k",
                      aws_secret_access_key="s")
    s3.create_bucket(Bucket="adapters")
    folder = build_tiny_lora(TINY, tmp_path / "s3", rank=8, seed=3)
    for f in folder.iterdir():
        s3.put_object(Bucket="adapters", Key=f"tiny/{f.name}", Body=f.read_bytes())
    info, manifest = read_adapter(AdapterSpec(model_id="a1", base="base", source="s3://adapters/tiny"), base(), None,
                                  metadata=tmp_path / "meta")
    assert info.target_modules == ["q_proj", "v_proj"] and manifest.revision.startswith("etags-")
    with pytest.raises(SourceError, match="not a safetensors file"):
        s3.put_object(Bucket="adapters", Key="bad/adapter_model.safetensors", Body=b"\x00" * 4)
        read_header(list_source(parse_source("s3://adapters/bad")), "adapter_model.safetensors")
