"""Start a hive on this machine, deploy a model over the admin API, and chat with it.

    python -m hive_apps.ops.quickstart                      # tiny built-in model on the CPU
    python -m hive_apps.ops.quickstart --model Qwen/Qwen3-0.6B --gpu local:gpu0

It starts a local Ray head (unless one is running), deploys ``serve_configs/hive.yaml``
with ``serve deploy``, sends ``POST /admin/models?wait=true`` and asks the model one
question with the OpenAI SDK. The hive keeps running afterwards; ``STOP`` ends it (Ray 2.60's
``ray stop`` leaves Serve's HAProxy running, still listening on the HTTP port: measured after a
quickstart on this box, so the command stops it too).

``serve deploy`` replaces the cluster's whole declarative Serve config: applications an earlier
``serve deploy`` (or a RayService) started that the hive's config does not list are deleted. On a
cluster that runs such applications the quickstart stops before deploying and names them, unless
``--force`` is given. Applications added with ``serve.run`` (the hive's model apps among them) are
not part of the declarative config and stay.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hive_apps.core.settings import get_settings
from hive_apps.ops.serve_env import EDGE_PORT, HA_PROXY, ray_head_env

CONFIG = Path(__file__).resolve().parents[2] / "serve_configs" / "hive.yaml"
STOP = "ray stop && pkill -f 'haproxy -db -f /tmp/haproxy-serve/'"
DASHBOARD = "http://127.0.0.1:8265"  # where `serve deploy` sends the config unless RAY_DASHBOARD_ADDRESS says
NODE_NAME = "local"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=True)


def quickstart_tokens(cache_dir: Path) -> dict[str, str]:
    """Tokens for a hive this script starts, kept (in HIVE_MODEL_CACHE_DIR) so a second run talks to the same hive."""
    path = cache_dir / "quickstart-tokens.json"
    if path.exists():
        return json.loads(path.read_text())
    tokens = {"HIVE_ADMIN_TOKEN": secrets.token_urlsafe(16), "HIVE_API_KEYS": secrets.token_urlsafe(16)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tokens))
    path.chmod(0o600)
    return tokens


def ensure_ray_head(env: dict[str, str]) -> bool:
    """Start a local Ray head unless one runs; whether this call started it."""
    if sh("ray", "status", check=False).returncode == 0:
        print("Using the Ray cluster that is already running (its nodes keep their own HIVE_* and Serve settings).")
        return False
    head_env = ray_head_env(env)
    if head_env.get(HA_PROXY) == "1" and HA_PROXY not in env:
        print(f"haproxy found: Serve's HAProxy ingress takes port 8000 ({HA_PROXY}=0 to keep Serve's proxy)")
    print("Starting a local Ray head ...")
    subprocess.run(["ray", "start", "--head", "--dashboard-host", "127.0.0.1", "--labels", f"ray-hive/node={NODE_NAME}",
                    "--disable-usage-stats"], check=True, env=head_env)
    return True


def config_app_names(config: Path = CONFIG) -> set[str]:
    """The applications the hive's Serve config lists."""
    import yaml

    return {app["name"] for app in yaml.safe_load(config.read_text()).get("applications", [])}


def serve_applications(dashboard: str) -> dict[str, str]:
    """Each Serve application the cluster runs, and where it came from (Serve's ``source``:
    ``declarative`` for `serve deploy` / RayService configs, ``imperative`` for ``serve.run``)."""
    r = httpx.get(f"{dashboard.rstrip('/')}/api/serve/applications/", timeout=10)
    r.raise_for_status()
    return {name: str(app.get("source", "unknown")) for name, app in (r.json().get("applications") or {}).items()}


def deploy_refusal(dashboard: str, config: Path = CONFIG) -> str | None:
    """Why `serve deploy` of the hive's config must not run without --force: the cluster runs declarative
    applications the config does not list (the deploy would delete them), or they could not be listed."""
    try:
        apps = serve_applications(dashboard)
    except (httpx.HTTPError, ValueError) as e:
        return (f"could not list the cluster's Serve applications at {dashboard} ({e}), so whether `serve deploy` "
                "would delete any is unknown; set RAY_DASHBOARD_ADDRESS to the cluster's dashboard, or pass --force")
    others = sorted(name for name, source in apps.items() if source == "declarative" and name not in config_app_names(config))
    if not others:
        return None
    return (f"the cluster runs Serve applications from another `serve deploy` config: {', '.join(others)}. Deploying "
            f"{config.name} replaces the cluster's whole declarative config and would delete them. Add the hive's "
            f"applications (serve_configs/hive.yaml) to that config and deploy it instead, or pass --force to deploy "
            f"the hive's config anyway (deleting {', '.join(others)})")


def wait_for(url: str, headers: dict[str, str], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hub repo (org/name[@revision]), s3://bucket/prefix or a folder "
                                    "(default: the built-in tiny model)")
    ap.add_argument("--model-id", default=None)
    ap.add_argument("--gpu", nargs="*", help='device pins such as "local:gpu0" (default: automatic)')
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--force", action="store_true",
                    help="serve deploy the hive's config even where the cluster runs declarative Serve applications "
                         "it does not list (serve deploy deletes them)")
    args = ap.parse_args()

    cache_dir = get_settings().model_cache_dir
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.update({k: v for k, v in quickstart_tokens(cache_dir).items() if not env.get(k)})
    os.environ.update(env)
    admin_token, api_key = env["HIVE_ADMIN_TOKEN"], env["HIVE_API_KEYS"].split(",")[0]

    model = args.model
    vllm_kwargs: dict = {}
    if model is None:
        from hive_apps.models.tiny import build_tiny_model

        model = str(build_tiny_model(cache_dir / "tiny-chat"))
        vllm_kwargs = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
        print(f"Built the tiny offline model at {model}")
    model_id = args.model_id or ("tiny-chat" if args.model is None else
                                 Path(model.split("@")[0].rstrip("/")).name.lower().replace("_", "-").replace(".", "-"))

    if not ensure_ray_head(env) and not args.force:
        refusal = deploy_refusal(env.get("RAY_DASHBOARD_ADDRESS") or DASHBOARD)
        if refusal:
            print(f"Not deploying: {refusal}", file=sys.stderr)
            return 2
    print("Deploying serve_configs/hive.yaml ...")
    subprocess.run(["serve", "deploy", str(CONFIG)], check=True, env=env)
    admin = {"Authorization": f"Bearer {admin_token}"}
    wait_for(f"{args.url}/admin/healthz", admin, 300)

    spec = {"model_id": model_id, "model": model, "max_input_prompt_length": 1024, "max_output_prompt_length": 256,
            "vllm_kwargs": vllm_kwargs}
    if args.gpu:
        spec["gpu"] = args.gpu[0] if len(args.gpu) == 1 else args.gpu
        spec["replicas"] = 1 if len(args.gpu) == 1 else len(args.gpu)
    print(f"POST /admin/models {model_id} (waits until vLLM answers a first request) ...")
    t0 = time.time()
    r = httpx.post(f"{args.url}/admin/models", params={"wait": "true"}, json=spec, headers=admin, timeout=1800)
    if r.status_code == 409:
        print(f"{model_id} is already deployed; reusing it")
    elif r.status_code != 200:
        print(f"deploy failed: HTTP {r.status_code} {r.text}", file=sys.stderr)
        return 1
    else:
        rep = r.json()["replicas"]["r0"]
        print(f"ready in {time.time() - t0:.1f}s on {rep['devices']} with max_num_seqs={rep['settings']['max_num_seqs']}")

    import openai

    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=api_key)
    out = client.chat.completions.create(model=model_id, max_tokens=24,
                                         messages=[{"role": "user", "content": "Say hello to the hive."}])
    print(f"\nchat answer from {model_id}: {out.choices[0].message.content!r}")
    print(f"\nThe hive is running. Admin token: {admin_token}  API key: {api_key}")
    print(f"  curl -H 'Authorization: Bearer {admin_token}' {args.url}/admin/gpus")
    print(f"  OpenAI base_url={args.url}/v1   dashboard: http://127.0.0.1:8265   stop: {STOP}")
    edge = ray_head_env(dict(os.environ)).get(EDGE_PORT)
    if edge:
        try:  # the edge answers once a gateway replica started it, a moment after its own start
            wait_for(f"http://127.0.0.1:{edge}/v1/models", {"Authorization": f"Bearer {api_key}"}, 5)
            print(f"  fastest: base_url=http://127.0.0.1:{edge}/v1 (the edge: answers stream from the engines' own ports)")
        except TimeoutError:
            pass
    print("  Never expose Ray's own ports (6379, 8265, 10001, ...): they give full control of the cluster. "
          "On a shared network start Ray with RAY_AUTH_MODE=token (README: Trust model).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
