#!/usr/bin/env bash
# Build a virtualenv with SGLang's Python package and shardsync from scratch.
# SGLang's server needs a GPU build; on CPU its model classes, weight loaders and request
# schemas import and run, which is what tests/sglang checks against.  sglang 0.5.23 pins
# torch 2.14.1 and ~60 packages (CUDA kernels among them): it goes in with --no-deps, then
# exactly what its model, loader and io_struct modules import.
# Usage: bash scripts/setup_sglang.sh [VENV]   (default .venv-sglang)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-sglang}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q --upgrade pip
pip install -q torch==2.14.1 transformers==5.19.0
pip install -q --no-deps sglang==0.5.23
pip install -q orjson pybase64 starlette msgspec pyzmq ipython aiohttp apache-tvm-ffi torchvision dill \
    sentencepiece compressed-tensors gguf einops openai partial-json-parser psutil requests pillow
pip install -q -e . pytest
python - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import torch, sglang
import sglang.srt.models.qwen3, sglang.srt.models.qwen2, sglang.srt.models.llama  # noqa: F401
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater  # noqa: F401
import shardsync.engines.sglang  # noqa: F401
print(f"sglang {sglang.__version__} on torch {torch.__version__}: ok")
PY
