"""What `zeroshard bench` shows and writes: one table per model, the ratios, the report
answering the explainer's questions, bench.json and (with matplotlib) bench.png."""

from __future__ import annotations

import json
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from zeroshard.bench.answers import answers
from zeroshard.bench.results import PHASES, MiB, phase_breakdown

__all__ = ["add_report", "phase_table", "print_report", "system_table", "write_outputs"]

def add_report(result: dict[str, Any]) -> dict[str, Any]:
    """Each model's `report`: the explainer's questions answered from its rows."""
    for run in result["runs"].values():
        run["report"] = answers(run["rows"], result["settings"]["bf16"], result["settings"].get("cuda", False))
    return result


def _m(b: float) -> str:
    """MiB, with decimals where a small model would round to 0."""
    return "0" if b == 0 else f"{b / MiB:,.0f}" if b >= 10 * MiB else f"{b / MiB:.2f}"


def _states(row: dict) -> str:
    """Model states of rank 0 in MiB: params/grads/optimizer (zeroshard: ledger at rest, then peak)."""
    if "ledger" in row:
        m = row["ledger"]["memory"][0]
        return f"{_m(m['params'])}/{_m(m['grads'])}/{_m(m['optimizer_states'])} (peak {_m(m['peak_model_states'])})"
    s = row["model_states"][0]
    peak = f" (peak {_m(row['peer_peak'][0]['peak_model_states'])})" if "peer_peak" in row else ""
    return f"{_m(s['params'])}/{_m(s['grads'])}/{_m(s['optimizer_states'])}{peak}"


def phase_table(run: dict[str, Any]) -> Table:
    """Where a step goes, on the rank that set each step's time, one row per system
    (`results.phase_breakdown`), beside the compute floor's when it ran."""
    rows = run["rows"]
    floor = rows.get("floor")
    table = Table(title=f"where a step goes: {run['model']}, the slowest rank of each step, seconds (medians over the "
                  "measured steps)",
                  title_justify="left")
    for col in ("system", "step", "forward", "backward", "exposed reduce", "exposed gather", "optimizer", "other",
                "step x floor"):
        table.add_column(col, justify="left" if col == "system" else "right")
    base = phase_breakdown(floor)["step"] if floor else None
    for name, row in rows.items():
        b = phase_breakdown(row)
        cells = ["-" if b[k] is None else f"{b[k]:.3f}" for k in PHASES]
        table.add_row(name, *cells, f"{b['step'] / base:.3f}" if base else "-")
    return table


def _peer_phi(row: dict) -> str:
    """FSDP2's collectives counted in its untimed step, in Phi (marked "~": one step, not the window)."""
    if "peer_peak" not in row:
        return "-"
    return f"~{row['peer_peak'][0]['paper_elements'] / row['phi']:.3f}"


def system_table(run: dict[str, Any]) -> Table:
    rows, ratios, loss = run["rows"], run["ratios"], run["loss_max_abs_diff_vs_ddp"]
    table = Table(title=f"zeroshard bench: {run['model']} (Phi = {run['phi'] or 0:,})", title_justify="left")
    for col in ("system", "step s median (min-max)", "x DDP", "x floor", "tokens/s", "peak RSS MiB per rank",
                "model states MiB r0 P/G/O", "tiers MiB dev/host/nvme", "comm Phi/step", "sent MiB/step",
                "|loss-DDP| max"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, row in rows.items():
        st = row["step_time_s"]
        led = row.get("ledger")
        table.add_row(
            name, f"{st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f})",
            f"{ratios[f'{name}/ddp']:.3f}" if f"{name}/ddp" in ratios else ("1.000" if name == "ddp" else "-"),
            f"{ratios[f'{name}/floor']:.3f}" if f"{name}/floor" in ratios else ("1.000" if name == "floor" else "-"),
            f"{row['tokens_per_s']:,.0f}", "/".join(f"{m:,.0f}" for m in row["peak_rss_mib"]), _states(row),
            "/".join(_m(led["memory"][0][f"tier_{t}"]) for t in ("device", "host", "nvme")) if led else "-",
            f"{led['phi_per_step']:.3f}" if led else _peer_phi(row),
            f"{led['sent_bytes_per_step'] / MiB:,.1f}" if led else "-",
            f"{loss[name]:.2e}" if name in loss else "-")
    return table


def print_report(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=200)
    s = result["settings"]
    rounds = s.get("rounds", 1)
    console.print(f"{s['nproc']} ranks x {s['threads']} thread(s), micro-batch {s['micro_batch']} x seq "
                  f"{s['seq_len']}, {'bf16' if s['bf16'] else 'fp32'}, AdamW (fused), {s['warmup']} warm-up + "
                  f"{s['steps']} measured steps" + (f" x {rounds} interleaved rounds (pooled)" if rounds > 1 else "")
                  + f"; {s['cpus']} CPUs", highlight=False)
    for run in result["runs"].values():
        console.print(system_table(run))
        console.print("model states: zeroshard from memory_stats() (at rest after the last step, and the "
                      "simultaneous peak over the measured steps); peers counted from their real tensors after "
                      "a backward and after a step (FSDP2's peak adds its unsharded parameters, gradients and "
                      "collective buffers, sampled in that untimed step). comm: zeroshard's comm_stats() per measured "
                      "step; FSDP2's collectives counted in its untimed step (~); other peers' not counted. floor: "
                      "no collectives, the optimizer over 1/N of the parameters (its losses are not a training run's).",
                      highlight=False, style="dim")
        console.print(phase_table(run))
        console.print("forward, backward, optimizer: without the seconds that rank was blocked on a collective in "
                      "them; exposed reduce / gather: those seconds (the communication that did not overlap; "
                      "zeroshard's ledger; a peer's are inside its phases: -); other: the rest of the step "
                      "(from the barrier). Each column is a median, so they need not add up exactly.",
                      highlight=False, style="dim")
        if run["ratios"]:
            console.print("ratios of median step times: " + ", ".join(f"{k} {v:.3f}" for k, v in run["ratios"].items()),
                          highlight=False)
        for name, why in run["failed"].items():
            console.print(f"[red]{name}: {why}[/red]", highlight=False)
        console.print(f"\nreport ({run['model']}): the ZeRO explainer's questions, measured", style="bold")
        for a in run.get("report", []):
            console.print(f"- {a['question']}\n  explainer: {a['claim']}\n  measured: {a['answer']}", highlight=False)


def write_outputs(result: dict[str, Any], out: str) -> list[str]:
    """bench.json, and bench.png when matplotlib is importable (else a note, no PNG)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    written = [f"json: {path}"]
    from zeroshard.bench.plot import plot_available, write_png

    if plot_available():
        written.append(f"png: {write_png(result, os.path.join(out, 'bench.png'))}")
    else:
        written.append("png: skipped, matplotlib is not installed (pip install 'zeroshard[plot]')")
    return written
