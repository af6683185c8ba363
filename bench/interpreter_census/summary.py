"""Summarise bench/interpreter_census's log: interpreters and their CPU by the set of heavy
modules they imported (what an interpreter's start costs) and by test file.

    python bench/interpreter_census/summary.py /tmp/census.tsv [--files 30]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--files", type=int, default=30, help="test files to list (default 30)")
    args = ap.parse_args()
    rows = [line.rstrip("\n").split("\t") for line in open(args.log)]
    rows = [r for r in rows if len(r) == 7]
    total = sum(float(r[3]) for r in rows)
    print(f"{len(rows)} interpreters, {total:.1f} CPU s\n")
    print("| imported | interpreters | CPU s | CPU s each |\n|---|---:|---:|---:|")
    cpu, count = collections.Counter(), collections.Counter()
    for r in rows:
        cpu[r[5] or "-"] += float(r[3])
        count[r[5] or "-"] += 1
    for key, c in cpu.most_common():
        print(f"| {key} | {count[key]} | {c:.1f} | {c / count[key]:.2f} |")
    print("\n| test file | interpreters | CPU s |\n|---|---:|---:|")
    cpu, count = collections.Counter(), collections.Counter()
    for r in rows:
        key = r[4].split("::")[0] or "(pytest and its workers)"
        cpu[key] += float(r[3])
        count[key] += 1
    for key, c in cpu.most_common(args.files):
        print(f"| {key} | {count[key]} | {c:.1f} |")


if __name__ == "__main__":
    main()
