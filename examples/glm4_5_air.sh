#!/usr/bin/env bash
# GLM-4.5-Air (GLM4-MoE): four nodes of 8 GPUs: trainer TP4 PP2 DP2 EP8 ETP1 -> two engines TP8 EP8.
# Without CUDA this runs the tiny variant of the family on CPU (see: python examples/run.py list).
#   examples/glm4_5_air.sh          # on this machine, mode p2p
#   examples/glm4_5_air.sh --mode broadcast --steps 10
#   SHARDSYNC_BUCKET_MB=256 SHARDSYNC_SKIP_VERIFY=1 examples/glm4_5_air.sh --launcher ray
#   examples/glm4_5_air.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run GLM-4.5-Air "$@"
