#!/usr/bin/env bash
# Llama-3.1-70B: 8 nodes of 8 GPUs: trainer TP8 PP4 -> four engines TP8.
# Without CUDA this runs the tiny variant of the family on CPU (see: python examples/run.py list).
#   examples/llama3_1_70b.sh          # on this machine, mode p2p
#   examples/llama3_1_70b.sh --mode broadcast --steps 10
#   SHARDSYNC_BUCKET_MB=256 SHARDSYNC_SKIP_VERIFY=1 examples/llama3_1_70b.sh --launcher ray
#   examples/llama3_1_70b.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run Llama-3.1-70B "$@"
