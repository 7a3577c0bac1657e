#!/usr/bin/env bash
# Install Ray Hive and run the main job: start a local hive, deploy a model over
# POST /admin/models, and answer a chat request through /v1 with the OpenAI SDK.
#   examples/quickstart.sh                                     # tiny offline model, CPU
#   examples/quickstart.sh --model Qwen/Qwen3-0.6B --gpu local:gpu0
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh
. .venv/bin/activate
exec python -m hive_apps.ops.quickstart "$@"
