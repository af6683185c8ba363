#!/usr/bin/env bash
# The shared peer harness (../shared/bench-peers) on zeroshard beside DDP, FSDP2 and DeepSpeed:
# identical workload, 2 gloo ranks x 1 thread, fp32 AdamW(fused), 3 warm-up + 10 timed steps.
# Results land in bench/peer-results/<tag>/ (summary.json + per-system JSON and logs).
#   bench/run_peers.sh                 # 50M: stages, offload, peers (~12 min idle, DeepSpeed needed)
#   MODEL=150M SYSTEMS=ddp,fsdp2,zs0,zs1,zs2,zs3 bench/run_peers.sh
# DeepSpeed for CPU: pip install deepspeed (its cpu_adam op is JIT-built on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-../shared/bench-peers}
MODEL=${MODEL:-50M}
SYSTEMS=${SYSTEMS:-ddp,fsdp2,ds2,ds3,ds2_offload,ds3_offload,zs0,zs1,zs2,zs3,zs2_offload,zs3_offload}
export PEER_RESULTS="$PWD/bench/peer-results" DS_ACCELERATOR=cpu
cd "$PEERS"
python run_peers.py --model "$MODEL" --systems "$SYSTEMS" --tag "${TAG:-${MODEL}_fp32}" --timeout "${TIMEOUT:-400}" --no-report
