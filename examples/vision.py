"""Vision: chat about images through the hive's OpenAI API.

Deploys ``vision`` (a vision-language model; ``limit_mm_per_prompt`` caps the images in one
prompt), then asks about ``examples/media/shapes.png`` sent inline as a data: URL, through
``/v1`` and through ``/vision/v1``; asks a text-only question (a multimodal deploy takes those
too); sends two images; sends one image over the limit (the engine's 400, passed on as an
OpenAI error); and tries a remote image URL, which the hive fetches only from the hosts the
operator lists in ``HIVE_MEDIA_HOSTS``. Prints each answer with its prompt tokens: the image's
cost is the difference.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/vision.py                                     # SmolVLM-256M, needs a GPU
    python examples/vision.py --model Qwen/Qwen2.5-VL-3B-Instruct --images 4
    python examples/vision.py --use my-vlm --images 2             # a deployed model, its limit

On a CPU-only hive, tests/engine/test_multimodal.py runs it against the tiny random-weight
Idefics3 model (hive_apps/models/tiny_vlm.py): the answers are gibberish, the token counts are not.
"""

from __future__ import annotations

from _hive import data_url, deployed, media_file, openai_client, parser, remote_media, try_chat


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(model="HuggingFaceTB/SmolVLM-256M-Instruct")
    p.add_argument("--use", metavar="MODEL_ID", help="a deployed vision model instead of deploying one")
    p.add_argument("--images", type=int, default=2, help="limit_mm_per_prompt for images (the deployed one with --use)")
    p.add_argument("--remote-url", default="https://example.com/cat.png")
    args = p.parse_args()
    model_id = args.use or "vision"
    image = {"type": "image_url", "image_url": {"url": data_url(media_file("png"), "image/png")}}
    question = {"type": "text", "text": "What shapes and colours are in this picture?"}
    with deployed(args, model_id, max_input_prompt_length=4096,
                  vllm_kwargs={"limit_mm_per_prompt": {"image": args.images}}) as st:
        if st is not None:
            print(f"vision: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}")
        text = openai_client().chat.completions.create(model=model_id, max_tokens=16, messages=[
            {"role": "user", "content": [question]}])
        print(f"text only: {text.usage.prompt_tokens} prompt tokens, {text.choices[0].message.content!r}")
        for client, route in ((openai_client(), "/v1"), (openai_client(model_id), f"/{model_id}/v1")):
            out = client.chat.completions.create(model=model_id, max_tokens=16, messages=[
                {"role": "user", "content": [image, question]}])
            print(f"one image via {route}: {out.usage.prompt_tokens} prompt tokens "
                  f"(+{out.usage.prompt_tokens - text.usage.prompt_tokens} for the image), "
                  f"{out.choices[0].message.content!r}")
        status, answer, usage = try_chat(model_id, [image] * args.images + [question])
        print(f"{args.images} images: {status}, {usage.get('prompt_tokens')} prompt tokens")
        status, answer, _ = try_chat(model_id, [image] * (args.images + 1) + [question])
        print(f"{args.images + 1} images (over limit_mm_per_prompt): {status} {answer!r}")
        remote_media(model_id, {"type": "image_url", "image_url": {"url": args.remote_url}}, question["text"])


if __name__ == "__main__":
    main()
