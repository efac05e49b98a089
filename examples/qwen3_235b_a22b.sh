#!/usr/bin/env bash
# Qwen3-235B-A22B: six nodes of 8 GPUs: trainer TP4 PP4 (24,24,24,22 layers) DP2 EP8 ETP1 -> two engines TP8 EP8.
# Without CUDA this runs the tiny variant of the family on CPU (see: python examples/run.py list).
#   examples/qwen3_235b_a22b.sh          # on this machine, mode p2p
#   examples/qwen3_235b_a22b.sh --mode broadcast --steps 10
#   SHARDSYNC_BUCKET_MB=256 SHARDSYNC_SKIP_VERIFY=1 examples/qwen3_235b_a22b.sh --launcher ray
#   examples/qwen3_235b_a22b.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run Qwen3-235B-A22B "$@"
