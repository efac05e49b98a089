#!/usr/bin/env bash
# Build SGLang's virtualenv from scratch (scripts/setup_sglang.sh) and run the tests against
# SGLang's own models, loaders and schemas (tests/sglang); prints pytest's summary.
# Called by .ci/run (SETUP=0 when it built the virtualenv already).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SGLANG_VENV:-.venv-sglang}"
[ "${SETUP:-1}" = 0 ] || bash scripts/setup_sglang.sh "$venv"  # SETUP=0: the virtualenv is built
. "$venv/bin/activate"
pytest -q -p no:cacheprovider -W ignore::UserWarning --durations=10 tests/sglang
