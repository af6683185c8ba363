"""What `zeroshard train` shows: the progress bar, a per-rank line every `steps_per_print`
steps, the closing summary table and the PNG report, all read from the engine's ledgers.

Per-rank numbers travel through the engine's own comm layer (one small all-gather), so
they are collectives like any other: every rank calls `gather_memory` at the same steps.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from zeroshard.comm import PAPER_FACTOR
from zeroshard.estimate.byte_units import human_bytes

__all__ = ["MEMORY_KINDS", "RunRecord", "detail_line", "gather_memory", "make_progress", "memory_line", "paper_elements",
           "summary_table", "write_report"]

MEMORY_KINDS = ("params", "grads", "optimizer_states", "comm_buffers")
_SHORT = {"params": "params", "grads": "grads", "optimizer_states": "optim", "comm_buffers": "comm"}
MiB = 2**20


@dataclass
class RunRecord:
    """What the run measured, for the summary and the report (rank 0)."""
    label: str
    stage: int
    world: int
    backend: str
    phi: int  # all parameters
    trainable: int
    itemsize: int  # bytes per parameter in the compute dtype
    losses: list[float] = field(default_factory=list)
    first_step: int = 0  # > 0 after --resume
    tokens_per_step: int = 0
    seconds: float = 0.0  # of this run's steps
    steps_run: int = 0  # this run's steps (fewer than len(losses) after --resume)
    skipped: int = 0
    last_comm: dict = field(default_factory=dict)  # comm_stats() of the last step
    waited: float = 0.0  # seconds this rank was blocked in collectives' waits during this run's steps
    host_waits: bool = True  # False on NCCL: a wait only orders the CUDA stream, the host never blocks


def make_progress(console: Console, total: int, disable: bool) -> Progress:
    return Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s"),
                    TimeRemainingColumn(), console=console, disable=disable)


def gather_memory(engine) -> list[dict[str, int]]:
    """Every rank's memory_stats() (now and peak, by category), on every rank. A collective."""
    keys = [*MEMORY_KINDS, *(f"peak_{k}" for k in MEMORY_KINDS), "tier_device", "tier_host", "tier_nvme",
            "optimizer_masters"]
    # fp32 masters kept apart from the parameters (offload tiers, 16-bit training): plain DP
    # in fp32 holds none, so its baseline must not copy them
    stats = {**engine.memory_stats(), "optimizer_masters": engine.memory.held("optimizer_states", "master.")}
    ts = engine.train_state
    mine = torch.tensor([int(stats.get(k, 0)) for k in keys], dtype=torch.int64, device=ts.device)
    everyone = torch.empty(ts.world_size * len(keys), dtype=torch.int64, device=ts.device)
    ts.comm.all_gather(everyone, mine, what="zeroshard train: per-rank memory").wait()
    rows = everyone.view(ts.world_size, len(keys)).tolist()
    return [dict(zip(keys, row)) for row in rows]


def paper_elements(comm: dict) -> int:
    """Communication of one step in the ZeRO paper's units (an all-reduce counts twice)."""
    return sum(PAPER_FACTOR[op] * s["elements"] for op, s in comm.items() if op != "broadcast")


def memory_line(step: int, total: int, loss: float, engine, per_rank: list[dict[str, int]], comm: dict,
                phi: int) -> str:
    """The step line, at most 100 columns: loss, lr, grad norm, the largest rank's model states
    (unit picked to fit), the step's traffic in the paper's units and rank 0's bytes sent."""
    lr = ", ".join(f"{v:.3g}" for v in engine.get_lr())
    norm = engine.get_global_grad_norm()
    states = max(sum(m[k] for k in MEMORY_KINDS) for m in per_rank)
    sent = sum(s["sent_bytes"] for s in comm.values())
    line = (f"step {step}/{total} loss {loss:.3f} lr {lr} norm {norm if norm is not None else math.nan:.3g} | "
            f"states {human_bytes(states)}/rank | {paper_elements(comm) / phi:.3f} x Phi, {human_bytes(sent)} sent")
    return line if len(line) <= 100 else line[:97] + "..."


def detail_line(per_rank: list[dict[str, int]], comm: dict) -> str:
    """With --verbose, under the step line: every rank's memory by category and the collectives."""
    ranks = "  ".join(
        f"r{r} " + " ".join(f"{_SHORT[k]} {human_bytes(m[k])}" for k in MEMORY_KINDS) for r, m in enumerate(per_rank))
    ops = ", ".join(f"{op} {s['calls']}x {s['elements']:,}" for op, s in comm.items() if s["calls"])
    return f"  per rank: {ranks} | last step: {ops} elements"


def _plain_dp_optimizer(rec: RunRecord, mem: dict[str, int], optimizer_shards: int) -> int:
    """The whole optimizer state one rank of plain data parallelism holds: this run's states
    times its shards, plus an fp32 master of every trainable parameter only when training in
    16 bits (in fp32 the parameter is its own master, wherever this run kept a copy)."""
    states = mem["optimizer_states"] - mem.get("optimizer_masters", 0)
    return states * optimizer_shards + (4 * rec.trainable if rec.itemsize < 4 else 0)


def _exposed(rec: RunRecord) -> str:
    """Rank 0's seconds blocked in collectives' waits per step: communication that overlapped with
    nothing, and time spent waiting for a slower rank (the comm ledger's `waited`)."""
    if not rec.host_waits:
        return "not measured: NCCL waits do not block the host"
    steps = max(rec.steps_run, 1)
    share = 100 * rec.waited / max(rec.seconds, 1e-9)
    return f"{1000 * rec.waited / steps:,.1f} ms/step, {share:.1f} % of the steps (rank 0's waits)"


def summary_table(rec: RunRecord, per_rank: list[dict[str, int]], optimizer_shards: int) -> Table:
    mem = per_rank[0]
    held = sum(mem[k] for k in ("params", "grads", "optimizer_states"))
    # plain DP holds every parameter and trainable gradient in the compute dtype, and the whole optimizer state
    plain = rec.itemsize * (rec.phi + rec.trainable) + _plain_dp_optimizer(rec, mem, optimizer_shards)
    losses = rec.losses
    k = max(1, min(10, len(losses) // 2))
    table = Table(title="zeroshard train: summary", show_header=False)
    rows = [
        ("ZeRO stage / ranks", f"{rec.stage} / {rec.world} ({rec.backend})"),
        ("model", f"{rec.label}, Phi = {rec.phi:,}" + ("" if rec.trainable == rec.phi else
                                                          f" ({rec.trainable:,} trainable)")),
        ("loss", f"{sum(losses[:k]) / k:.3f} (first {k} steps) -> {sum(losses[-k:]) / k:.3f} (last {k})"),
        ("model states, rank 0", f"{held / MiB:.2f} MiB vs plain DP {plain / MiB:.2f} MiB ({held / plain:.2f}x)"),
        ("  at rest", f"params {human_bytes(mem['params'])}, grads {human_bytes(mem['grads'])}, "
                      f"optimizer {human_bytes(mem['optimizer_states'])}"),
        ("  by tier", ", ".join(f"{t} {human_bytes(mem.get('tier_' + t, 0))}" for t in ("device", "host", "nvme")
                                if mem.get("tier_" + t) or t == "device")),
        ("communication per step", f"{paper_elements(rec.last_comm) / rec.phi:.3f} x Phi (paper units) vs plain DP "
                                   f"{2 * rec.trainable / rec.phi:.3f} x Phi"),
        ("throughput", f"{rec.steps_run * rec.tokens_per_step / max(rec.seconds, 1e-9):,.0f} tokens/s, "
                       f"{rec.seconds:.1f} s for {rec.steps_run} steps"),
        ("exposed communication", _exposed(rec)),
        ("skipped steps", str(rec.skipped)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def write_report(path: str, rec: RunRecord, per_rank: list[dict[str, int]], optimizer_shards: int) -> str:
    """A PNG: the loss per step, and each rank's model states by category next to plain DP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    steps = range(rec.first_step + 1, rec.first_step + len(rec.losses) + 1)
    ax_loss.plot(list(steps), rec.losses, lw=1.0, color="tab:blue", alpha=0.5, label="loss")
    if len(rec.losses) >= 10:
        w = max(5, len(rec.losses) // 20)
        smooth = torch.tensor(rec.losses).unfold(0, w, 1).mean(1).tolist()
        ax_loss.plot(list(steps)[w - 1:], smooth, lw=2.0, color="tab:blue", label=f"mean of {w}")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats per byte)", title=f"{rec.label}: loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    labels = [f"rank {r}" for r in range(len(per_rank))] + ["plain DP"]
    plain = {"params": rec.itemsize * rec.phi, "grads": rec.itemsize * rec.trainable,
             "optimizer_states": _plain_dp_optimizer(rec, per_rank[0], optimizer_shards), "comm_buffers": 0}
    columns = [*per_rank, plain]
    bottom = [0.0] * len(columns)
    for kind, color in zip(MEMORY_KINDS, ("tab:blue", "tab:orange", "tab:green", "tab:gray")):
        heights = [c[kind] / MiB for c in columns]
        ax_mem.bar(labels, heights, bottom=bottom, label=kind.replace("_", " "), color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    extra = [sum(m[f"peak_{k}"] - m[k] for k in MEMORY_KINDS) / MiB for m in per_rank]
    ax_mem.bar(labels[:-1], extra, bottom=bottom[:-1], label="extra at peak (gathered units, buffers)",
               color="none", edgecolor="black", hatch="//")
    ax_mem.set(ylabel="MiB", title=f"model states per rank (ZeRO stage {rec.stage}, {rec.world} ranks)")
    ax_mem.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
