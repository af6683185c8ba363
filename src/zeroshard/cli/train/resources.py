"""`zeroshard train --resource-log DIR`: each rank's resident memory, open files and threads
over the run, for soak tests (bench/soak.py, tests/test_soak.py).

Rank r appends one JSON line to DIR/rank<r>.jsonl at the start (after the engine is built),
after every checkpoint (after its reload too, with --reload-checkpoints) and at the end:

    {"step": 100, "event": "checkpoint", "rss_bytes": 412876800, "open_fds": 9, "threads": 5, "mappings": 450}

`rss_bytes` is VmRSS (resident now, not the peak), `open_fds` the entries of /proc/self/fd,
`threads` the process's OS threads (Python's, torch's intra-op pool, gloo's), `mappings` the
lines of /proc/self/maps (an mmap that is never unmapped adds one each time). Linux only:
these come from /proc/self. `drift` summarises a rank's samples after a warm-up, `judge` checks them against soak bounds.
"""

from __future__ import annotations

import json
import os

from zeroshard.policies import ConfigError

__all__ = ["ResourceLog", "check_resource_log", "drift", "judge", "read_log", "sample"]


def check_resource_log(path: str | None) -> str | None:
    if not path:
        return None
    if not os.path.isdir("/proc/self/fd"):
        return "--resource-log reads /proc/self (Linux only); this system has none"
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--resource-log {path}: exists and is not a folder"
    return None


def sample() -> dict[str, int]:
    """This process's resident bytes, open file descriptors and OS threads, now."""
    fds = len(os.listdir("/proc/self/fd")) - 1  # less the descriptor listdir itself holds open
    status: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    with open("/proc/self/maps") as f:
        mappings = sum(1 for _ in f)
    return {"rss_bytes": int(status["VmRSS"].split()[0]) * 1024, "open_fds": fds,
            "threads": int(status["Threads"]), "mappings": mappings}


def drift(rows: list[dict], warmup_step: int) -> dict:
    """How one rank's checkpoint samples from `warmup_step` on moved: RSS at the first of them,
    its largest rise above that (`rss_rise`), the least-squares slope in bytes per sample, and
    the open descriptors / threads / mappings seen (first and last)."""
    after = [r for r in rows if r["event"] == "checkpoint" and r["step"] >= warmup_step]
    if len(after) < 2:
        raise ValueError(f"need two checkpoint samples from step {warmup_step} on, got {len(after)}")
    rss = [r["rss_bytes"] for r in after]
    n = len(rss)
    mean_x, mean_y = (n - 1) / 2, sum(rss) / n
    slope = (sum((i - mean_x) * (y - mean_y) for i, y in enumerate(rss))
             / sum((i - mean_x) ** 2 for i in range(n)))
    out = {"samples": n, "from_step": after[0]["step"], "to_step": after[-1]["step"], "rss_first": rss[0],
           "rss_max": max(rss), "rss_last": rss[-1], "rss_rise": max(rss) - rss[0], "rss_slope": slope}
    for key in ("open_fds", "threads", "mappings"):
        out[key] = (after[0].get(key), after[-1].get(key), max(r.get(key, 0) for r in after))
    return out


def read_log(folder: str) -> dict[int, list[dict]]:
    """Every rank's samples in `folder`, by rank, from its last "start" line on (a restarted
    run appends to the same file)."""
    out: dict[int, list[dict]] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            starts = [i for i, r in enumerate(rows) if r["event"] == "start"]
            out[int(name[4:-6])] = rows[starts[-1] if starts else 0:]
    return out


def judge(rows: list[dict], warmup_step: int, rss_rise: int, maps_rise: int) -> tuple[dict, list[str]]:
    """`drift` of one rank from `warmup_step` on, and the soak bounds it breaks (none: flat):
    RSS at most `rss_rise` bytes above the first judged sample, the same open descriptors and
    threads at every judged sample, at most `maps_rise` new memory mappings."""
    d = drift(rows, warmup_step)
    problems = []
    if d["rss_rise"] > rss_rise:
        problems.append(f"RSS rose {d['rss_rise'] / 2**20:.1f} MiB after warm-up (bound {rss_rise / 2**20:.1f} MiB)")
    for key in ("open_fds", "threads"):
        first, last, most = d[key]
        if not first == last == most:
            problems.append(f"{key} {first} -> {last} (max {most}) after warm-up")
    first, last, most = d["mappings"]
    if most - first > maps_rise:
        problems.append(f"mappings {first} -> {last} (max {most}), more than {maps_rise} new after warm-up")
    return d, problems


class ResourceLog:
    """Appends `sample()` lines for one rank; a no-op when `folder` is empty."""

    def __init__(self, folder: str | None, rank: int):
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        if self.path:
            problem = check_resource_log(folder)
            if problem:
                raise ConfigError(problem)
            os.makedirs(folder, exist_ok=True)

    def record(self, step: int, event: str) -> None:
        if not self.path:
            return
        line = json.dumps({"step": step, "event": event, **sample()})  # sampled before the log is opened
        with open(self.path, "a") as f:
            f.write(line + "\n")
