#!/usr/bin/env bash
# Install Ray Hive with its test extras and run every test tier, one tier at a time
# (the cluster, chaos and engine tiers each start their own local Ray cluster; chaos runs
# behind Serve's HAProxy ingress).
#   tests/run.sh            # lint, unit, cluster, chaos, engine
#   tests/run.sh unit       # one tier
# lint: ruff (lint and import order) and mypy, configured in pyproject.toml; the pre-commit hooks
# (.pre-commit-config.yaml) run the same two commands.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh dev
. .venv/bin/activate
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/ray-hive-tests}"
mkdir -p "$RAY_TMPDIR"
tiers=("${@:-lint unit cluster chaos engine}")
lint() {
  local rc=0
  ruff check hive_apps tests benchmarks examples manifests || rc=1
  mypy hive_apps || rc=1
  return $rc
}
status=0
for tier in ${tiers[@]}; do
  echo "=== tier: $tier ==="
  start=$(date +%s)
  if [ "$tier" = lint ]; then
    lint || status=1
  else
    python -m pytest "tests/$tier" -q -p no:cacheprovider --durations=5 || status=1
  fi
  echo "=== tier $tier took $(( $(date +%s) - start ))s ==="
done
exit $status
