"""Benchmark: zeroshard ZeRO stage 3 beside PyTorch FSDP2 (`fully_shard`) on 2 local ranks.

    python bench/bench_stage3.py              # "50m" GPT, fp32, 3 interleaved rounds (~5-10 min, 2 cores)
    python bench/bench_stage3.py --quick      # "mini" GPT smoke run (< 1 min)
    python bench/bench_stage3.py --bf16       # zeroshard "bf16": {"enabled": true} (bf16 units, fp32 master)
                                              # vs FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)

Both variants train the same GPT as bench_stages.py (same preset, seed, synthetic batches, AdamW
hyper-parameters) in a fresh pair of spawned processes that join a gloo group from torchrun's
environment variables, one intra-op thread per rank. The process plumbing, the timing loop
(`_time_loop`), the contention filter (`clean`, "other load" from /proc/stat) and the quiet-wait
are imported from bench_stages.py (not copied); the per-variant rank functions, the spawner and
the report are this file's own.

  fsdp2  torch.distributed.fsdp.fully_shard on every Block, then on the root (reshard_after_forward
         defaults: blocks resharded, root kept), AdamW(fused) over the sharded DTensor parameters.
  zs3    zeroshard stage 3, units = Blocks (+ the root's own parameters as one unit), AdamW(fused) over
         fp32 master shards. Prefetch and reuse are set to match FSDP2's schedule: prefetch one Block
         ahead (stage3_prefetch_bucket_size = one Block's elements), keep a Block that is reused within
         one Block (the last Block between forward and backward); see --prefetch/--reuse/--max-live.

The whole set runs --rounds times, interleaved (fsdp2, zs3, fsdp2, ...); the measured steps of all
rounds are pooled, and steps during which other programs used >= 0.25 cores are dropped (if >= 3 remain).

Measured per variant (per rank; the larger of the two ranks):
  step time      median of rank 0's wall clock of zero_grad + forward + backward + step, no barrier.
  model states   PEAK params + grads + optimizer states:
                 zs3:   memory_stats()["peak_model_states"]: the largest params + grads + optimizer
                        states held at one moment (the ledger updates it on every allocation). params
                        include the gathered (full) unit buffers; grads the full unit gradient buffers
                        in flight; in fp32 the parameter shard is the master (no second copy).
                 fsdp2: its real tensors: sharded parameters' local tensors + sharded .grad local tensors
                        + optimizer state tensors (after the step), plus the peak of the transient
                        unsharded parameters and unsharded gradients, with the flat all-gather output /
                        reduce-scatter input at each collective call, sampled at every module's forward
                        entry/exit, after every unsharded gradient is accumulated, and at every collective.
                 "at rest" is the same without transients (after the optimizer step).
  peak RSS       resource.getrusage(RUSAGE_SELF).ru_maxrss (includes building the full model once).
  comm/step      elements per step in the ZeRO paper's units (all-reduce 2x) / Phi, measured for both:
                 zs3 from comm_stats(); fsdp2 by counting torch.distributed.all_gather_single /
                 reduce_scatter_single / all_reduce calls (the functions FSDP2 calls). Analytic: 3 Phi.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also in the spawned children

from bench_stages import (  # noqa: E402  (shared helpers of the stage 0/1/2 bench, imported as they are)
    BETAS, EPS, LOAD_LIMIT, LR, WEIGHT_DECAY, Result, _mib, _model,
    _source_version, _time_loop, clean, median_step, other_load, spawn_ranks, time_zeroshard, wait_for_quiet,
    zeroshard_config, add_common_arguments, parse_common,
)

# ---------------------------------------------------------------------------------------------
# FSDP2 rank
# ---------------------------------------------------------------------------------------------


def _count_collectives(counts: dict[str, list[int]], on_call=None):
    """Wrap the torch.distributed functions FSDP2 calls so each call's logical elements are counted;
    `on_call(name, flat_buffer)` sees the flat all-gather output / reduce-scatter input at each call."""
    import torch.distributed as dist

    def wrap(name, buffer_of):
        fn = getattr(dist, name)

        def counted(*a, **kw):
            buf = buffer_of(*a, **kw)
            c = counts.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += buf.numel()
            if on_call is not None:
                on_call(name, buf)
            return fn(*a, **kw)

        setattr(dist, name, counted)

    wrap("all_gather_single", lambda output_tensor, *a, **kw: output_tensor)
    wrap("reduce_scatter_single", lambda *a, **kw: kw["input"] if "input" in kw else a[1])
    wrap("all_reduce", lambda tensor, *a, **kw: tensor)


FSDP2_PAPER = {"all_gather_single": 1, "reduce_scatter_single": 1, "all_reduce": 2}


def _local_bytes(tensors) -> int:
    """Bytes of the local tensors (DTensor -> to_local()), each storage counted once. (bench_stages'
    `_tensor_bytes` dedupes by id(), which is unsafe for the temporaries `to_local()` returns.)"""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def run_fsdp2(rank: int, world: int, args) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState  # noqa: F401 (version check)

    from zeroshard.bench import peers

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    model = _model(args)
    nparams = sum(p.numel() for p in model.parameters())
    peers.fsdp2(model, ["Block"], args.bf16, reduce_dtype=torch.bfloat16, mesh=mesh)  # each block, then the root
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    try:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
        fused = "fused"
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), foreach=True, **kw)
        fused = "foreach"

    # Transient model states: FSDP2's unsharded parameters and gradients (one per FSDPParam).
    fsdp_params = []
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            fsdp_params.extend(group.fsdp_params)

    def live_unsharded() -> tuple[int, int]:
        pbytes = gbytes = 0
        seen = set()
        for fp in fsdp_params:
            up = getattr(fp, "_unsharded_param", None)
            if up is None:
                continue
            st = up.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                pbytes += st.nbytes()
            if up.grad is not None:
                gbytes += up.grad.untyped_storage().nbytes()
        return pbytes, gbytes

    peak = {"params": 0, "grads": 0, "sum": 0}

    def sample(*_, flat_params: int = 0, flat_grads: int = 0):
        p, g = live_unsharded()
        p, g = p + flat_params, g + flat_grads
        peak["params"], peak["grads"] = max(peak["params"], p), max(peak["grads"], g)
        peak["sum"] = max(peak["sum"], p + g)

    def on_collective(name, buf):  # FSDP2's flat all-gather output / reduce-scatter input coexist
        nbytes = buf.numel() * buf.element_size()  # with the unsharded tensors at the call
        if name == "all_gather_single":
            sample(flat_params=nbytes)
        elif name == "reduce_scatter_single":
            sample(flat_grads=nbytes)

    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, a: sample())
        m.register_forward_hook(lambda mod, a, o: sample())
    hooked: set[int] = set()

    def hook_unsharded_grads() -> None:  # the unsharded Parameters exist after the first forward
        for fp in fsdp_params:
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and id(up) not in hooked:
                hooked.add(id(up))
                up.register_post_accumulate_grad_hook(sample)

    counts: dict[str, list[int]] = {}
    _count_collectives(counts, on_collective)
    grad_bytes = [0]

    def forward(x, y):
        loss = model(x, y)[1]
        hook_unsharded_grads()
        return loss

    def backward(loss):
        loss.backward()
        grad_bytes[0] = max(grad_bytes[0], _local_bytes(p.grad for p in model.parameters()))

    state = {"n": 0}

    def step():
        opt.step()
        state["n"] += 1
        if state["n"] == args.warmup:
            counts.clear()

    out = _time_loop(args, rank, world, lambda: opt.zero_grad(set_to_none=True), forward, backward, step)
    params = _local_bytes(model.parameters())
    states = _local_bytes(v for per in opt.state.values() for v in per.values() if torch.is_tensor(v) and v.dim() > 0)
    at_rest = params + grad_bytes[0] + states
    paper = sum(FSDP2_PAPER[op] * c[1] for op, c in counts.items())
    out.update(
        params=nparams,
        model_state_bytes=at_rest + peak["sum"],
        rest_bytes=at_rest,
        buffer_bytes=0,
        breakdown={"params": params + peak["params"], "grads": grad_bytes[0] + peak["grads"],
                   "optimizer_states": states, "sharded params": params, "sharded grads": grad_bytes[0],
                   "unsharded params peak": peak["params"], "unsharded grads peak": peak["grads"],
                   "unsharded sum peak": peak["sum"]},
        comm_per_step=paper / max(1, args.steps) / nparams,
        comm_detail={op: {"calls": c[0], "elements": c[1], "seconds": float("nan")} for op, c in counts.items()},
        note=f"AdamW {fused}",
    )
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------
# zeroshard stage 3 rank
# ---------------------------------------------------------------------------------------------

def stage3_knobs(args, block_numel: int) -> dict[str, int]:
    def pick(value, default):
        return int(value) if value is not None else int(default)
    return {
        "stage3_prefetch_bucket_size": pick(args.prefetch, block_numel * args.prefetch_units),
        "stage3_max_reuse_distance": pick(args.reuse, block_numel),
        "stage3_max_live_parameters": pick(args.max_live, 1_000_000_000),
        "stage3_param_persistence_threshold": pick(args.persistence, 100_000),
    }


def run_zs3(rank: int, world: int, args) -> dict[str, Any]:
    model = _model(args)
    block_numel = sum(p.numel() for p in model.h[0].parameters())
    knobs = stage3_knobs(args, block_numel)
    config = zeroshard_config(args, {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, **knobs})
    config["zeroshard"] = {"stage3_unit_classes": ["Block"]}
    out, mem = time_zeroshard(rank, world, args, model, config)
    out.update(
        model_state_bytes=mem["peak_model_states"],  # params + grads + optimizer states at one moment
        rest_bytes=mem["params"] + mem["grads"] + mem["optimizer_states"],
        buffer_bytes=mem["peak_comm_buffers"],
        breakdown={k: mem[f"peak_{k}"] for k in ("params", "grads", "optimizer_states", "comm_buffers")}
        | {f"rest {k}": mem[k] for k in ("params", "grads", "optimizer_states")},
        note=", ".join(f"{k.removeprefix('stage3_')}={v:,}" for k, v in knobs.items()),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Spawning (bench_stages.spawn_ranks, for this file's two rank functions)
# ---------------------------------------------------------------------------------------------

def run_variant(args, name: str, world: int = 2, timeout: float = 900) -> tuple[Result, dict]:
    started = time.perf_counter()
    outs = spawn_ranks(run_zs3 if name == "zs3" else run_fsdp2, (args,), world, timeout)
    r0 = outs[0]
    other = other_load(outs)
    result = Result(
        name=name, params=r0["params"], step_times=r0["step"], fwd=r0["fwd"], bwd=r0["bwd"], opt=r0["opt"],
        losses=r0["loss"], model_state_bytes=max(o["model_state_bytes"] for o in outs.values()),
        buffer_bytes=max(o["buffer_bytes"] for o in outs.values()), breakdown=r0["breakdown"],
        rss_bytes=max(o["rss_bytes"] for o in outs.values()), comm_per_step=r0["comm_per_step"],
        comm_detail=r0.get("comm_detail", {}), wall_s=time.perf_counter() - started, other_load=other,
        cpu=r0["cpu"],
    )
    extra = {"rest_bytes": max(o["rest_bytes"] for o in outs.values()), "note": r0.get("note", ""),
             "rss_per_rank": [outs[r]["rss_bytes"] for r in sorted(outs)]}
    return result, extra


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def report(args, results: dict[str, Result], extras: dict[str, dict], total_s: float, world: int = 2) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    fs, zs = results["fsdp2"], results["zs3"]
    phi = fs.params
    prec = "bf16" if args.bf16 else "fp32"
    title = (f"zeroshard stage 3 vs FSDP2 (fully_shard) - GPT '{args.preset}' (Phi = {phi:,}), {prec}, {world} gloo "
             f"ranks x 1 thread, micro-batch {args.micro_batch} x seq {args.seq_len}, AdamW, {args.warmup} warmup + "
             f"{args.steps} measured steps x {args.rounds} round(s)")
    table = Table(title=title, title_justify="left")
    for col in ("variant", "step s (median)", "x FSDP2", "clean steps", "min s", "x FSDP2 (min)",
                "peak model states MiB", "x FSDP2", "at rest MiB", "x FSDP2", "peak RSS MiB (r0/r1)", "x FSDP2",
                "comm/step (xPhi)", "last loss"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    base_t, base_min = median_step(fs), min(fs.step_times)
    for name in ("fsdp2", "zs3"):
        r, e = results[name], extras[name]
        t = median_step(r)
        ok = clean(r, r.step_times)[1]
        table.add_row(
            name, f"{t:.3f}" + ("" if ok else "*"), f"{t / base_t:.3f}",
            f"{sum(load < LOAD_LIMIT for load in r.other_load)}/{len(r.step_times)}", f"{min(r.step_times):.3f}",
            f"{min(r.step_times) / base_min:.3f}", _mib(r.model_state_bytes),
            f"{r.model_state_bytes / fs.model_state_bytes:.3f}", _mib(e["rest_bytes"]),
            f"{e['rest_bytes'] / extras['fsdp2']['rest_bytes']:.3f}",
            "/".join(_mib(b) for b in e["rss_per_rank"]), f"{r.rss_bytes / fs.rss_bytes:.3f}",
            f"{r.comm_per_step:.4f}", f"{r.losses[-1]:.4f}")
    console.print(table)

    detail = Table(title="per variant: phase medians (clean steps), rank 0 CPU s/step, memory breakdown (MiB, rank 0, "
                         "peaks), collectives over the measured steps", title_justify="left")
    for col in ("variant", "fwd / bwd / opt s", "CPU s/step", "memory", "collectives (calls, elements)", "settings"):
        detail.add_column(col, justify="left")
    for name in ("fsdp2", "zs3"):
        r = results[name]
        phases = "/".join(f"{statistics.median(clean(r, x)[0]):.3f}" for x in (r.fwd, r.bwd, r.opt))
        mem = ", ".join(f"{k} {_mib(v)}" for k, v in r.breakdown.items())
        coll = "; ".join(f"{op} {d['calls']}x {d['elements']:,}" for op, d in r.comm_detail.items())
        detail.add_row(name, phases, f"{statistics.median(clean(r, r.cpu)[0]):.3f}", mem, coll or "-",
                       extras[name]["note"])
    console.print(detail)

    def verdict(ok: bool) -> str:
        return "[green]PASS[/green]" if ok else "[red]MISS[/red]"

    targets = Table(title="targets (issue 3)", title_justify="left")
    for col in ("target", "measured", "result"):
        targets.add_column(col)
    ratio = median_step(zs) / base_t
    contended = not (clean(zs, zs.step_times)[1] and clean(fs, fs.step_times)[1])
    targets.add_row("zs3 step time <= FSDP2 (median)", f"{median_step(zs):.3f} / {base_t:.3f} s = {ratio:.3f} x"
                    + (" (contended: unreliable)" if contended else ""), verdict(ratio <= 1.0))
    mratio = zs.model_state_bytes / fs.model_state_bytes
    targets.add_row("zs3 peak model-state memory <= FSDP2", f"{_mib(zs.model_state_bytes)} / "
                    f"{_mib(fs.model_state_bytes)} MiB = {mratio:.3f} x", verdict(mratio <= 1.0))
    console.print(targets)

    n = world
    if args.bf16:
        console.print(f"formula, at rest (bytes per rank): zs3 (2 param + 2 grad + 4 fp32 master + 8 Adam) Phi/{n} = "
                      f"16 Phi/{n} = {_mib(16 * phi // n)} MiB; FSDP2 (4 fp32 param + 4 fp32 grad + 8 Adam) Phi/{n} = "
                      f"16 Phi/{n} = {_mib(16 * phi // n)} MiB (FSDP2 keeps fp32 sharded params as its master and casts "
                      "to bf16 at all-gather); plus persisted small params (zs3) and padding.")
    else:
        console.print(f"formula, at rest (bytes per rank): both (4 param + 4 grad + 8 Adam) Phi/{n} = 16 Phi/{n} = "
                      f"{_mib(16 * phi // n)} MiB: in fp32 both step the fp32 parameter shard itself (no second "
                      "master copy); plus persisted small params (zs3) and padding.")
    console.print("peak = at rest + transients: zs3 is the ledger's simultaneous peak (gathered units, full unit gradients in "
                  "flight); FSDP2 adds the sampled peak of its unsharded parameters + unsharded gradients.")
    console.print("per-variant wall (incl. process start): " + ", ".join(f"{r.name} {r.wall_s:.0f}s"
                                                                       for r in results.values()))
    console.print(f"clean steps: measured steps during which other programs used < {LOAD_LIMIT} CPU cores; step "
                  "medians over clean steps only ('*': fewer than 3 clean, all steps used).")
    console.print(f"total run time: {total_s:.1f} s   (torch {torch.__version__}, python {platform.python_version()}, "
                  f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, zeroshard at "
                  f"{_source_version()}, {datetime.datetime.now().isoformat(timespec='seconds')})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(ap)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; steps of all rounds pooled")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each variant, wait up to this many seconds for other programs to go quiet")
    ap.add_argument("--prefetch-units", type=int, default=1,
                    help="stage3_prefetch_bucket_size = this many Blocks' elements (FSDP2 prefetches 1)")
    ap.add_argument("--prefetch", type=float, default=None, help="stage3_prefetch_bucket_size (elements)")
    ap.add_argument("--reuse", type=float, default=None, help="stage3_max_reuse_distance (default: one Block)")
    ap.add_argument("--max-live", type=float, default=None, help="stage3_max_live_parameters (default 1e9)")
    ap.add_argument("--persistence", type=float, default=None,
                    help="stage3_param_persistence_threshold (default 1e5)")
    ap.add_argument("--only", default="", help="run only this variant (fsdp2 or zs3); no ratios")
    ap.add_argument("--verbose", action="store_true", help="show zeroshard's start-up banner")
    args = parse_common(ap, argv)
    names = [args.only] if args.only else ["fsdp2", "zs3"]

    started = time.perf_counter()
    results: dict[str, Result] = {}
    extras: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for name in names:
            load = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else float("nan")
            print(f"[bench] round {rnd + 1}/{args.rounds} {name} (other programs: {load:.2f} cores) ...",
                  file=sys.stderr, flush=True)
            r, e = run_variant(args, name)
            print(f"[bench] {name}: steps (s @ other-program cores) "
                  f"{', '.join(f'{t:.3f}@{o:.2f}' for t, o in zip(r.step_times, r.other_load))}, "
                  f"{r.wall_s:.0f}s wall", file=sys.stderr, flush=True)
            if name in results:
                results[name].merge(r)
                extras[name]["rest_bytes"] = max(extras[name]["rest_bytes"], e["rest_bytes"])
                extras[name]["rss_per_rank"] = [max(a, b) for a, b in zip(extras[name]["rss_per_rank"],
                                                                          e["rss_per_rank"])]
            else:
                results[name], extras[name] = r, e
    if len(results) < 2:
        for r in results.values():
            print(f"{r.name}: median step {median_step(r):.3f}s, model states {_mib(r.model_state_bytes)} MiB, "
                  f"breakdown {r.breakdown}, comm/step {r.comm_per_step}, {r.comm_detail}")
        return 0
    report(args, results, extras, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
