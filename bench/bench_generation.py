"""Benchmark: greedy generation at ZeRO-3, fp32, 2 gloo ranks on CPU (issue 48).

    python bench/bench_generation.py            # the ~50M and ~150M GPT, 2 rounds (~10-15 min, 2 cores)
    python bench/bench_generation.py --quick    # the ~50M GPT only, 2 rounds
    python bench/bench_generation.py --no-ds    # without DeepSpeed

GPT2LMHeadModel from a GPT2Config (vocab 50,257, tied head, seeded random init, no hub): "50m" (d 512,
8 layers, 51.5M) and "150m" (d 768, 16 layers, 152.8M); greedy, 64 new tokens (min_new_tokens 64), use_cache, batch 1, 16-token prompt:

  (a) unsharded    the whole model in one process: the limit.
  (a2) unsharded x2 the same in 2 processes at once (a barrier before each call): the limit of 2
      ranks on this machine, where both decode the whole model at once and share its memory
      bandwidth and caches (decoding at batch 1 reads every weight once per token).
  (b) zs gather    zeroshard stage 3, `with engine.generation(): engine.module.generate(...)`.
  (c) zs 50% / 25% the same with max_bytes = 50% / 25% of the model's bytes (units that fit kept).
  (d) zs per-fwd   plain `engine.module.generate(...)`: every unit gathered for every forward.
  (e) ds per-fwd   DeepSpeed ZeRO-3 (its own venv, DS_ACCELERATOR=cpu), plain `module.generate(...)`;
      ds gathered  TRL's unwrap_model_for_generation: GatheredParameters, hooks removed around generate.

Both ZeRO-3 systems are training engines (AdamW, lr 0, stage-3 defaults) that take one untimed
training step before each timed generate, as in an RL loop (lr 0 keeps the tokens comparable with
(a)); without it DeepSpeed's plain generate finds the whole model still gathered (reuse distance 1e9).
One torch thread per rank; each system in its own child processes, systems alternating by round.

Measured per variant: tokens/s = 64 / the generate call's wall time (the slower rank; a barrier
before each call), median over all rounds' repeats (--repeats per round; the slow variants, the
budgets and both per-forward paths, one per round), with min-max; peak RSS per rank = the kernel's VmHWM over the timed calls
(reset with /proc/self/clear_refs after each training step, so model building and the step are
left out); all-gathers and gathered bytes (full fp32 tensors) per generate call: zeroshard's comm
ledger, DeepSpeed's calls of torch.distributed's all-gathers (wrapped before it is imported). "est." is zeroshard's estimator (fp32 AdamW, the engine's stage-3 layout, host_is_device): model
states + the live units (per-forward) or + the kept units; RSS also holds the interpreter and
libraries (the (a) row minus the model). Tokens of (b), (c), (d) are asserted equal to (a)'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
MODELS = {"50m": dict(n_embd=512, n_layer=8, n_head=8), "150m": dict(n_embd=768, n_layer=16, n_head=12),
          "tiny": dict(n_embd=64, n_layer=2, n_head=2)}
VOCAB, PROMPT, NEW, SEED = 50257, 16, 64, 1234
ZS_VARIANTS = ("zs gather", "zs 50%", "zs 25%", "zs per-fwd")
DS_VARIANTS = ("ds per-fwd", "ds gathered")
SLOW = ("zs 50%", "zs 25%", "zs per-fwd", "ds per-fwd")  # one call per round (each several x a gathered one)
BUDGETS = {"zs gather": None, "zs 50%": 0.5, "zs 25%": 0.25, "zs per-fwd": "off"}


def build(name: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=1024, use_cache=True, **MODELS[name])
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(cfg).eval()


def prompt():
    import torch

    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(SEED + 1))


def generate(model, new: int = NEW):
    import torch

    x = prompt()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, use_cache=True, pad_token_id=0)
    return out[0, PROMPT:].tolist()


def vmhwm_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def timed(run, repeats: int, barrier=lambda: None, prepare=lambda: None, after=lambda: None) -> dict:
    """`run()` `repeats` times, each after `prepare()` (untimed) and a barrier, `after()` after it:
    wall seconds, tokens, and the peak RSS during the calls (the high-water mark reset after each
    `prepare()`)."""
    times, tokens, rss = [], None, 0.0
    for _ in range(repeats):
        prepare()
        reset_hwm()
        barrier()
        t0 = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - t0)
        rss = max(rss, vmhwm_mib())
        after()
    return {"times": times, "tokens": tokens, "rss": rss}


def train_step(engine, backward, step) -> None:
    """One training step at lr 0: the optimizer states exist, the weights stay as built."""
    x = prompt()
    loss = engine(input_ids=x, labels=x).loss
    backward(loss)
    step()


def unsharded_rank(rank: int, world: int, model_name: str, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    model = build(model_name)
    generate(model, 4)  # warm-up: transformers' first-call setup
    return {"unsharded": timed(lambda: generate(model), repeats)}


def unsharded_pair_rank(rank: int, world: int, model_name: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # for the barrier only: each process has the whole model
    model = build(model_name)
    generate(model, 4)
    return {"unsharded x2": timed(lambda: generate(model), repeats, dist.barrier)}


def zeroshard_rank(rank: int, world: int, model_name: str, repeats: int, order: list) -> dict:
    import torch
    import torch.distributed as dist

    import zeroshard

    torch.set_num_threads(1)
    model = build(model_name)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}}}
    engine = zeroshard.initialize(model, cfg)
    engine.module.eval()
    model_bytes = sum(u.numel for u in engine.stage3.units) * 4
    generate(engine.module, 4)  # warm-up
    out = {"estimate": estimate(engine, model_name, world), "model_bytes": model_bytes}
    for name in order:
        budget, kept = BUDGETS[name], []

        def run():
            if budget == "off":
                return generate(engine.module)
            with engine.generation(None if budget is None else int(budget * model_bytes)) as keep:
                tokens = generate(engine.module)
                kept.append(keep.bytes)
            return tokens

        def prepare():
            train_step(engine, engine.backward, engine.step)
            engine.reset_comm_stats()

        def after():  # the generate call's all-gathers (fp32 bytes of the full tensors)
            gathers = engine.comm_stats().get("all_gather", {"calls": 0, "elements": 0})
            count[0] += gathers["calls"]
            count[1] += gathers["elements"] * 4

        n, count = (1 if name in SLOW else repeats), [0, 0]
        out[name] = timed(run, n, dist.barrier, prepare, after)
        out[name]["gathers"], out[name]["gathered"] = count[0] / n, count[1] / n  # fp32 bytes of the full (gathered) tensors
        out[name]["kept"] = max(kept, default=0)
    engine.close()
    return out


def estimate(engine, model_name: str, world: int) -> dict:
    """zeroshard's estimator for this engine's layout (fp32 AdamW, CPU: host is device)."""
    from zeroshard.estimate import Strategy, estimate_memory, shape_from_hf_config
    from zeroshard.estimate.padding import plan_stage3_layout

    with tempfile.TemporaryDirectory() as d:
        engine.module.config.to_json_file(os.path.join(d, "config.json"))
        shape = shape_from_hf_config(os.path.join(d, "config.json"))
    layout = plan_stage3_layout([u.numel for u in engine.stage3.units], "fp32", world)
    m = estimate_memory(shape, Strategy(stage=3, precision="fp32", optimizer="adamw", host_is_device=True), world,
                        layout=layout)
    return {"model_states": m.model_states, "live_params": m.live_params, "device_total": m.device_total,
            "params": shape.params}


def count_all_gathers(dist) -> dict:
    """Wrap torch.distributed's all-gathers (before DeepSpeed binds them): outermost calls and
    bytes of their outputs."""
    counts = {"calls": 0, "bytes": 0, "depth": 0}

    def wrap(fn, out_bytes):
        def counted(*args, **kwargs):
            counts["depth"] += 1
            try:
                if counts["depth"] == 1:
                    counts["calls"] += 1
                    counts["bytes"] += out_bytes(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                counts["depth"] -= 1
        return counted

    def tensor_out(output_tensor=None, *args, **kwargs):
        return output_tensor.numel() * output_tensor.element_size()

    def list_out(tensor_list=None, *args, **kwargs):
        return sum(t.numel() * t.element_size() for t in tensor_list)

    for name, size in (("all_gather_into_tensor", tensor_out), ("_all_gather_base", tensor_out),
                       ("all_gather", list_out)):
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name), size))
            setattr(dist.distributed_c10d, name, getattr(dist, name))
    return counts


def deepspeed_rank(rank: int, world: int, model_name: str, repeats: int, order: list) -> dict:
    import torch
    import torch.distributed as dist

    counts = count_all_gathers(dist)
    import deepspeed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    model = build(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.module.eval()
    generate(engine.module, 4)  # warm-up
    out = {}
    for name in order:
        counts.update(gen_calls=0, gen_bytes=0)
        gen = (lambda: generate(engine.module)) if name == "ds per-fwd" else (lambda: ds_gathered(engine))

        def run():
            calls, sent = counts["calls"], counts["bytes"]
            tokens = gen()
            counts["gen_calls"] += counts["calls"] - calls
            counts["gen_bytes"] += counts["bytes"] - sent
            return tokens

        n = 1 if name in SLOW else repeats
        out[name] = timed(run, n, dist.barrier, lambda: train_step(engine, engine.backward, engine.step))
        out[name]["gathers"] = counts["gen_calls"] / n
        out[name]["gathered"] = counts["gen_bytes"] / n
    return out


def ds_gathered(engine):
    """TRL's unwrap_model_for_generation at ZeRO-3 (trl/models/utils.py: remove_hooks / add_hooks)."""
    import deepspeed

    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        for p in offload.module.parameters(recurse=True):
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        tokens = generate(engine.module)
        offload._register_deepspeed_module(offload.module)
    return tokens


def child(args) -> None:
    """One system's processes for one round: results as JSON to --out."""
    sys.path.insert(0, SRC)
    from zeroshard.bench.ranks import run_ranks

    order = args.order.split(",")
    if args.child == "unsharded":
        res = run_ranks(unsharded_rank, 1, args.model, args.repeats, timeout=1800)
    elif args.child == "pair":
        res = run_ranks(unsharded_pair_rank, 2, args.model, args.repeats, timeout=1800)
    elif args.child == "zeroshard":
        res = run_ranks(zeroshard_rank, 2, args.model, args.repeats, order, timeout=1800)
    else:
        res = run_ranks(deepspeed_rank, 2, args.model, args.repeats, order, timeout=1800)
    with open(args.out, "w") as fh:
        json.dump(res, fh)


def launch(system: str, model: str, repeats: int, order: list, ds_python: str) -> list:
    py = ds_python if system == "deepspeed" else sys.executable
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if system == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    cmd = [py, os.path.abspath(__file__), "--child", system, "--model", model, "--repeats", str(repeats),
           "--order", ",".join(order), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} on {model} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    with open(out) as fh:
        res = json.load(fh)
    os.unlink(out)
    return res


def run_model(model: str, rounds: int, repeats: int, systems: list, ds_python: str) -> dict:
    rows: dict[str, dict] = {}
    extra: dict = {}
    for r in range(rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            names = {"unsharded": ["unsharded"], "pair": ["unsharded x2"], "zeroshard": list(ZS_VARIANTS), "deepspeed": list(DS_VARIANTS)}[system]
            order = names[r % len(names):] + names[:r % len(names)]  # rotate the variants each round
            t0 = time.perf_counter()
            ranks = launch(system, model, repeats, order, ds_python)
            print(f"  {model} round {r + 1}/{rounds}: {system} ({', '.join(order)}) {time.perf_counter() - t0:.0f} s",
                  flush=True)
            for name in names:
                row = rows.setdefault(name, {"times": [], "rss": [0.0] * len(ranks), "tokens": None})
                # per call the slower rank; per rank the peak over the rounds
                row["times"] += [max(ts) for ts in zip(*(rk[name]["times"] for rk in ranks))]
                row["rss"] = [max(a, rk[name]["rss"]) for a, rk in zip(row["rss"], ranks)]
                tokens = [rk[name]["tokens"] for rk in ranks]
                assert all(t == tokens[0] for t in tokens), f"{name}: ranks generated different tokens"
                assert row["tokens"] in (None, tokens[0]), f"{name}: tokens changed between rounds"
                row["tokens"] = tokens[0]
                for key in ("gathers", "gathered", "kept"):
                    if key in ranks[0][name]:
                        row[key] = ranks[0][name][key]
            if system == "zeroshard":
                extra = {"estimate": ranks[0]["estimate"], "model_bytes": ranks[0]["model_bytes"]}
    want = rows["unsharded"]["tokens"]
    for name in ZS_VARIANTS:
        assert rows[name]["tokens"] == want, f"{name}: tokens differ from the unsharded model's"
    return {"rows": rows, **extra}


def mib(n: float) -> str:
    return f"{n / 2 ** 20:,.0f}"


def report(model: str, res: dict) -> None:
    rows, est = res["rows"], res["estimate"]
    base = NEW / statistics.median(rows["unsharded"]["times"])
    best_ds = max((NEW / statistics.median(rows[n]["times"]) for n in DS_VARIANTS if n in rows), default=None)
    print(f"\n{model}: {est['params']:,} parameters ({mib(res['model_bytes'])} MiB fp32 in units), {NEW} new tokens, "
          f"prompt {PROMPT}, batch 1, 2 ranks x 1 thread (unsharded: 1 process)")
    print("| system | tokens/s (median) | min-max | x (a) | peak RSS MiB per rank | est. MiB per rank "
          "| all-gathers / generate | gathered MiB / generate | tokens = (a) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, row in rows.items():
        rates = [NEW / t for t in row["times"]]
        tps = NEW / statistics.median(row["times"])
        if name.startswith("zs"):
            kept = row["kept"] if BUDGETS[name] != "off" else 0
            e = mib(est["model_states"] + kept + (est["live_params"] if kept < res["model_bytes"] else 0))
        else:
            e = "-"
        gathers = f"{row['gathers']:.0f} | {mib(row['gathered'])}" if "gathers" in row else "- | -"
        same = "yes" if row["tokens"] == rows["unsharded"]["tokens"] else "NO"
        print(f"| {name} | {tps:.1f} | {min(rates):.1f}-{max(rates):.1f} | {tps / base:.2f} | "
              f"{' / '.join(f'{r:,.0f}' for r in row['rss'])} | {e} | {gathers} | {same} |")
    b = NEW / statistics.median(rows["zs gather"]["times"])
    line = f"goals: (b)/(a) = {b / base:.2f} (goal >= 0.9: {'PASS' if b / base >= 0.9 else 'MISS'})"
    if "unsharded x2" in rows:
        pair = NEW / statistics.median(rows["unsharded x2"]["times"])
        line += f"; (b)/(a2) = {b / pair:.2f} (a2: the unsharded model in 2 processes at once, {pair / base:.2f} x (a))"
    if best_ds is not None:
        line += f"; (b) / best DeepSpeed = {b / best_ds:.2f} (goal > 1: {'PASS' if b > best_ds else 'MISS'})"
    print(line)
    print(f"est.: zeroshard's estimator, model states {mib(est['model_states'])} MiB + live units "
          f"{mib(est['live_params'])} MiB (per-forward) or + the kept units (measured keep.bytes) per rank; "
          f"its training peak {mib(est['device_total'])} MiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 50m model only, 2 rounds")
    ap.add_argument("--models", default="50m,150m", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed generate calls per variant per round (the per-forward and budget variants: 1)")
    ap.add_argument("--no-ds", action="store_true", help="leave DeepSpeed out")
    ap.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/dsvenv/bin/python"),
                    help="a python with deepspeed installed (default $DS_PYTHON or /work/dsvenv/bin/python)")
    ap.add_argument("--child", choices=("unsharded", "pair", "zeroshard", "deepspeed"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    models = ["50m"] if args.quick else args.models.split(",")
    rounds = 2 if args.quick else args.rounds
    systems = ["unsharded", "pair", "zeroshard"]
    if not args.no_ds:
        if os.path.exists(args.ds_python):
            systems.append("deepspeed")
        else:
            print(f"no DeepSpeed: {args.ds_python} not found (--ds-python); (e) left out")
    t0 = time.perf_counter()
    for model in models:
        report(model, run_model(model, rounds, args.repeats, systems, args.ds_python))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; command: python bench/bench_generation.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
