"""Print one table (markdown) from the peer harness' results: bench/peer-results/<tag>/.

    python bench/peer_table.py bench/peer-results/50M_fp32
    python bench/peer_table.py bench/peer-results/50M_fp32_r*     # rounds: per-round ratios, their median,
                                                                  # and the ratio of medians over every timed step

Step time: per step the max over ranks, median over the timed steps, with min-max spread;
peak RSS per rank over the timed steps (high-water mark reset at the first timed step);
model states per rank as the harness counts them; then the ratios the issues ask about.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

RATIOS = [("zs2", "floor"), ("zs3", "floor"), ("ddp", "floor"), ("zs3", "zs2"),
          ("zs2", "ddp"), ("zs2", "ds2"), ("zs3", "fsdp2"), ("zs3", "ds3"), ("zs2_offload", "zs2"),
          ("zs3_offload", "zs3"), ("zs2_offload", "ds2_offload"), ("zs3_offload", "ds3_offload"),
          ("zs0", "ddp"), ("zs1", "ddp")]


def load(folder: str) -> dict[str, dict]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json") and name != "summary.json":
            with open(os.path.join(folder, name)) as f:
                d = json.load(f)
            if d.get("status") == "ok":
                out[d["system"]] = d
    return out


def main(folder: str) -> dict[str, float]:
    runs = load(folder)
    print(f"| system | step median s | spread (min-max) | tokens/s | peak RSS MiB r0/r1 | model states MiB r0 |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for name, d in runs.items():
        s = d["summary"]
        steps = d["step_times_max_over_ranks_s"][d["spec"].get("warmup_steps", 3):]
        medians[name] = statistics.median(steps)
        rss = "/".join(f"{x:.0f}" for x in s["peak_rss_timed_mib_per_rank"])
        print(f"| {name} | {medians[name]:.3f} | {min(steps):.3f}-{max(steps):.3f} | {s['tokens_per_s']:.0f} | "
              f"{rss} | {s['model_state_mib_per_rank'][0]:.0f} |")
    print()
    print("| ratio of median step times | value |")
    print("|---|---|")
    for a, b in RATIOS:
        if a in medians and b in medians:
            print(f"| {a} / {b} | {medians[a] / medians[b]:.3f} |")
    return medians


def rounds(folders: list[str]) -> None:
    """Several rounds of the same systems: each round's table, then per ratio every round's value
    and their median (each ratio is taken within one round, so drift between rounds cancels)."""
    per_round, pooled = [], {}
    for folder in folders:
        print(f"### {os.path.basename(folder.rstrip('/'))}\n")
        per_round.append(main(folder))
        for name, d in load(folder).items():
            pooled.setdefault(name, []).extend(d["step_times_max_over_ranks_s"][d["spec"].get("warmup_steps", 3):])
        print()
    print(f"### {len(folders)} rounds\n")
    print("| ratio of median step times | per round | median of rounds | pooled: median of every timed step |")
    print("|---|---|---|---|")
    for a, b in RATIOS:
        values = [m[a] / m[b] for m in per_round if a in m and b in m]
        if values:
            whole = statistics.median(pooled[a]) / statistics.median(pooled[b])
            print(f"| {a} / {b} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.median(values):.3f} | "
                  f"{whole:.3f} |")
    print("\n| system | timed steps | median s | quartiles s |\n|---|---|---|---|")
    for name, steps in sorted(pooled.items()):
        q = statistics.quantiles(steps, n=4)
        print(f"| {name} | {len(steps)} | {statistics.median(steps):.3f} | {q[0]:.3f}-{q[2]:.3f} |")


if __name__ == "__main__":
    args = sys.argv[1:] or ["bench/peer-results/50M_fp32"]
    if len(args) == 1:
        main(args[0])
    else:
        rounds(args)
