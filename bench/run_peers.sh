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
#   ROUNDS=3 SYSTEMS=ddp,ds2,zs2 bench/run_peers.sh   # 3 rounds, the order reversed every other
#     round (drift of the machine lands on every system alike); tags <tag>_r1.._r3, then
#     python bench/peer_table.py bench/peer-results/<tag>_r*   # per-round ratios and their median
export PEER_RESULTS="$PWD/bench/peer-results" DS_ACCELERATOR=cpu
TAG=${TAG:-${MODEL}_fp32}
cd "$PEERS"
if [ -z "${ROUNDS:-}" ]; then
  python run_peers.py --model "$MODEL" --systems "$SYSTEMS" --tag "$TAG" --timeout "${TIMEOUT:-400}" --no-report
  exit 0
fi
REVERSED=$(echo "$SYSTEMS" | tr ',' '\n' | tac | paste -sd, -)
for r in $(seq 1 "$ROUNDS"); do
  order=$SYSTEMS; [ $((r % 2)) -eq 0 ] && order=$REVERSED
  echo "round $r of $ROUNDS: $order ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))"
  python run_peers.py --model "$MODEL" --systems "$order" --tag "${TAG}_r$r" --timeout "${TIMEOUT:-400}" --no-report
done
