#!/usr/bin/env bash
# DeepSeek-V3 (multi-head latent attention): see `python examples/run.py list` for its GPU topology.
# Without CUDA this runs the tiny variant of the family on CPU.
#   examples/deepseek_v3.sh          # on this machine, mode p2p
#   examples/deepseek_v3.sh --mode broadcast --steps 10
#   examples/deepseek_v3.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run DeepSeek-V3 "$@"
