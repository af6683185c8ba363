"""`zeroshard bench`'s numbers: one system's rank files merged into its row, the ratios
between rows, and the ZeRO formula each zeroshard row is checked against. Pure functions
over plain dicts (what the JSON holds), so tests can recompute every figure.

Step time: per step the slowest rank's time (barrier to end of optimizer step); median,
min and max over the measured steps. Tokens/s: tokens of one global batch / median.
Phases: for each measured step, the forward, backward and optimizer-step seconds of the rank that
set its time (the slowest), that step time, and for zeroshard and the floor the seconds that rank
was blocked on collectives in each (`phase_breakdown`: where a step goes, beside the compute
floor's). With --rounds, a system's rows of every round are pooled into one (`pool_rounds`).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["BASELINES", "MiB", "PAIRS", "PHASES", "formula_bytes", "loss_agreement", "merge_ranks", "phase_breakdown",
           "pool_rounds", "ratios", "stage_phi", "WAITS"]

MiB = 2**20

# every row's median step time over each of these, where it ran: the compute floor and DDP
BASELINES = ("floor", "ddp")
# the columns of `phase_breakdown`, in the order they are shown
PHASES = ("step", "forward", "backward", "exposed_reduce", "exposed_gather", "optimizer", "other")
# the blocked seconds a row carries per step (zeroshard's and the floor's), by phase and by kind
WAITS = ("fwd_wait", "bwd_wait", "opt_wait", "reduce_wait", "gather_wait")

# ratios of median step times worth reading beside "x DDP": (system, baseline)
PAIRS = (("zs2", "ds2"), ("zs3", "fsdp2"), ("zs3", "ds3"), ("zs2_offload", "zs2"), ("zs3_offload", "zs3"),
         ("zs2_offload", "ds2_offload"), ("zs3_offload", "ds3_offload"), ("zs2_no_overlap", "zs2"),
         ("zs2_no_contiguous", "zs2"), ("zs3_defaults", "zs3"), ("zs2_ds", "zs2"), ("zs3_fsdp2", "fsdp2"),
         ("zs3_fsdp2", "zs3"), ("fsdp2", "ddp"))

# The ZeRO paper's volume per step in units of Phi (DESIGN.md section 1): every system moves
# 2 Phi through stages 0-2 and 3 Phi at stage 3.
_PAPER_PHI = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}


def stage_phi(stage: int) -> float:
    return _PAPER_PHI[stage]


def formula_bytes(stage: int, phi: int, trainable: int, world: int, bf16: bool) -> dict[str, float]:
    """Model states per rank at rest by the ZeRO formula (DESIGN.md section 1): parameters and
    gradients in the compute dtype; Adam's two fp32 moments, plus an fp32 master in bf16 (in
    fp32 the parameter shard is its own master: K = 8, else 12)."""
    item = 2 if bf16 else 4
    k = 12 if bf16 else 8
    p, g, o = item * phi, item * trainable, k * trainable
    shard = {0: (1, 1, 1), 1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}[stage]
    out = {"params": p / shard[0], "grads": g / shard[1], "optimizer_states": o / shard[2]}
    out["model_states"] = sum(out.values())
    return out


def merge_ranks(per_rank: list[dict[str, Any]], micro_batch: int, seq_len: int) -> dict[str, Any]:
    """One system's row from its ranks' results (each as bench.worker writes it)."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    r0 = per_rank[0]
    warm = r0["warmup"]
    slowest = [max(r["step_times_s"][i] for r in per_rank) for i in range(len(r0["step_times_s"]))]
    timed = slowest[warm:]
    median = statistics.median(timed)
    world = r0["world_size"]
    tokens = world * micro_batch * seq_len
    losses = [sum(r["losses"][i] for r in per_rank) / len(per_rank) for i in range(len(r0["losses"]))]
    row: dict[str, Any] = {
        "system": r0["system"], "world_size": world, "phi": r0["phi"], "threads": r0["threads"],
        "step_time_s": {"median": median, "min": min(timed), "max": max(timed), "steps": timed},
        "tokens_per_step": tokens, "tokens_per_s": tokens / median,
        "peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in per_rank],
        "peak_rss_reset": all(r["peak_rss_reset"] for r in per_rank),
        "model_states": [r["model_states"] for r in per_rank],
        "losses": losses, "init_s": r0["init_s"],
    }
    # where each step goes: the phases of the rank that set its time (the slowest). Another rank's
    # waits include the time it idled for that one, which the floor (its step is the slowest rank's
    # too) pays as well, at the next barrier
    slow = [(i, max(per_rank, key=lambda r: r["step_times_s"][i])) for i in range(warm, len(r0["step_times_s"]))]
    row["phases_s"] = {k: [r["phases_s"][i][j] for i, r in slow] for j, k in enumerate(("fwd", "bwd", "opt"))}
    row["phases_s"]["step"] = [r["step_times_s"][i] for i, r in slow]
    row["phases_s"]["rank"] = [r["rank"] for _, r in slow]
    waits = [r["waits_s"][i] if "waits_s" in r else None for i, r in slow]
    if waits and all(w is not None for w in waits):
        row["phases_s"].update({k: [w[k] for w in waits] for k in WAITS})
    if "peer_peak" in r0:
        row["peer_peak"] = [r["peer_peak"] for r in per_rank]
    if "ledgers" in r0:
        led = r0["ledgers"]
        row["ledger"] = {"memory": [r["ledgers"]["memory"] for r in per_rank], "comm_per_step": led["comm_per_step"],
                         "paper_elements_per_step": led["paper_elements_per_step"],
                         "phi_per_step": led["paper_elements_per_step"] / r0["phi"],
                         "sent_bytes_per_step": led["sent_bytes_per_step"], "trainable": led["trainable"]}
        row["config"] = r0["config"]
    return row


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Median step time of a row over another's: every row over each of BASELINES that ran (DDP
    over the floor too), then PAIRS."""
    med = {name: row["step_time_s"]["median"] for name, row in rows.items()}
    out = {}
    for base in BASELINES:
        if base in med:
            out.update({f"{name}/{base}": m / med[base] for name, m in med.items()
                        if name not in BASELINES or BASELINES.index(name) > BASELINES.index(base)})
    for a, b in PAIRS:
        if a in med and b in med and f"{a}/{b}" not in out:
            out[f"{a}/{b}"] = med[a] / med[b]
    return out


def loss_agreement(rows: dict[str, dict[str, Any]], reference: str = "ddp") -> dict[str, float]:
    """Largest |loss - reference loss| over all steps, per row (the global-batch mean loss); not
    the floor's, which is not a training run after its first step (bench.peers.FloorRunner)."""
    if reference not in rows:
        return {}
    ref = rows[reference]["losses"]
    return {name: max(abs(a - b) for a, b in zip(row["losses"], ref))
            for name, row in rows.items() if name not in (reference, "floor")}


def phase_breakdown(row: dict[str, Any]) -> dict[str, float | None]:
    """Where a step goes, on the rank that set each step's time (seconds, each the median over the
    measured steps, so they need not add up exactly): the step time from the barrier; forward,
    backward and optimizer step without the time blocked on collectives in each; that blocked
    time by kind, reductions and gathers (the communication that did not overlap: zeroshard's
    ledger, and 0 for the floor); and the rest of the step (loss read-out, hand-offs). A peer's
    collectives are its own: its exposed columns are None and its phases include them."""
    ph = row["phases_s"]
    steps = range(len(ph["fwd"]))
    known = all(k in ph for k in WAITS)
    zero = [0.0] * len(ph["fwd"])
    w = {k: ph[k] if known else zero for k in WAITS}
    per_step = {
        "step": ph.get("step", [ph["fwd"][i] + ph["bwd"][i] + ph["opt"][i] for i in steps]),
        "forward": [ph["fwd"][i] - w["fwd_wait"][i] for i in steps],
        "backward": [ph["bwd"][i] - w["bwd_wait"][i] for i in steps],
        "exposed_reduce": w["reduce_wait"], "exposed_gather": w["gather_wait"],
        "optimizer": [ph["opt"][i] - w["opt_wait"][i] for i in steps],
    }
    per_step["other"] = [per_step["step"][i] - ph["fwd"][i] - ph["bwd"][i] - ph["opt"][i] for i in steps]
    out: dict[str, float | None] = {k: statistics.median(v) if v else None for k, v in per_step.items()}
    if not known:
        out["exposed_reduce"] = out["exposed_gather"] = None
    return out


def pool_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rows from several interleaved rounds as one: the measured steps and phases of
    all rounds pooled (median, min, max over them; each round's median kept in `round_medians`),
    the largest peak RSS per rank; losses, ledgers and model states from the last round (the same
    every round: same seed, same batches)."""
    if len(rows) == 1:
        return rows[0]
    last = rows[-1]
    steps = [t for r in rows for t in r["step_time_s"]["steps"]]
    median = statistics.median(steps)
    return {**last, "rounds": len(rows),
            "step_time_s": {"median": median, "min": min(steps), "max": max(steps), "steps": steps,
                            "round_medians": [r["step_time_s"]["median"] for r in rows]},
            "tokens_per_s": last["tokens_per_step"] / median,
            "peak_rss_mib": [max(ms) for ms in zip(*(r["peak_rss_mib"] for r in rows))],
            "phases_s": {k: [t for r in rows for t in r["phases_s"][k]] for k in last["phases_s"]},
            "wall_s": sum(r.get("wall_s", 0.0) for r in rows)}
