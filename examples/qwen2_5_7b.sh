#!/usr/bin/env bash
# Qwen2.5-7B: one node of 8 GPUs: trainer TP4 -> one engine TP4 (QKV bias).
# Without CUDA this runs the tiny variant of the family on CPU (see: python examples/run.py list).
#   examples/qwen2_5_7b.sh          # on this machine, mode p2p
#   examples/qwen2_5_7b.sh --mode broadcast --steps 10
#   SHARDSYNC_BUCKET_MB=256 SHARDSYNC_SKIP_VERIFY=1 examples/qwen2_5_7b.sh --launcher ray
#   examples/qwen2_5_7b.sh --nodes N --node-rank R --head-ip IP   # on every node (docs/ray.md)
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run.py" run Qwen2.5-7B "$@"
