"""Benchmark: activation offload (issue 11) on a small GPT from zeroshard.models.

    python bench/bench_activation_offload.py                      # "mini" GPT (0.83M), micro-batch 16
    python bench/bench_activation_offload.py --model small --micro-batch 8   # 10.8M, slower

One process (world size 1), ZeRO stage 2, fp32, AdamW, every block checkpointed with zeroshard's
checkpoint function (`GPT.checkpoint_blocks`). Variants, in one process, interleaved over
--rounds rounds:

* off:  no activation checkpointing (every intermediate kept; the ledger does not see them);
* none: checkpointing, the kept block inputs on the device;
* cpu:  `activation_checkpointing.cpu_checkpointing: true` (host; on this CPU-only machine the
        same memory: no copy, the ledger puts them on the host);
* nvme: `zeroshard.activation_offload: {device: nvme, nvme_path}` (files through the I/O engine).

Per variant: median step time (forward + backward + step) with min/max; the peak bytes of
checkpointed activations on each tier from the engine's memory ledger ("activations" category,
`MemoryLedger.by_tier`); per step the bytes written to and read from the files and how many
reads were ahead of their use. The machine may be shared: timings are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch


def _config(variant: str, nvme_path: str, micro: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if variant == "cpu":
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    if variant == "nvme":
        cfg["zeroshard"] = {"activation_offload": {"device": "nvme", "nvme_path": nvme_path}}
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mini", help="GPT preset of zeroshard.models.gpt (default mini)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nvme-path", default=None, help="folder for the NVMe variant (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    os.environ.pop("RANK", None)
    import zeroshard
    from zeroshard.models.gpt import GPT_PRESETS, build_gpt, num_parameters
    from zeroshard.offload import activations

    preset = GPT_PRESETS[args.model]
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="zs-act-bench-")
    seq = preset.block_size
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, preset.vocab_size, (args.micro_batch, seq), generator=g)
    tgt = torch.randint(0, preset.vocab_size, (args.micro_batch, seq), generator=g)
    variants = ("off", "none", "cpu", "nvme")
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks: dict[str, dict] = {}
    io: dict[str, tuple] = {}
    torch.manual_seed(0)
    base = build_gpt(args.model)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    print(f"model {args.model}: {num_parameters(base):,} params, {preset.n_layer} blocks, micro-batch "
          f"{args.micro_batch} x seq {seq}, hidden {preset.n_embd}; one block input = "
          f"{args.micro_batch * seq * preset.n_embd * 4:,} bytes (fp32); torch threads {torch.get_num_threads()}; "
          f"nvme_path {nvme_path}", flush=True)
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        for v in variants:
            model = build_gpt(args.model)
            model.load_state_dict(state)
            model.checkpoint_blocks = v != "off"
            engine = zeroshard.initialize(model, _config(v, nvme_path, args.micro_batch))
            store = activations.current()
            _, loss = engine(idx, tgt)  # warm-up step
            engine.backward(loss)
            engine.step()
            engine.reset_memory_stats()
            store.reset_peaks()
            packed0, hits0, misses0 = store.packed_bytes, store.hits, store.misses
            for _ in range(args.steps):
                started = time.perf_counter()
                _, loss = engine(idx, tgt)
                engine.backward(loss)
                engine.step()
                times[v].append(time.perf_counter() - started)
            losses[v] = float(loss.detach())
            peaks[v] = engine.memory.by_tier("activations")
            io[v] = ((store.packed_bytes - packed0) // args.steps, store.hits - hits0, store.misses - misses0)
            engine.close()
            activations.reset()
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    def mib(n: int) -> str:
        return f"{n / 2**20:.2f}"

    print()
    print("| variant | step s (median) | min - max | vs none | peak ckpt act. device MiB | host MiB | nvme MiB "
          "| written = read / step MiB | reads ahead / on demand | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ref = statistics.median(times["none"])
    for v in variants:
        t = times[v]
        med = statistics.median(t)
        p = peaks[v]
        moved, hits, misses = io[v]
        off = v == "off"
        print(f"| {v} | {med:.3f} | {min(t):.3f} - {max(t):.3f} | {med / ref:.2f}x | "
              f"{'n/a' if off else mib(p['peak_device'])} | {'n/a' if off else mib(p['peak_host'])} | "
              f"{'n/a' if off else mib(p['peak_nvme'])} | {mib(moved) if v == 'nvme' else '-'} | "
              f"{f'{hits} / {misses}' if v == 'nvme' else '-'} | {losses[v]:.6f} |")
    left = [f for _, _, files in os.walk(nvme_path) for f in files]
    print(f"\nfiles left under nvme_path after the runs: {len(left)}")
    if args.nvme_path is None:
        os.rmdir(nvme_path) if not os.listdir(nvme_path) else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
