#!/usr/bin/env bash
# The peer harness on two revisions of zeroshard side by side, for a change that must leave
# behaviour and speed alone (issue 26): each round runs the baselines (PEERS) and the zeroshard
# systems (SYSTEMS) on AFTER (the working tree unless given) and SYSTEMS on BEFORE, each
# revision from a git worktree put first on PYTHONPATH, the order reversed every other round;
# then per round the median step times, and each zeroshard system after / before (and over its
# baseline where one ran), with the ratios' geometric mean and its bootstrap 90 % interval.
#   BEFORE=4af8b11 ROUNDS=2 bench/run_revisions.sh          # 50M: ~7 min a round on 2 idle cores
#   BEFORE=4af8b11 AFTER=HEAD SYSTEMS=zs2 PEERS= ROUNDS=8 bench/run_revisions.sh   # zs2 A/B only
# AFTER=<commit> measures that commit rather than a working tree others may be editing.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:?BEFORE=<commit> to compare the working tree with}
MODEL=${MODEL:-50M}
ROUNDS=${ROUNDS:-2}
SYSTEMS=${SYSTEMS:-zs2,zs3}
PEERS=${PEERS-ddp,fsdp2}
TAG=${TAG:-${MODEL}_rev_$(git rev-parse --short "$BEFORE")}
worktree() {  # a detached worktree of commit $1, made once
  local tree=/tmp/zeroshard-rev-$(git rev-parse --short "$1")
  [ -d "$tree" ] || git worktree add --detach "$tree" "$1" >/dev/null
  echo "$tree"
}
TREE=${BEFORE_TREE:-$(worktree "$BEFORE")}
AFTER_PATH=""
[ -n "${AFTER:-}" ] && AFTER_PATH="$(worktree "$AFTER")/src"
reverse() { echo "$1" | tr ',' '\n' | tac | paste -sd, -; }
run() {  # run <systems> <tag> <PYTHONPATH or empty>
  echo "$2: $1 ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))"
  if [ -n "$3" ]; then
    env -u ROUNDS PYTHONPATH="$3" SYSTEMS=$1 TAG=$2 TIMEOUT=${TIMEOUT:-500} MODEL=$MODEL bench/run_peers.sh
  else
    env -u ROUNDS SYSTEMS=$1 TAG=$2 TIMEOUT=${TIMEOUT:-500} MODEL=$MODEL bench/run_peers.sh
  fi
}
NOW=${PEERS:+$PEERS,}$SYSTEMS
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then
    run "$NOW" "${TAG}_r${r}_now" "$AFTER_PATH"
    run "$SYSTEMS" "${TAG}_r${r}_before" "$TREE/src"
  else
    run "$(reverse "$SYSTEMS")" "${TAG}_r${r}_before" "$TREE/src"
    run "$(reverse "$NOW")" "${TAG}_r${r}_now" "$AFTER_PATH"
  fi
done
python - "$TAG" "$ROUNDS" "$SYSTEMS" "$PEERS" <<'PY'
import json, math, random, statistics, sys
tag, rounds, systems = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
peers = [p for p in sys.argv[4].split(",") if p]
BASE = {"zs0": "ddp", "zs1": "ddp", "zs2": "ddp", "zs3": "fsdp2"}
def step(name, system):
    return json.load(open(f"bench/peer-results/{name}/summary.json"))["systems"][system]["step_time_median_s"]
cols = peers + [f"{s} {side}" for s in systems for side in ("now", "before")]
print("| round | " + " | ".join(f"{c} s" for c in cols) + " |")
print("|---|" + "---|" * len(cols))
ratios: dict[str, list[float]] = {}
for r in range(1, rounds + 1):
    now, before = f"{tag}_r{r}_now", f"{tag}_r{r}_before"
    vals = {p: step(now, p) for p in peers}
    for s in systems:
        vals[f"{s} now"], vals[f"{s} before"] = step(now, s), step(before, s)
        ratios.setdefault(f"{s} now/before", []).append(vals[f"{s} now"] / vals[f"{s} before"])
        if BASE.get(s) in peers:
            for side in ("now", "before"):
                ratios.setdefault(f"{s}/{BASE[s]} {side}", []).append(vals[f"{s} {side}"] / vals[BASE[s]])
    print(f"| {r} | " + " | ".join(f"{vals[c]:.3f}" for c in cols) + " |")
def geomean_interval(v: list[float]) -> str:
    """Geometric mean of the ratios and its bootstrap 90 % interval (10,000 resamples, seed 0)."""
    logs, rng = [math.log(x) for x in v], random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(10_000))
    return f"{math.exp(statistics.fmean(logs)):.3f} ({math.exp(means[500]):.3f}-{math.exp(means[9499]):.3f})"
print()
print("| ratio of median step times | per round | median | geometric mean (bootstrap 90 %) |")
print("|---|---|---|---|")
for k, v in ratios.items():
    print(f"| {k} | {', '.join(f'{x:.3f}' for x in v)} | {statistics.median(v):.3f} | {geomean_interval(v)} |")
PY
