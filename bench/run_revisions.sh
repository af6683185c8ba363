#!/usr/bin/env bash
# The peer harness on two revisions of zeroshard side by side, for a change that must leave
# behaviour and speed alone (issue 26): each round runs DDP, FSDP2, zs2 and zs3 at the working
# tree and zs2, zs3 at BEFORE (checked out in a git worktree, put first on PYTHONPATH), the
# order reversed every other round, and prints zs2/DDP and zs3/FSDP2 for both revisions.
#   BEFORE=4af8b11 ROUNDS=2 bench/run_revisions.sh          # 50M: ~7 min a round on 2 idle cores
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:?BEFORE=<commit> to compare the working tree with}
MODEL=${MODEL:-50M}
ROUNDS=${ROUNDS:-2}
TAG=${TAG:-${MODEL}_rev_$(git rev-parse --short "$BEFORE")}
TREE=${BEFORE_TREE:-/tmp/zeroshard-before-$(git rev-parse --short "$BEFORE")}
[ -d "$TREE" ] || git worktree add --detach "$TREE" "$BEFORE" >/dev/null
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then
    env -u ROUNDS SYSTEMS=ddp,fsdp2,zs2,zs3 TAG=${TAG}_r${r}_now TIMEOUT=${TIMEOUT:-500} MODEL=$MODEL bench/run_peers.sh
    env -u ROUNDS PYTHONPATH="$TREE/src" SYSTEMS=zs2,zs3 TAG=${TAG}_r${r}_before TIMEOUT=${TIMEOUT:-500} MODEL=$MODEL bench/run_peers.sh
  else
    env -u ROUNDS PYTHONPATH="$TREE/src" SYSTEMS=zs3,zs2 TAG=${TAG}_r${r}_before TIMEOUT=${TIMEOUT:-500} MODEL=$MODEL bench/run_peers.sh
    env -u ROUNDS SYSTEMS=zs3,zs2,fsdp2,ddp TAG=${TAG}_r${r}_now TIMEOUT=${TIMEOUT:-500} MODEL=$MODEL bench/run_peers.sh
  fi
done
python - "$TAG" "$ROUNDS" <<'PY'
import json, statistics, sys
tag, rounds = sys.argv[1], int(sys.argv[2])
def step(name, system):
    s = json.load(open(f"bench/peer-results/{name}/summary.json"))["systems"][system]
    return s["step_time_median_s"], s["step_time_min_s"]
rows = {"zs2/ddp now": [], "zs2/ddp before": [], "zs3/fsdp2 now": [], "zs3/fsdp2 before": []}
print("| round | ddp s | fsdp2 s | zs2 now s | zs2 before s | zs3 now s | zs3 before s |")
print("|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    now, before = f"{tag}_r{r}_now", f"{tag}_r{r}_before"
    d, f = step(now, "ddp")[0], step(now, "fsdp2")[0]
    z2, z3 = step(now, "zs2")[0], step(now, "zs3")[0]
    b2, b3 = step(before, "zs2")[0], step(before, "zs3")[0]
    print(f"| {r} | {d:.3f} | {f:.3f} | {z2:.3f} | {b2:.3f} | {z3:.3f} | {b3:.3f} |")
    rows["zs2/ddp now"].append(z2 / d); rows["zs2/ddp before"].append(b2 / d)
    rows["zs3/fsdp2 now"].append(z3 / f); rows["zs3/fsdp2 before"].append(b3 / f)
print()
print("| ratio of median step times | per round | median |")
print("|---|---|---|")
for k, v in rows.items():
    print(f"| {k} | {', '.join(f'{x:.3f}' for x in v)} | {statistics.median(v):.3f} |")
PY
