#!/usr/bin/env bash
# Llama-3.1-8B: one node of 8 GPUs: trainer TP4 -> two engines TP2 (trainer and engine TP differ).
# Without CUDA this runs the tiny variant of the family on CPU (see: python examples/run.py list).
#   examples/llama3_1_8b.sh          # on this machine, mode p2p
#   examples/llama3_1_8b.sh --mode broadcast --steps 10
#   SHARDSYNC_BUCKET_MB=256 SHARDSYNC_SKIP_VERIFY=1 examples/llama3_1_8b.sh --launcher ray
#   examples/llama3_1_8b.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run Llama-3.1-8B "$@"
