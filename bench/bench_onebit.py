#!/usr/bin/env python
"""OneBitAdam's loss curve beside Adam's (issue 42): a GPT (50M by default), 2 gloo ranks, ZeRO stage 0.

    nice -n 10 python bench/bench_onebit.py                      # 200 steps, freeze_step 40
    python bench/bench_onebit.py --steps 20 --freeze 5 --preset small   # a quick look

Both runs start from the same weights and see the same batches (bytes of the stdlib's .py
files, micro-batch `--micro` x `--seq` tokens per rank). Adam is the config's "Adam" (AdamW,
bias-corrected); OneBitAdam is DeepSpeed's 1-bit Adam (no bias correction, as DeepSpeed's),
Adam over the full all-reduce up to `--freeze`, then frozen variance and the momentum exchanged
1-bit with error feedback. Same lr, betas, eps, weight decay. A third run, OneBitAdam with freeze_step = steps (never
compressing), separates the compression's effect from the missing bias correction (which makes
DeepSpeed's 1-bit Adam take ~3x larger first steps than Adam). Printed: the curves every 10
steps (the mean of the two ranks' losses), the final losses (mean of the last 10 steps), the
largest relative gap |onebit - adam| / adam over the curve of 10-step means (and per step),
and the comm ledger's bytes sent per rank per step in each phase.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def _rank(rank: int, world: int, args: dict, optimizer: dict) -> dict:
    import torch

    import zeroshard
    from zeroshard.models import build_gpt, global_batch
    from zeroshard.models.corpus import stdlib_corpus

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_gpt(args["preset"])
    tokens = stdlib_corpus(4_000_000)
    cfg = {"train_micro_batch_size_per_gpu": args["micro"], "gradient_accumulation_steps": 1,
           "optimizer": optimizer, "zero_optimization": {"stage": 0}}
    engine = zeroshard.initialize(model, cfg)
    losses, sent, started = [], [], time.perf_counter()
    for step in range(args["steps"]):
        x, y = global_batch(tokens, args["micro"], args["seq"], step, world, seed=11)
        rows = slice(rank * args["micro"], (rank + 1) * args["micro"])
        before = sum(v["sent_bytes"] for v in engine.comm_stats().values())
        _, loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        sent.append(sum(v["sent_bytes"] for v in engine.comm_stats().values()) - before)
        losses.append(loss.item())
    seconds = time.perf_counter() - started
    engine.close()
    return {"losses": losses, "sent": sent, "seconds": seconds}


def _run(args: dict, optimizer: dict) -> dict:
    from zeroshard.bench.ranks import run_ranks

    per_rank = run_ranks(_rank, 2, args, optimizer, timeout=4000)
    curve = [sum(r["losses"][i] for r in per_rank) / 2 for i in range(args["steps"])]
    return {"curve": curve, "sent": per_rank[0]["sent"], "seconds": max(r["seconds"] for r in per_rank)}


def _means(curve: list[float], window: int = 10) -> list[float]:
    return [sum(curve[i:i + window]) / len(curve[i:i + window]) for i in range(0, len(curve), window)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--freeze", type=int, default=40)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    a = ap.parse_args()
    args = {"preset": a.preset, "steps": a.steps, "micro": a.micro, "seq": a.seq}
    common = {"lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    started = time.perf_counter()
    adam = _run(args, {"type": "Adam", "params": common})
    onebit = _run(args, {"type": "OneBitAdam", "params": {**common, "freeze_step": a.freeze}})
    # the same optimizer never compressing: what is left of the gap to it is the compression's
    plain = _run(args, {"type": "OneBitAdam", "params": {**common, "freeze_step": a.steps}})
    print(f"{a.preset} GPT, 2 gloo ranks x 1 thread, ZeRO stage 0, micro {a.micro} x seq {a.seq} per rank, "
          f"{a.steps} steps, lr {a.lr:g}, OneBitAdam freeze_step {a.freeze}")
    print("| step | Adam loss | OneBitAdam loss | OneBitAdam, never compressed |")
    print("|---:|---:|---:|---:|")
    for i in list(range(0, a.steps, 10)) + [a.steps - 1]:
        print(f"| {i + 1} | {adam['curve'][i]:.4f} | {onebit['curve'][i]:.4f} | {plain['curve'][i]:.4f} |")
    for label, base in (("Adam", adam), ("OneBitAdam never compressed", plain)):
        fa, fo = _means(base["curve"])[-1], _means(onebit["curve"])[-1]
        gaps = [abs(o - d) / d for o, d in zip(_means(onebit["curve"]), _means(base["curve"]))]
        raw = [abs(o - d) / d for o, d in zip(onebit["curve"], base["curve"])]
        at = 10 * gaps.index(max(gaps))
        print(f"OneBitAdam vs {label}: final loss (mean of the last 10 steps) {fo:.4f} vs {fa:.4f} "
              f"({(fo - fa) / fa:+.2%}); max relative gap of the 10-step means {max(gaps):.2%} (steps "
              f"{at + 1}-{at + 10}), per step {max(raw):.2%}")
    warm, late = onebit["sent"][1:a.freeze], onebit["sent"][a.freeze:]
    print(f"bytes sent per rank per step: Adam {sum(adam['sent'][1:]) / (a.steps - 1):,.0f}; OneBitAdam warm-up "
          f"{sum(warm) / max(len(warm), 1):,.0f}, after freeze_step {sum(late) / max(len(late), 1):,.0f} "
          f"({sum(late) / max(len(late), 1) / (sum(adam['sent'][1:]) / (a.steps - 1)):.4f} of Adam's)")
    print(f"time: Adam {adam['seconds']:.0f} s, OneBitAdam {onebit['seconds']:.0f} s, never compressed "
          f"{plain['seconds']:.0f} s; wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
