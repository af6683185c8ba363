"""Benchmark: zeroshard ZeRO stage 3 beside PyTorch FSDP2 (`fully_shard`) on 2 local ranks
(issue 3's targets). A preset of `zeroshard bench` (the package `zeroshard.bench`): its systems,
runners, torchrun jobs and measurements; this file picks them and prints the comparison.

    python bench/bench_stage3.py              # "50m" GPT, fp32, 3 interleaved rounds (~5-10 min, 2 cores)
    python bench/bench_stage3.py --quick      # "mini" GPT smoke run (< 1 min)
    python bench/bench_stage3.py --bf16       # zeroshard "bf16": {"enabled": true} (bf16 units, fp32 master)
                                              # vs FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    python bench/bench_stage3.py --paper      # also zs3: units released after use, no persistence

Systems (`zeroshard bench --list`), each its own torchrun job of 2 gloo ranks x 1 thread on the
same GPT, seed, batches and AdamW(fused) as bench_stages.py:

  fsdp2      torch.distributed.fsdp.fully_shard on every Block, then on the root (reshard_after_forward
             defaults: blocks resharded, root kept), AdamW(fused) over the sharded DTensor parameters.
  zs3_fsdp2  zeroshard stage 3, units = Blocks (+ the root's own parameters as one unit), AdamW(fused)
             over fp32 master shards, on FSDP2's schedule: prefetch one Block ahead
             (stage3_prefetch_bucket_size = one Block's elements), keep a Block that is reused within one
             Block (stage3_max_reuse_distance: the last Block between forward and backward), persistence
             threshold DeepSpeed's 1e5.
  zs3        (with --paper) stage 3 as the ZeRO paper: reuse distance 0, persistence 0.

The whole set runs --rounds times, interleaved (fsdp2, zs3_fsdp2, fsdp2, ...); each system's
measured steps of all rounds are pooled (`zeroshard bench --rounds`).

Measured per system (zeroshard.bench's worker and results; the larger of the two ranks):
  step time      per measured step the slowest rank's wall clock from a barrier to the end of the
                 optimizer step; the median over all rounds. fwd/bwd/opt: rank 0's phases.
  model states   PEAK params + grads + optimizer states:
                 zs3:   the memory ledger's simultaneous peak over the measured steps: gathered (full)
                        unit buffers, full unit gradient buffers in flight; in fp32 the parameter shard is
                        the master (no second copy).
                 fsdp2: its real tensors (sharded parameters' and .grad's local tensors, optimizer states)
                        plus the peak of its transient unsharded parameters and gradients with the flat
                        all-gather output / reduce-scatter input, sampled in one untimed step after the
                        measured ones (`zeroshard.bench.fsdp2_peak`: at every module's forward entry and
                        exit, after every unsharded gradient is accumulated, at every collective).
                 "at rest" is the same without transients.
  peak RSS       the kernel's high-water mark per rank over the measured steps.
  comm/step      elements per step in the ZeRO paper's units (all-reduce 2x) / Phi: zs3 from comm_stats();
                 fsdp2 by counting the torch.distributed calls FSDP2 makes in that untimed step. Analytic: 3 Phi.
Targets (issue 3): stage 3 step time at or below FSDP2's; peak model states at or below FSDP2's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_stages import add_common_arguments, comm, footer, median, mib, run_preset, states, verdict  # noqa: E402

ZS3 = "zs3_fsdp2"


def report(args: argparse.Namespace, run: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    rows = run["rows"]
    fs = rows["fsdp2"]
    base_t, base_m, base_rest = fs["step_time_s"]["median"], states(fs), states(fs, peak=False)
    table = Table(title="stage 3 vs FSDP2: medians over all rounds' steps; memory the larger rank",
                  title_justify="left")
    for col in ("system", "step s", "x FSDP2", "min s", "x FSDP2 (min)", "fwd / bwd / opt s", "peak model states MiB",
                "x FSDP2", "at rest MiB", "x FSDP2", "peak RSS MiB (r0/r1)", "x FSDP2", "comm/step (xPhi)", "last loss"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in rows.items():
        st = r["step_time_s"]
        table.add_row(name, f"{st['median']:.3f}", f"{st['median'] / base_t:.3f}", f"{st['min']:.3f}",
                      f"{st['min'] / fs['step_time_s']['min']:.3f}",
                      "/".join(f"{median(r['phases_s'][k]):.3f}" for k in ("fwd", "bwd", "opt")),
                      mib(states(r)), f"{states(r) / base_m:.3f}", mib(states(r, peak=False)),
                      f"{states(r, peak=False) / base_rest:.3f}", "/".join(f"{m:,.0f}" for m in r["peak_rss_mib"]),
                      f"{max(r['peak_rss_mib']) / max(fs['peak_rss_mib']):.3f}", comm(r, {}), f"{r['losses'][-1]:.4f}")
    console.print(table)
    p = fs["peer_peak"][0]
    console.print(f"fsdp2 transients (rank 0, MiB): unsharded params peak {mib(p['unsharded_params'])}, unsharded grads "
                  f"peak {mib(p['unsharded_grads'])}, together {mib(p['unsharded_sum'])}; collectives in one step: "
                  + "; ".join(f"{n} {c['calls']}x {c['elements']:,}" for n, c in p["collectives"].items()),
                  highlight=False)
    if ZS3 in rows:
        zs = rows[ZS3]
        knobs = {k.removeprefix("stage3_"): v for k, v in zs["config"]["zero_optimization"].items() if "stage3" in k}
        console.print(f"{ZS3} settings: " + ", ".join(f"{k}={v:,}" for k, v in knobs.items()), highlight=False)
        targets = Table(title="targets (issue 3)", title_justify="left")
        for col in ("target", "measured", "result"):
            targets.add_column(col)
        ratio = zs["step_time_s"]["median"] / base_t
        targets.add_row("zs3 step time <= FSDP2 (median)", f"{zs['step_time_s']['median']:.3f} / {base_t:.3f} s = "
                        f"{ratio:.3f} x", verdict(ratio <= 1.0))
        mratio = states(zs) / base_m
        targets.add_row("zs3 peak model-state memory <= FSDP2", f"{mib(states(zs))} / {mib(base_m)} MiB = {mratio:.3f} x",
                        verdict(mratio <= 1.0))
        console.print(targets)
    n, phi = 2, run["phi"]
    held = ("zs3 (2 param + 2 grad + 4 fp32 master + 8 Adam), FSDP2 (4 fp32 param + 4 grad + 8 Adam)" if args.bf16
            else "both (4 param + 4 grad + 8 Adam)")
    console.print(f"formula, at rest (bytes per rank): {held} Phi/{n} = 16 Phi/{n} = {mib(16 * phi // n)} MiB; plus "
                  "persisted small params (zs3) and padding.", highlight=False)
    footer(console, args, run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(ap, rounds=3)
    ap.add_argument("--paper", action="store_true", help="also run zs3 (units released after use, no persistence)")
    args = ap.parse_args(argv)
    run = run_preset(args, ["fsdp2", ZS3] + (["zs3"] if args.paper else []), baseline="fsdp2")
    if run is None:
        return 1
    report(args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
