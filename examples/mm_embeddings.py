"""Multimodal embeddings: an image and captions in one vector space, then which caption fits.

Deploys ``clip`` (a multimodal pooling model; vLLM runs ``CLIPModel``, ``SiglipModel`` and a
few vision-language embedders with ``runner="pooling"``, chosen from the architecture),
embeds candidate captions with ``client.embeddings.create`` and ``examples/media/shapes.png``
with vLLM's chat-style embeddings request (``messages`` with an ``image_url`` part, sent as
plain HTTP because the OpenAI SDK's ``embeddings.create`` has no such field), and prints the
captions by cosine similarity to the image.

CLIP runs on CPU as well as GPU. Any vision-language model vLLM can pool works too, e.g. a
deploy with ``vllm_kwargs={"runner": "pooling", "convert": "embed"}``: tests/engine runs this
script (``--use``) on the tiny random-weight Idefics3 deployed that way, whose ranks mean
nothing. The sim engine embeds text only (hash vectors) and refuses the ``messages`` form.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/mm_embeddings.py                           # openai/clip-vit-base-patch32
    python examples/mm_embeddings.py --model google/siglip-base-patch16-224
"""

from __future__ import annotations

import httpx
from _hive import API_KEY, URL, check, data_url, deployed, media_file, openai_client, parser

CAPTIONS = ["a red circle and a blue square", "a photo of a cat", "a page of printed text"]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(model="openai/clip-vit-base-patch32")
    p.add_argument("--use", metavar="MODEL_ID", help="a deployed multimodal embedding model instead of deploying one")
    args = p.parse_args()
    model_id = args.use or "clip"
    with deployed(args, model_id, max_input_prompt_length=77, max_output_prompt_length=0,
                  vllm_kwargs={"limit_mm_per_prompt": {"image": 1}}) as st:
        if st is not None:
            print(f"clip: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}")
        texts = [d.embedding for d in openai_client().embeddings.create(model=model_id, input=CAPTIONS).data]
        image = {"type": "image_url", "image_url": {"url": data_url(media_file("png"), "image/png")}}
        r = httpx.post(f"{URL}/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                       json={"model": model_id, "encoding_format": "float",
                             "messages": [{"role": "user", "content": [image]}]})
        vec = check(r)["data"][0]["embedding"]
        print(f"image: dim={len(vec)}, captions: dim={len(texts[0])}")
        for caption, score in sorted(((c, cosine(vec, t)) for c, t in zip(CAPTIONS, texts)), key=lambda x: -x[1]):
            print(f"  {score:+.3f}  {caption}")


if __name__ == "__main__":
    main()
