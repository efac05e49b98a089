#!/usr/bin/env bash
# Build vLLM's virtualenv from scratch (scripts/setup_vllm.sh) and run the tests against a
# real vLLM server (tests/vllm); prints pytest's summary.  Called by .ci/run (SETUP=0 when it
# built the virtualenv already).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.venv-vllm}"
[ "${SETUP:-1}" = 0 ] || bash scripts/setup_vllm.sh "$venv"  # SETUP=0: the virtualenv is built
. "$venv/bin/activate"
pytest -q -p no:cacheprovider --durations=10 tests/vllm
