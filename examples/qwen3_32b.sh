#!/usr/bin/env bash
# Qwen3-32B: 4 nodes of 8 GPUs: trainer TP8 PP2 -> four engines TP4.
# Without CUDA this runs the tiny variant of the family on CPU (see: python examples/run.py list).
#   examples/qwen3_32b.sh          # on this machine, mode p2p
#   examples/qwen3_32b.sh --mode broadcast --steps 10
#   SHARDSYNC_BUCKET_MB=256 SHARDSYNC_SKIP_VERIFY=1 examples/qwen3_32b.sh --launcher ray
#   examples/qwen3_32b.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run Qwen3-32B "$@"
