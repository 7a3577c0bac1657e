"""Shared bits of the examples: where the hive is, its two credentials, and a few admin calls.

Plain HTTP (httpx) and the OpenAI SDK only; nothing here imports Ray Hive's own code,
because users talk to a hive over HTTP. Environment:

- ``HIVE_URL``          the hive's HTTP address (default http://127.0.0.1:8000)
- ``HIVE_ADMIN_TOKEN``  bearer token for /admin (deploy, status, delete)
- ``HIVE_API_KEY``      one of the hive's HIVE_API_KEYS, for /v1 (the OpenAI API)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

URL = os.environ.get("HIVE_URL", "http://127.0.0.1:8000").rstrip("/")
ADMIN_TOKEN = os.environ.get("HIVE_ADMIN_TOKEN", "")
API_KEY = os.environ.get("HIVE_API_KEY", "")


def parser(doc: str | None, model: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if model:
        p.add_argument("--model", default="Qwen/Qwen3-0.6B",
                       help="a model folder on the hive's nodes, or a Hugging Face name in their cache")
        p.add_argument("--engine", choices=["sim", "vllm"], default="vllm",
                       help="vllm: a real engine; sim: the simulated engine (no GPU, gibberish answers)")
    return p


def admin() -> httpx.Client:
    if not ADMIN_TOKEN:
        sys.exit("set HIVE_ADMIN_TOKEN (the hive's admin bearer token)")
    return httpx.Client(base_url=f"{URL}/admin", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=900)


def openai_client(model_id: str | None = None, async_: bool = False):
    """An OpenAI SDK client for /v1 (picks the model by the request's `model`), or for
    /<model_id>/v1 (straight to that model's router)."""
    import openai

    if not API_KEY:
        sys.exit("set HIVE_API_KEY (one of the hive's HIVE_API_KEYS)")
    base = f"{URL}/{model_id}/v1" if model_id else f"{URL}/v1"
    return (openai.AsyncOpenAI if async_ else openai.OpenAI)(base_url=base, api_key=API_KEY, timeout=300)


def check(r: httpx.Response) -> dict:
    """Fail with the hive's own error message (it names the field and the fix)."""
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text
        sys.exit(f"{r.request.method} {r.request.url.path} -> {r.status_code}: {msg}")
    return r.json()


def spec(args: argparse.Namespace, model_id: str, **fields) -> dict:
    """A deploy body; short prompt limits keep the KV cache small enough for any card."""
    body = {"model_id": model_id, "model": args.model, "engine": args.engine,
            "max_input_prompt_length": 512, "max_output_prompt_length": 128, **fields}
    if args.engine == "sim":  # a quick simulated decode rate, so the example does not wait on it
        body["vllm_kwargs"] = {"sim_tokens_per_s": 500, **body.get("vllm_kwargs", {})}
    return body


def deploy(client: httpx.Client, body: dict) -> dict:
    """POST /admin/models?wait=true: answers once every replica served a first request."""
    return check(client.post("/models", params={"wait": "true"}, json=body))


def delete(client: httpx.Client, *model_ids: str) -> None:
    """DELETE each model (they drain side by side); one that is already gone is fine."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(model_ids))) as pool:
        for r in pool.map(lambda m: client.delete(f"/models/{m}"), model_ids):
            if r.status_code not in (200, 202, 404):
                check(r)


@contextlib.contextmanager
def deployed(args: argparse.Namespace, model_id: str, **fields) -> Iterator[dict | None]:
    """Deploy ``model_id`` for the example and delete it after; with ``--use``, use that deployed
    model as it is (yields None then, else the deploy's status)."""
    if args.use:
        yield None
        return
    hive = admin()
    status = deploy(hive, spec(args, model_id, **fields))
    try:
        yield status
    finally:
        delete(hive, model_id)


def deploy_and_ask(client: httpx.Client, body: dict, prompt: str = "Hi") -> None:
    """Deploy ``body``, print its status and its answer to one short chat, then delete it."""
    model_id = body["model_id"]
    try:
        st = deploy(client, body)
        print(f"deployed {model_id}: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}")
        r = openai_client().chat.completions.create(model=model_id, max_tokens=8,
                                                    messages=[{"role": "user", "content": prompt}])
        print(f"{model_id} says: {r.choices[0].message.content!r}")
    finally:
        delete(client, model_id)


def wait_for(client: httpx.Client, model_id: str, pred, timeout: float = 120.0, every: float = 0.25) -> dict:
    """Poll GET /admin/models/{id} until pred(status) holds."""
    deadline = time.time() + timeout
    while True:
        body = check(client.get(f"/models/{model_id}"))
        if pred(body):
            return body
        if time.time() > deadline:
            sys.exit(f"{model_id}: timed out; last status {body['status']}: {body.get('message')}")
        time.sleep(every)


def accelerators(client: httpx.Client) -> list[dict]:
    """Every GPU (real or simulated) the hive knows, most available memory first."""
    devs = [d for d in check(client.get("/gpus"))["devices"] if d["device"]["kind"] != "cpu"]
    return sorted(devs, key=lambda d: -d["available_bytes"])


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def media_file(kind: str) -> Path:
    """A fixture from examples/media/ (``png``, ``wav``, ``mp4``), made by make_media.py when missing."""
    from media.make_media import HERE, make_all

    name = {"png": "shapes.png", "wav": "tone.wav", "mp4": "clip.mp4"}[kind]
    if not (HERE / name).exists():
        make_all()
    if not (HERE / name).exists():
        sys.exit(f"examples/media/{name} could not be made (an mp4 needs opencv-python-headless)")
    return HERE / name


def data_url(path: Path, mime: str) -> str:
    """The file inline, as the OpenAI API takes media: no server-side fetch."""
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def try_chat(model_id: str, content: list[dict], max_tokens: int = 16) -> tuple[int, str, dict]:
    """One chat on /v1 over plain HTTP: ``(status, answer or error message, usage)``, so an example
    can show what the hive refuses as well as what it answers."""
    r = httpx.post(f"{URL}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                   json={"model": model_id, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": content}]})
    body = r.json()
    if r.status_code != 200:
        return r.status_code, body["error"]["message"], {}
    return 200, body["choices"][0]["message"]["content"], body["usage"]


def remote_media(model_id: str, part: dict, question: str) -> None:
    """A media part by URL: the hive fetches remote media only from HIVE_MEDIA_HOSTS (docs/openai_api.md)."""
    status, text, _ = try_chat(model_id, [part, {"type": "text", "text": question}])
    print(f"remote URL: {status} {text!r}")
