#!/usr/bin/env bash
# Kimi-K2 (multi-head latent attention): see `python examples/run.py list` for its GPU topology.
# Without CUDA this runs the tiny variant of the family on CPU.
#   examples/kimi_k2.sh          # on this machine, mode p2p
#   examples/kimi_k2.sh --mode broadcast --steps 10
#   examples/kimi_k2.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run Kimi-K2 "$@"
