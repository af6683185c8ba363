"""bench.png: median step time (with its min-max spread) and memory per system, and with
several models how both grow with the parameter count. matplotlib is optional
(`pip install 'zeroshard[plot]'`); without it `zeroshard bench` says so and writes no PNG."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from zeroshard.bench.results import MiB

__all__ = ["plot_available", "write_png"]

def plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _bars(ax_time, ax_mem, run: dict[str, Any]) -> None:
    names = list(run["rows"])
    rows = [run["rows"][n] for n in names]
    med = [r["step_time_s"]["median"] for r in rows]
    lo = [m - r["step_time_s"]["min"] for m, r in zip(med, rows)]
    hi = [r["step_time_s"]["max"] - m for m, r in zip(med, rows)]
    ax_time.bar(names, med, yerr=[lo, hi], capsize=3, color="tab:blue")
    ax_time.set(ylabel="s per step (median, min-max)", title=f"{run['model']}: step time")
    rss = [max(r["peak_rss_mib"]) for r in rows]
    states = [_states_mib(r) for r in rows]
    x = range(len(names))
    ax_mem.bar([i - 0.2 for i in x], rss, width=0.4, label="peak RSS (largest rank)", color="tab:gray")
    ax_mem.bar([i + 0.2 for i in x], states, width=0.4, label="model states, rank 0", color="tab:green")
    ax_mem.set_xticks(list(x), names)
    ax_mem.set(ylabel="MiB", title=f"{run['model']}: memory per rank")
    ax_mem.legend(fontsize=7)
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.grid(axis="y", alpha=0.3)


def _states_mib(row: dict) -> float:
    if "ledger" in row:
        return row["ledger"]["memory"][0]["model_states"] / MiB
    return sum(row["model_states"][0].values()) / MiB


def _growth(ax_time, ax_mem, runs: list[dict[str, Any]]) -> None:
    systems = sorted({n for run in runs for n in run["rows"]})
    for name in systems:
        pts = [(run["phi"], run["rows"][name]) for run in runs if name in run["rows"]]
        if len(pts) < 2:
            continue
        phis = [p / 1e6 for p, _ in pts]
        ax_time.plot(phis, [r["step_time_s"]["median"] for _, r in pts], marker="o", label=name)
        line, = ax_mem.plot(phis, [max(r["peak_rss_mib"]) for _, r in pts], marker="o", label=f"{name} peak RSS")
        ax_mem.plot(phis, [_states_mib(r) for _, r in pts], marker=".", ls="--", color=line.get_color(),
                    label=f"{name} model states")
    ax_time.set(xlabel="parameters (millions)", ylabel="s per step (median)", title="step time vs model size")
    ax_mem.set(xlabel="parameters (millions)", ylabel="MiB per rank", title="memory vs model size (peak RSS, largest rank; model states, rank 0)")
    for ax in (ax_time, ax_mem):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def write_png(result: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"].values() if r["rows"]]
    growth = len(runs) >= 2
    nrows = len(runs) + (1 if growth else 0)
    fig, axes = plt.subplots(max(nrows, 1), 2, figsize=(12, 4.2 * max(nrows, 1)), squeeze=False)
    for i, run in enumerate(runs):
        _bars(axes[i][0], axes[i][1], run)
    if growth:
        _growth(axes[-1][0], axes[-1][1], runs)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
