#!/usr/bin/env bash
# Build SGLang's virtualenv from scratch (scripts/setup_sglang.sh) and run the tests against
# SGLang's own models, loaders and schemas (tests/sglang); prints pytest's summary.
# Called by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SGLANG_VENV:-.venv-sglang}"
bash scripts/setup_sglang.sh "$venv"
. "$venv/bin/activate"
pytest -q -p no:cacheprovider -W ignore::UserWarning tests/sglang
