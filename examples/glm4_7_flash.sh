#!/usr/bin/env bash
# GLM-4.7-Flash (multi-head latent attention): see `python examples/run.py list` for its GPU topology.
# Without CUDA this runs the tiny variant of the family on CPU.
#   examples/glm4_7_flash.sh          # on this machine, mode p2p
#   examples/glm4_7_flash.sh --mode broadcast --steps 10
#   examples/glm4_7_flash.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run GLM-4.7-Flash "$@"
