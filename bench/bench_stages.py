"""Benchmark: zeroshard stages 0/1/2 against DDP and ZeroRedundancyOptimizer on 2 local ranks
(issue 2's targets). A preset of `zeroshard bench` (the package `zeroshard.bench`): its systems,
runners, torchrun jobs and measurements; this file picks them and prints the comparison.

    python bench/bench_stages.py                 # "50m" GPT, fp32, 3 interleaved rounds (~10 min, 2 cores)
    python bench/bench_stages.py --quick         # "mini" GPT smoke run (< 2 min)
    python bench/bench_stages.py --bf16          # bf16 compute (zeroshard: bf16 buckets + fp32 master;
                                                 # DDP / ZeroRedundancy: fp32 params under torch.autocast(bf16))
    python bench/bench_stages.py --rounds 2 --only zs2,zs2_ds --out /tmp/stages

Systems (`zeroshard bench --list` describes them), each its own torchrun job of 2 gloo ranks x 1
thread on the same GPT (same seed, same batches, AdamW with the fused CPU kernel):

  ddp          torch DistributedDataParallel (bucket_cap_mb=25, gradient_as_bucket_view=True) + AdamW
  zero1_torch  DDP for gradients + torch ZeroRedundancyOptimizer(AdamW)
  zs0/1/2      zeroshard stage 0/1/2 with its defaults: reduce/allgather buckets of 25 MiB of the reduce
               dtype (DDP's bucket cap; at most a quarter of the model), overlap_comm and contiguous_gradients
  zs2_ds       stage 2 with DeepSpeed's default bucket sizes (5e8 elements; --no-ds-row skips it)

The whole set runs --rounds times, interleaved (ddp, zero1_torch, zs0, ..., ddp, ...), and each
system's measured steps of all rounds are pooled (`zeroshard bench --rounds`): load from other
programs then falls on every system alike.

Measured per system (zeroshard.bench's worker and results; the JSON lands in --out):
  step time     per measured step the slowest rank's wall clock from a barrier to the end of the
                optimizer step; the median over all rounds' steps. fwd/bwd/opt: rank 0's phases.
  model states  zeroshard: the memory ledger's simultaneous peak of params + grads + optimizer
                states over the measured steps (fp32 master included; grads include buckets in
                flight), and the same at rest. DDP / ZeroRedundancy: their real tensors after a
                backward and after a step, each storage once (gradient_as_bucket_view=True, so DDP's
                reducer buckets are its .grad: no second gradient copy).
  peak RSS      the kernel's high-water mark per rank over the measured steps.
  comm/step     zeroshard: comm_stats() per measured step in the ZeRO paper's units (all-reduce 2x)
                over Phi. DDP ~2, ZeroRedundancy ~3 (analytic; their collectives are not counted).
Targets (issue 2): zs0 <= 1.05x DDP's step time, zs1 and zs2 <= 1.10x; zs2's peak model states
below DDP's by at least the formula's saving (16 Phi for DDP against 4 Phi + 12 Phi/N for stage 2,
K = 12 as in the ZeRO paper).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

ADAM_FP32_BYTES = 8  # exp_avg + exp_avg_sq
SYSTEMS = ["ddp", "zero1_torch", "zs0", "zs1", "zs2", "zs2_ds"]
TARGETS = {"zs0": 1.05, "zs1": 1.10, "zs2": 1.10}


def add_common_arguments(ap: argparse.ArgumentParser, rounds: int) -> None:
    """The options both presets share (the model, the batch, the rounds, the smoke run)."""
    ap.add_argument("--preset", default="50m", help="GPT preset (tiny, mini, small, 50m, ...)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per round")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--rounds", type=int, default=rounds,
                    help="run the whole set of systems this many times, interleaved; steps of all rounds pooled")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (see the module docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated subset of the systems (the baseline always runs)")
    ap.add_argument("--out", default=None, help="folder for bench.json and the jobs' logs (default: a temp folder)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 'mini' preset, seq 64, 1 warmup + 3 steps, 1 round")


def run_preset(args: argparse.Namespace, systems: list[str], baseline: str) -> dict | None:
    """`systems` (less those --only leaves out) through `zeroshard bench`; the model's run, or None."""
    from zeroshard.bench.command import run_preset as bench
    from zeroshard.bench.report import system_table
    from rich.console import Console

    if args.quick:
        args.preset, args.seq_len, args.warmup, args.steps, args.rounds = "mini", 64, 1, 3, 1
    if args.only:
        keep = set(args.only.split(",")) | {baseline}
        systems = [s for s in systems if s in keep]
    args.out = args.out or tempfile.mkdtemp(prefix="zeroshard_preset_")
    argv = ["--model", args.preset, "--systems", ",".join(systems), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--seq-len", str(args.seq_len),
            "--micro-batch", str(args.micro_batch), "--seed", str(args.seed), "--nproc", "2", "--threads", "1",
            "--out", args.out] + (["--bf16"] if args.bf16 else [])
    started = time.perf_counter()
    code, result = bench(argv)
    if result is None or code != 0:
        return None
    run = next(iter(result["runs"].values()))
    Console(width=200).print(system_table(run))
    run["total_s"] = time.perf_counter() - started
    return run


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def states(row: dict, peak: bool = True) -> int:
    """Model-state bytes, the larger rank: zeroshard's ledger (simultaneous peak or at rest);
    a peer's counted tensors (FSDP2: plus its sampled transients when `peak`)."""
    if "ledger" in row:
        return max(m["peak_model_states" if peak else "model_states"] for m in row["ledger"]["memory"])
    rest = max(sum(s.values()) for s in row["model_states"])
    if peak and "peer_peak" in row:
        return max(p["peak_model_states"] for p in row["peer_peak"])
    return rest


def comm(row: dict, analytic: dict[str, str]) -> str:
    if "ledger" in row:
        return f"{row['ledger']['phi_per_step']:.4f}"
    if "peer_peak" in row:
        return f"~{row['peer_peak'][0]['paper_elements'] / row['phi']:.4f} (one step)"
    return analytic.get(row["system"], "-")


def verdict(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]MISS[/red]"


def footer(console, args, run: dict) -> None:
    import torch

    console.print(f"GPT '{args.preset}' (Phi = {run['phi']:,}), {'bf16' if args.bf16 else 'fp32'}, 2 gloo ranks x 1 "
                  f"thread, micro-batch {args.micro_batch} x seq {args.seq_len}, AdamW (fused), {args.warmup} warmup + "
                  f"{args.steps} measured steps x {args.rounds} interleaved round(s); per-system wall: "
                  + ", ".join(f"{n} {r['wall_s']:.0f}s" for n, r in run["rows"].items()), highlight=False)
    console.print(f"total run time: {run['total_s']:.1f} s (torch {torch.__version__}, python "
                  f"{platform.python_version()}, {os.cpu_count()} CPUs); bench.json and logs in {args.out}",
                  highlight=False)


def report(args: argparse.Namespace, run: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    rows, world = run["rows"], 2
    ddp = rows["ddp"]
    phi, base_t, base_m = run["phi"], ddp["step_time_s"]["median"], states(ddp)
    table = Table(title="stages 0/1/2 vs DDP: medians over all rounds' steps; model states the larger rank",
                  title_justify="left")
    for col in ("system", "step s", "x DDP", "min s", "x DDP (min)", "fwd / bwd / opt s", "peak model states MiB",
                "x DDP", "at rest MiB", "peak RSS MiB", "comm/step (xPhi)", "last loss"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in rows.items():
        st = r["step_time_s"]
        table.add_row(name, f"{st['median']:.3f}", f"{st['median'] / base_t:.3f}", f"{st['min']:.3f}",
                      f"{st['min'] / ddp['step_time_s']['min']:.3f}",
                      "/".join(f"{median(r['phases_s'][k]):.3f}" for k in ("fwd", "bwd", "opt")),
                      mib(states(r)), f"{states(r) / base_m:.3f}", mib(states(r, peak=False)),
                      "/".join(f"{m:,.0f}" for m in r["peak_rss_mib"]),
                      comm(r, {"ddp": "~2 (analytic)", "zero1_torch": "~3 (analytic)"}), f"{r['losses'][-1]:.4f}")
    console.print(table)

    # the formula of issue 2 (K = 12: the ZeRO paper's fp32 master + Adam), bytes per rank
    ddp_formula = (4 + 4 + ADAM_FP32_BYTES) * phi  # DDP keeps fp32 params, grads, Adam (also under autocast)
    item = 2 if args.bf16 else 4
    zs2_formula = item * phi + (item + 4 + ADAM_FP32_BYTES) * phi / world
    saving = ddp_formula - zs2_formula
    targets = Table(title="targets (issue 2)", title_justify="left")
    for col in ("target", "measured", "result"):
        targets.add_column(col)
    for name, limit in TARGETS.items():
        if name in rows:
            ratio = rows[name]["step_time_s"]["median"] / base_t
            targets.add_row(f"{name} step time <= {limit:.2f} x DDP", f"{ratio:.3f} x", verdict(ratio <= limit))
    if "zs2" in rows:
        got = base_m - states(rows["zs2"])
        targets.add_row(f"zs2 peak model states below DDP's by >= the formula's saving {mib(saving)} MiB "
                        f"({saving / phi:.1f} Phi)", f"DDP {mib(base_m)} - zs2 {mib(states(rows['zs2']))} = "
                        f"{mib(got)} MiB", verdict(got >= saving))
    console.print(targets)
    console.print(f"formula (bytes per rank, N={world}): DDP (4 + 4 + 8) Phi = {mib(ddp_formula)} MiB; zeroshard stage 2 "
                  f"{item} Phi + ({item} + 4 master + 8) Phi/{world} = {mib(zs2_formula)} MiB"
                  + ("" if args.bf16 else " (in fp32 zeroshard steps the parameter shard itself: no master copy, "
                     "so it holds less than this)"), highlight=False)
    footer(console, args, run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(ap, rounds=3)
    ap.add_argument("--no-ds-row", dest="ds_row", action="store_false",
                    help="skip zs2_ds (stage 2 with DeepSpeed's default 5e8-element buckets)")
    args = ap.parse_args(argv)
    systems = SYSTEMS if args.ds_row else [s for s in SYSTEMS if s != "zs2_ds"]
    run = run_preset(args, systems, baseline="ddp")
    if run is None:
        return 1
    report(args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
