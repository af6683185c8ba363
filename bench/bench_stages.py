"""Benchmark: zeroshard stages 0/1/2 against DDP and ZeroRedundancyOptimizer on 2 local ranks.

    python bench/bench_stages.py                 # "50m" GPT, fp32, the full comparison (~10 min, 2 cores)
    python bench/bench_stages.py --quick         # "mini" GPT smoke run (< 1 min)
    python bench/bench_stages.py --bf16          # bf16 compute (zeroshard: bf16 buckets + fp32 master;
                                                 # baselines: fp32 params under torch.autocast(bf16))

Every variant trains the same GPT (same seed, same synthetic batches, AdamW with the same
hyper-parameters and the same fused CPU kernel) in a fresh pair of spawned processes that
join a gloo group from torchrun's environment variables, one intra-op thread per rank
(the machine the numbers in RESULTS.md come from has 2 cores):

  ddp        torch.nn.parallel.DistributedDataParallel (bucket_cap_mb=25, the default) + AdamW
  zero-red   DDP for gradients + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  zs0/1/2    zeroshard stage 0/1/2, reduce/allgather buckets = 25 MiB (the DDP default) in
             elements of the compute dtype, overlap_comm and contiguous_gradients on
  zs2-ds     stage 2 with DeepSpeed's default bucket sizes (5e8 elements; --no-ds-row skips it)

The whole set runs --rounds times, interleaved (ddp, zero-red, zs0, ..., ddp, ...), and the
measured steps of all rounds are pooled: the machine may be shared, and load from other
programs then hits every variant alike. That load is measured and printed ("other load").

Measured per variant:
  step time     median over the measured steps (after --warmup, all rounds) of rank 0's wall clock for
                zero_grad + forward + backward + optimizer step, no barrier in the loop;
                fwd/bwd/opt are the medians of the three phases alone.
  model states  peak bytes per rank of params + grads + optimizer states.
                zeroshard: memory_stats() peak_params + peak_grads + peak_optimizer_states
                (a sum of per-category peaks, so an upper bound of the simultaneous peak;
                optimizer states include the fp32 master copy; grads include in-flight buckets).
                DDP / ZeroRedundancy: the real tensors: parameters, .grad (after backward),
                optimizer state tensors (after the step).  DDP's reducer buckets
                (gradient_as_bucket_view=False, the default) are a second full gradient-sized
                buffer; they are reported in "+bufs" (with zeroshard's comm_buffers), not in
                "model states".
  peak RSS      resource.getrusage(RUSAGE_SELF).ru_maxrss, the larger of the two ranks.
  comm/step     elements communicated per step in the ZeRO paper's units (all-reduce 2x,
                others 1x) divided by Phi. zeroshard: measured by comm_stats() over the
                measured steps. Baselines: analytic (marked "~"): DDP all-reduces Phi -> 2;
                ZeroRedundancy adds one broadcast of every parameter -> 3.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from zeroshard.bench.ranks import run_ranks  # the one rank spawner: tests and benches

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.01
BUCKET_MB = 25  # DDP's default bucket_cap_mb
DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default reduce/allgather bucket size (elements)
ADAM_FP32_BYTES = 8  # exp_avg + exp_avg_sq


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "ddp", "zero-red", "zs"
    stage: int = -1
    bucket: int | None = None  # zeroshard bucket size in elements (None: 25 MiB of the dtype)


@dataclass
class Result:
    name: str
    params: int = 0
    step_times: list[float] = field(default_factory=list)
    fwd: list[float] = field(default_factory=list)
    bwd: list[float] = field(default_factory=list)
    opt: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    model_state_bytes: int = 0
    buffer_bytes: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)
    rss_bytes: int = 0
    comm_per_step: float | None = None
    comm_detail: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    other_load: list[float] = field(default_factory=list)  # per step: cores used by other programs
    cpu: list[float] = field(default_factory=list)  # per step: rank 0 process CPU seconds (all threads)

    def merge(self, other: "Result") -> None:
        """Add another round of the same variant."""
        for name in ("step_times", "fwd", "bwd", "opt", "other_load", "cpu"):
            getattr(self, name).extend(getattr(other, name))
        self.losses = other.losses
        if other.model_state_bytes > self.model_state_bytes:
            self.model_state_bytes, self.breakdown = other.model_state_bytes, other.breakdown
        self.buffer_bytes = max(self.buffer_bytes, other.buffer_bytes)
        self.rss_bytes = max(self.rss_bytes, other.rss_bytes)
        self.wall_s += other.wall_s


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------

def _batches(args, rank: int, world: int):
    from zeroshard.models import GPT_PRESETS, batch_iterator, synthetic_tokens

    cfg = GPT_PRESETS[args.preset]
    tokens = synthetic_tokens(200_000, cfg.vocab_size, seed=args.seed)
    return batch_iterator(tokens, args.micro_batch, args.seq_len, rank, world, seed=args.seed)


def _model(args):
    import torch

    from zeroshard.models import build_gpt

    torch.manual_seed(args.seed)
    return build_gpt(args.preset)


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _optimizer_state_bytes(optimizer) -> int:
    import torch

    return _tensor_bytes(v for per in optimizer.state.values() for v in per.values()
                         if torch.is_tensor(v) and v.dim() > 0)


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (not idle/iowait), from /proc/stat; 0 if unknown."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _time_loop(args, rank, world, zero_grad, forward, backward, step) -> dict[str, Any]:
    """Warmup + measured steps; every phase timed on this rank with perf_counter, no barrier.

    Per measured step it also returns this process's CPU seconds (all its threads, gloo's
    included) and the machine's busy CPU seconds, so the parent can tell how much CPU other
    programs took during that step."""
    out: dict[str, Any] = {"step": [], "fwd": [], "bwd": [], "opt": [], "loss": [], "cpu": [], "busy": []}
    batches = _batches(args, rank, world)
    for i in range(args.warmup + args.steps):
        x, y = next(batches)
        c0, b0 = time.process_time(), _busy_seconds()
        t0 = time.perf_counter()
        zero_grad()
        loss = forward(x, y)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        out["loss"].append(loss.item())
        if i >= args.warmup:
            out["step"].append(t3 - t0)
            out["fwd"].append(t1 - t0)
            out["bwd"].append(t2 - t1)
            out["opt"].append(t3 - t2)
            out["cpu"].append(time.process_time() - c0)
            out["busy"].append(_busy_seconds() - b0)
    return out


def run_baseline(rank: int, world: int, args, variant: Variant) -> dict[str, Any]:
    import contextlib

    import torch
    import torch.distributed as dist

    from zeroshard.bench import peers

    dist.init_process_group("gloo")
    model = _model(args)
    ddp = peers.ddp(model, bucket_cap_mb=BUCKET_MB)
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if variant.kind == "ddp":
        opt = torch.optim.AdamW(ddp.parameters(), fused=True, **kw)
        inner = opt
    else:
        opt = peers.zero_redundancy(ddp.parameters(), **kw)
        inner = opt.optim
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    grad_bytes = [0]

    def forward(x, y):
        with autocast():
            return ddp(x, y)[1]

    def backward(loss):
        loss.backward()
        grad_bytes[0] = max(grad_bytes[0], _tensor_bytes(p.grad for p in model.parameters()))

    out = _time_loop(args, rank, world, lambda: opt.zero_grad(set_to_none=True), forward, backward, opt.step)
    params = _tensor_bytes(model.parameters())
    states = _optimizer_state_bytes(inner)
    buckets = sum(int(s) for s in str(ddp._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if s)
    out.update(
        params=sum(p.numel() for p in model.parameters()),
        model_state_bytes=params + grad_bytes[0] + states,
        buffer_bytes=buckets,
        breakdown={"params": params, "grads": grad_bytes[0], "optimizer_states": states, "ddp_buckets": buckets},
        comm_per_step=None,
    )
    dist.destroy_process_group()
    return out


def zeroshard_config(args, zero: dict[str, Any]) -> dict[str, Any]:
    """What both benches give zeroshard: the shared AdamW, `zero` as zero_optimization, bf16 if asked."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    return config


def time_zeroshard(rank: int, world: int, args, model, config: dict[str, Any]):
    """initialize() over `model`, the timed loop (the comm ledger counts from the first measured
    step); (the loop's figures with params, comm_per_step and comm_detail; memory_stats())."""
    import zeroshard
    from zeroshard.comm.ledger import PAPER_FACTOR

    if not args.verbose:  # a handler of our own stops initialize() from installing its INFO banner
        zlog = logging.getLogger("zeroshard")
        zlog.addHandler(logging.NullHandler())
        zlog.setLevel(logging.WARNING)
    nparams = sum(p.numel() for p in model.parameters())
    engine = zeroshard.initialize(model, config)
    state = {"n": 0}

    def step():
        engine.step()
        state["n"] += 1
        if state["n"] == args.warmup:
            engine.reset_comm_stats()

    if args.warmup == 0:
        engine.reset_comm_stats()
    out = _time_loop(args, rank, world, lambda: None, lambda x, y: engine(x, y)[1], engine.backward, step)
    mem = engine.memory_stats()
    comm = engine.comm_stats()
    paper = sum(PAPER_FACTOR[op] * s["elements"] for op, s in comm.items())
    out.update(
        params=nparams, comm_per_step=paper / max(1, args.steps) / nparams,
        comm_detail={op: {k: s[k] for k in ("calls", "elements", "seconds")} for op, s in comm.items() if s["calls"]},
    )
    engine.close()
    return out, mem


def run_zeroshard(rank: int, world: int, args, variant: Variant) -> dict[str, Any]:
    itemsize = 2 if args.bf16 else 4
    bucket = variant.bucket or BUCKET_MB * 2**20 // itemsize
    config = zeroshard_config(args, {"stage": variant.stage, "reduce_bucket_size": bucket,
                                     "allgather_bucket_size": bucket, "overlap_comm": True,
                                     "contiguous_gradients": True})
    out, mem = time_zeroshard(rank, world, args, _model(args), config)
    out.update(
        model_state_bytes=mem["peak_params"] + mem["peak_grads"] + mem["peak_optimizer_states"],
        buffer_bytes=mem["peak_comm_buffers"],
        breakdown={k: mem[f"peak_{k}"] for k in ("params", "grads", "optimizer_states", "comm_buffers")},
    )
    return out


def _measured(rank: int, world: int, fn, *payload) -> dict[str, Any]:
    """fn's figures on this rank, with its peak RSS."""
    out = fn(rank, world, *payload)
    out["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return out


def wait_for_quiet(max_wait: float, threshold: float = 0.25, window: float = 2.0) -> float:
    """Wait (at most `max_wait` s) until other programs use under `threshold` cores over `window` s.
    Returns the load of the last window."""
    deadline = time.perf_counter() + max_wait
    while True:
        b0, c0 = _busy_seconds(), time.process_time()
        time.sleep(window)
        load = max(0.0, _busy_seconds() - b0 - (time.process_time() - c0)) / window
        if load < threshold or time.perf_counter() >= deadline:
            return load


def spawn_ranks(fn, payload: tuple, world: int = 2, timeout: float = 900) -> dict[int, dict]:
    """fn(rank, world, *payload) on `world` spawned ranks (zeroshard.bench.ranks, the tests' spawner too, one
    thread each); their results, with peak RSS, by rank."""
    return dict(enumerate(run_ranks(_measured, world, fn, *payload, timeout=timeout)))


def other_load(outs: dict[int, dict]) -> list[float]:
    """Other programs' CPU during step i: the machine's busy seconds on rank 0's clock minus both
    ranks' own CPU in their step i (collectives keep the ranks' steps aligned)."""
    r0 = outs[0]
    return [max(0.0, busy - c0 - c1) / wall if busy else float("nan")
            for busy, c0, c1, wall in zip(r0["busy"], r0["cpu"], outs[1]["cpu"], r0["step"])]


def run_variant(args, variant: Variant, world: int = 2, timeout: float = 900) -> Result:
    started = time.perf_counter()
    outs = spawn_ranks(run_zeroshard if variant.kind == "zs" else run_baseline, (args, variant), world, timeout)
    r0 = outs[0]
    other = other_load(outs)
    return Result(
        name=variant.name, params=r0["params"], step_times=r0["step"], fwd=r0["fwd"], bwd=r0["bwd"],
        opt=r0["opt"], losses=r0["loss"],
        model_state_bytes=max(o["model_state_bytes"] for o in outs.values()),
        buffer_bytes=max(o["buffer_bytes"] for o in outs.values()),
        breakdown=r0["breakdown"], rss_bytes=max(o["rss_bytes"] for o in outs.values()),
        comm_per_step=r0["comm_per_step"], comm_detail=r0.get("comm_detail", {}),
        wall_s=time.perf_counter() - started, other_load=other, cpu=r0["cpu"],
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

LOAD_LIMIT = 0.25  # a step during which other programs used more CPU cores than this is "contended"


def clean(r: Result, values: list[float]) -> tuple[list[float], bool]:
    """The values of the uncontended steps; all of them (and False) if fewer than 3 are clean."""
    keep = [v for v, load in zip(values, r.other_load) if load < LOAD_LIMIT]
    return (keep, True) if len(keep) >= 3 else (list(values), False)


def median_step(r: Result) -> float:
    return statistics.median(clean(r, r.step_times)[0])


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _source_version() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def report(args, results: list[Result], total_s: float, world: int = 2) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    by = {r.name: r for r in results}
    ddp = by["ddp"]
    phi = ddp.params
    base_t = median_step(ddp)
    base_m = ddp.model_state_bytes

    title = (f"zeroshard vs DDP / ZeroRedundancyOptimizer - GPT '{args.preset}' (Phi = {phi:,}), "
             f"{'bf16' if args.bf16 else 'fp32'}, {world} gloo ranks x 1 thread, micro-batch {args.micro_batch} "
             f"x seq {args.seq_len}, AdamW (fused), {args.warmup} warmup + {args.steps} measured steps "
             f"x {args.rounds} round(s)")
    table = Table(title=title, title_justify="left")
    for col, just in [("variant", "left"), ("step s (median)", "right"), ("x DDP", "right"),
                      ("clean steps", "right"), ("min s", "right"), ("x DDP (min)", "right"),
                      ("model states MiB", "right"), ("x DDP", "right"),
                      ("+bufs MiB", "right"), ("peak RSS MiB", "right"), ("comm/step (xPhi)", "right"),
                      ("last loss", "right"), ("other load max", "right")]:
        table.add_column(col, justify=just)
    for r in results:
        t = median_step(r)
        n_clean = sum(load < LOAD_LIMIT for load in r.other_load)
        ok = clean(r, r.step_times)[1]
        comm = (f"{r.comm_per_step:.4f}" if r.comm_per_step is not None
                else {"ddp": "~2 (analytic)", "zero-red": "~3 (analytic)"}.get(r.name, "-"))
        table.add_row(r.name, f"{t:.3f}" + ("" if ok else "*"), f"{t / base_t:.3f}",
                      f"{n_clean}/{len(r.step_times)}", f"{min(r.step_times):.3f}",
                      f"{min(r.step_times) / min(ddp.step_times):.3f}",
                      _mib(r.model_state_bytes), f"{r.model_state_bytes / base_m:.3f}",
                      _mib(r.model_state_bytes + r.buffer_bytes), _mib(r.rss_bytes), comm, f"{r.losses[-1]:.4f}",
                      f"{max(r.other_load):.2f}")
    console.print(table)

    detail = Table(title="per variant: step phases and rank 0's CPU seconds per step (all its threads), medians of "
                         "the clean steps; memory per rank (MiB, peaks); zeroshard collectives over all measured steps",
                   title_justify="left")
    for col in ("variant", "fwd / bwd / opt s", "CPU s/step", "x DDP", "params", "grads", "optimizer states", "buffers",
                "collectives (calls, elements, s issue->wait)"):
        detail.add_column(col, justify="left" if col in ("variant",) or col.startswith("coll") else "right")
    for r in results:
        b = r.breakdown
        bufs = b.get("ddp_buckets", b.get("comm_buffers", 0))
        coll = "; ".join(f"{op} {d['calls']}x {d['elements']:,} {d['seconds']:.2f}s" for op, d in r.comm_detail.items())
        phases = "/".join(f"{statistics.median(clean(r, x)[0]):.3f}" for x in (r.fwd, r.bwd, r.opt))
        cpu = statistics.median(clean(r, r.cpu)[0])
        detail.add_row(r.name, phases, f"{cpu:.3f}", f"{cpu / statistics.median(clean(ddp, ddp.cpu)[0]):.3f}",
                       _mib(b["params"]), _mib(b["grads"]), _mib(b["optimizer_states"]), _mib(bufs), coll or "-")
    console.print(detail)

    # Targets (issue 2).
    dtype_bytes = 2 if args.bf16 else 4
    if args.bf16:
        # baselines keep fp32 params/grads/Adam (autocast); zeroshard: 2 + 2 + (4 master + 8) per param
        ddp_formula = (4 + 4 + ADAM_FP32_BYTES) * phi
        zs2_formula = dtype_bytes * phi + (dtype_bytes + 4 + ADAM_FP32_BYTES) * phi / world
        formula_txt = (f"DDP(autocast) 16*Phi; zeroshard stage 2 (bf16) 2*Phi + (2 + 4 master + 8)*Phi/{world}")
    else:
        ddp_formula = (4 + 4 + ADAM_FP32_BYTES) * phi
        zs2_formula = 4 * phi + (4 + 4 + ADAM_FP32_BYTES) * phi / world
        formula_txt = f"DDP 4*Phi + 4*Phi + 8*Phi = 16*Phi; zeroshard stage 2 4*Phi + (4 + 4 master + 8)*Phi/{world}"
    saving = ddp_formula - zs2_formula

    targets = Table(title="targets (issue 2)", title_justify="left")
    for col in ("target", "measured", "result"):
        targets.add_column(col)

    def verdict(ok: bool) -> str:
        return "[green]PASS[/green]" if ok else "[red]MISS[/red]"

    for name, limit in (("zs0", 1.05), ("zs1", 1.10), ("zs2", 1.10)):
        if name in by:
            ratio = median_step(by[name]) / base_t
            contended = not (clean(by[name], by[name].step_times)[1] and clean(ddp, ddp.step_times)[1])
            targets.add_row(f"{name} step time <= {limit:.2f} x DDP",
                            f"{ratio:.3f} x" + (" (contended steps: unreliable)" if contended else ""),
                            verdict(ratio <= limit))
    if "zs2" in by:
        zs2 = by["zs2"]
        got_b = (base_m + ddp.buffer_bytes) - (zs2.model_state_bytes + zs2.buffer_bytes)
        targets.add_row(
            f"zs2 model states below DDP by >= formula saving {_mib(int(saving))} MiB ({saving / phi:.1f}*Phi); "
            "all gradient storage counted (DDP: .grad + reducer buckets, its default)",
            f"DDP {_mib(base_m + ddp.buffer_bytes)} - zs2 {_mib(zs2.model_state_bytes + zs2.buffer_bytes)} "
            f"= {_mib(got_b)} MiB", verdict(got_b >= saving))
        got = base_m - zs2.model_state_bytes
        targets.add_row(
            "  same, DDP's .grad only (= DDP footprint with gradient_as_bucket_view=True)",
            f"DDP {_mib(base_m)} - zs2 {_mib(zs2.model_state_bytes)} = {_mib(got)} MiB", verdict(got >= saving))
    console.print(targets)
    console.print(f"formula (bytes per rank, N={world}): {formula_txt}: DDP {_mib(int(ddp_formula))} MiB, "
                  f"zs2 {_mib(int(zs2_formula))} MiB, saving {_mib(int(saving))} MiB")
    bucket = BUCKET_MB * 2**20 // dtype_bytes
    console.print(f"buckets: DDP bucket_cap_mb={BUCKET_MB} (first bucket 1 MiB); zeroshard reduce/allgather_bucket_size="
                  f"{bucket:,} elements (= {BUCKET_MB} MiB of {'bf16' if args.bf16 else 'fp32'})"
                  + (f"; zs2-ds: {DS_DEFAULT_BUCKET:,} elements (DeepSpeed default)" if "zs2-ds" in by else ""))
    console.print("per-variant wall (incl. process start): "
                  + ", ".join(f"{r.name} {r.wall_s:.0f}s" for r in results))
    console.print(f"clean steps: measured steps during which other programs used < {LOAD_LIMIT} CPU cores "
                  f"(from /proc/stat; this machine has {os.cpu_count()} cores and the ranks need both); step times, "
                  "ratios and phases are medians over clean steps only ('*': fewer than 3 clean, all steps used).")
    console.print(f"total run time: {total_s:.1f} s   (torch {torch.__version__}, python {platform.python_version()}, "
                  f"{os.cpu_count()} CPUs, zeroshard at {_source_version()}, "
                  f"{datetime.datetime.now().isoformat(timespec='seconds')})")


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """Options both benches share (the model, the batch, the smoke run)."""
    ap.add_argument("--preset", default="50m", help="GPT preset (tiny, mini, small, 50m)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per round")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (see module docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 'mini' preset, seq 64, 1 warmup + 3 steps")


def parse_common(ap: argparse.ArgumentParser, argv: list[str] | None):
    """Parse, apply --quick, check the counts."""
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.seq_len, args.warmup, args.steps, args.rounds = "mini", 64, 1, 3, 1
        args.quiet_wait = 0.0
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(ap)
    ap.add_argument("--rounds", type=int, default=3,
                    help="repeat the whole set of variants this many times, interleaved; steps of all rounds pooled")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each variant, wait up to this many seconds for other programs to go quiet")
    ap.add_argument("--no-ds-row", dest="ds_default_row", action="store_false",
                    help="skip the extra stage-2 row with DeepSpeed's default bucket sizes (5e8 elements)")
    ap.add_argument("--only", default="", help="comma-separated subset of variants (ddp is always run)")
    ap.add_argument("--verbose", action="store_true", help="show zeroshard's start-up banner")
    args = parse_common(ap, argv)

    variants = [Variant("ddp", "ddp"), Variant("zero-red", "zero-red"),
                Variant("zs0", "zs", 0), Variant("zs1", "zs", 1), Variant("zs2", "zs", 2)]
    if args.ds_default_row:
        variants.append(Variant("zs2-ds", "zs", 2, DS_DEFAULT_BUCKET))
    if args.only:
        keep = set(args.only.split(",")) | {"ddp"}
        variants = [v for v in variants if v.name in keep]

    started = time.perf_counter()
    results: dict[str, Result] = {}
    for rnd in range(args.rounds):  # interleaved rounds: load from other programs hits every variant alike
        for v in variants:
            load = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else float("nan")
            print(f"[bench] round {rnd + 1}/{args.rounds} {v.name} (other programs: {load:.2f} cores) ...",
                  file=sys.stderr, flush=True)
            r = run_variant(args, v)
            print(f"[bench] {v.name}: steps (s @ other-program cores) "
                  f"{', '.join(f'{t:.3f}@{o:.2f}' for t, o in zip(r.step_times, r.other_load))}, "
                  f"{r.wall_s:.0f}s wall", file=sys.stderr, flush=True)
            if v.name in results:
                results[v.name].merge(r)
            else:
                results[v.name] = r
    report(args, list(results.values()), time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
