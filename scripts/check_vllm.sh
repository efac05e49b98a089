#!/usr/bin/env bash
# Build vLLM's virtualenv from scratch (scripts/setup_vllm.sh) and run the tests against a
# real vLLM server (tests/vllm); prints pytest's summary.  Called by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.venv-vllm}"
bash scripts/setup_vllm.sh "$venv"
. "$venv/bin/activate"
pytest -q -p no:cacheprovider tests/vllm
