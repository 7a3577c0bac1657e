"""Video: ask a model about a short clip through the hive's OpenAI API.

Deploys ``watcher`` (a video-capable vision-language model, Qwen2.5-VL-3B by default) and sends
``examples/media/clip.mp4`` (8 frames of a square crossing the screen, made by
make_media.py) as a ``video_url`` part with a data: URL, through ``/v1`` and
``/watcher/v1``; then tries a remote video URL, which the hive fetches only from the hosts the
operator lists in ``HIVE_MEDIA_HOSTS``. vLLM decodes the clip with OpenCV and samples frames;
``mm_processor_kwargs`` (e.g. ``fps``, ``max_pixels``) bound what one video costs.

A real video model needs a GPU (Qwen2.5-VL's image processor also needs torchvision). With
``--engine sim`` the request path runs (gateway, router, media checks) and the answer is the sim
engine's gibberish.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/video.py                                  # Qwen/Qwen2.5-VL-3B-Instruct, one GPU
    python examples/video.py --model /models/qwen2.5-vl-3b --engine sim
"""

from __future__ import annotations

from _hive import data_url, deployed, media_file, openai_client, parser, remote_media

QUESTION = {"type": "text", "text": "What moves in this video, and which way?"}


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(model="Qwen/Qwen2.5-VL-3B-Instruct")
    p.add_argument("--use", metavar="MODEL_ID", help="a deployed video model instead of deploying one")
    p.add_argument("--remote-url", default="https://example.com/clip.mp4")
    args = p.parse_args()
    model_id = args.use or "watcher"
    video = {"type": "video_url", "video_url": {"url": data_url(media_file("mp4"), "video/mp4")}}
    with deployed(args, model_id, max_input_prompt_length=8192,
                  vllm_kwargs={"limit_mm_per_prompt": {"image": 0, "video": 1},
                               "mm_processor_kwargs": {"max_pixels": 64 * 28 * 28}}) as st:
        if st is not None:
            print(f"watcher: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}")
        for client, route in ((openai_client(), "/v1"), (openai_client(model_id), f"/{model_id}/v1")):
            out = client.chat.completions.create(model=model_id, max_tokens=16,
                                                 messages=[{"role": "user", "content": [video, QUESTION]}])
            print(f"video via {route}: {out.usage.prompt_tokens} prompt tokens, {out.choices[0].message.content!r}")
        remote_media(model_id, {"type": "video_url", "video_url": {"url": args.remote_url}}, QUESTION["text"])


if __name__ == "__main__":
    main()
