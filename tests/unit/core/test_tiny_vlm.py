"""The tiny VLM's chat template (hive_apps/models/tiny_vlm.py) without building the model: image
parts become the ``<image>`` placeholder the Idefics3 processor expands, in order, whether vLLM
hands them over as ``image`` (its "openai" content format) or as the client's ``image_url``."""

import jinja2

from hive_apps.models.tiny_vlm import IMAGE_TOKEN, VLM_CHAT_TEMPLATE


def render(messages) -> str:
    return jinja2.Environment().from_string(VLM_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_image_parts_become_placeholders_in_order():
    out = render([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "text", "text": "?"}]}])
    assert out == f"<|im_start|>user\n{IMAGE_TOKEN}and{IMAGE_TOKEN}?<|im_end|>\n<|im_start|>assistant\n"


def test_text_only_and_string_content_have_no_placeholder():
    assert IMAGE_TOKEN not in render([{"role": "user", "content": "hi"}])
    assert IMAGE_TOKEN not in render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])

