"""ZeRO-Infinity headline demo: a GPT decoder whose model states are about twice this machine's
RAM, trained with stage 3 + parameters and optimizer states on the NVMe tier, built on the meta
device (never materialized whole), on the bytes of the Python standard library's sources (the
corpus `zeroshard train` embeds), with a warm-up then linear-decay learning rate.

    python bench/demo_infinity.py --nvme-path /tmp/zs_infinity --bf16           # 3.15B, one process
    torchrun --nproc_per_node 2 bench/demo_infinity.py --nvme-path /tmp/zs_infinity --bf16   # 2 ranks, one disk
    python bench/demo_infinity.py --nvme-path /tmp/zs_infinity --layers 2 --embd 512   # smoke run

Model: the repository's GPT (models/gpt.py), n_layer x n_embd (default 40 x 2560: 3.15e9
parameters; fp32 + AdamW model states = 16 bytes/parameter = 50 GB). It is built under
torch.device("meta"); zeroshard's stage 3 materializes one Block at a time (reset_parameters),
writes its shard to the NVMe tier and forgets it. Masters and Adam states go to the optimizer's
files in sub-groups of --sub-group elements.

Per step it prints: loss, lr, wall time split into forward, backward (where the optimizer steps
each unit's sub-group as its gradients become final) and the step, the time the process was
blocked on NVMe I/O, bytes read/written by the tiers of all ranks, the I/O lower bound
(bytes read / raw read rate + bytes written / raw write rate, the raw rates measured by `dd`
with O_DIRECT on the same path in the same run, before the first step and after the last),
step time / lower bound, the disk's busy share (io_ticks of the disk under nvme_path,
/proc/diskstats) per phase and over the step, and the peak RSS so far (VmHWM, rank 0). At the
end: the bytes on disk, and whether the loss fell. The machine may be shared: timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch


def _rss_peak_gib(key: str = "VmHWM:") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _disk_of(path: str) -> str | None:
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        rows = [line.split() for line in f]
    names = {(int(r[0]), int(r[1])): r[2] for r in rows}
    name = names.get((major, minor))
    if name is None:
        return None
    whole = name.rstrip("0123456789") if not name.startswith("nvme") else name.split("p")[0]
    return whole if any(r[2] == whole for r in rows) else name


def _io_ticks_ms(disk: str | None) -> int:
    if disk is None:
        return 0
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if parts[2] == disk:
                return int(parts[12])
    return 0


def _dd_rates(path: str, mib: int, block_mib: int = 1) -> tuple[float, float]:
    """(write, read) GB/s of `dd` with O_DIRECT and `block_mib` MiB blocks on `path` (the raw disk)."""
    target = os.path.join(path, f"demo-dd-probe-{os.getpid()}.bin")

    def rate(args: list[str]) -> float:
        out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
        return int(m.group(1)) / float(m.group(2)) / 1e9

    try:
        w = rate(["if=/dev/zero", f"of={target}", f"bs={block_mib}M", f"count={max(1, mib // block_mib)}",
                  "oflag=direct", "conv=fsync"])
        r = rate([f"if={target}", "of=/dev/null", f"bs={block_mib}M", "iflag=direct"])
    finally:
        if os.path.exists(target):
            os.unlink(target)
    return w, r


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


class _Watch:
    """A daemon thread: ticks every 0.2 s; a gap over 1 s is time the process was stopped
    (SIGSTOP); stops the run when MemAvailable drops under `min_avail_gib`."""

    def __init__(self, min_avail_gib: float) -> None:
        import threading

        self.stopped_s = 0.0
        self.min_avail_gib = min_avail_gib
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            if now - last > 1.0:
                self.stopped_s += now - last - 0.2
            last = now
            avail = _mem_available_gib()
            if avail < self.min_avail_gib:
                print(f"STOPPING: MemAvailable {avail:.2f} GiB < {self.min_avail_gib} GiB "
                      f"(peak RSS {_rss_peak_gib():.2f} GiB); NVMe run folders are left for removal", flush=True)
                os._exit(3)


def _bf16_gemm() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16), which torch's
    oneDNN uses for bf16 matmuls; without them a bf16 matmul is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class _Fp32Linear(torch.autograd.Function):
    """y = x W^T + b for bf16 tensors, each matmul done in fp32 and the result rounded to bf16
    (what bf16 hardware does with its fp32 accumulators), for CPUs without a bf16 GEMM (AVX2:
    torch's bf16 matmul of grad_output @ W runs ~40-60x slower than fp32 there). Saves (x, W) as
    F.linear does; the fp32 copies are temporaries of one Linear at a time."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = x.float() @ w.float().t()
        if b is not None:
            y += b.float()
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g32 = g.float()
        gx = (g32 @ w.float()).to(x.dtype)
        gw = (g32.reshape(-1, g32.shape[-1]).t() @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        gb = g32.reshape(-1, g32.shape[-1]).sum(0).to(w.dtype) if ctx.has_bias else None
        return gx, gw, gb


def _fp32_matmul_linear() -> None:
    import torch.nn.functional as F

    plain = F.linear

    def linear(x, w, b=None):
        if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
            return _Fp32Linear.apply(x, w, b)
        return plain(x, w, b)

    F.linear = linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--embd", type=int, default=2560)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    # 6e-6: Adam's first updates move every weight by about the lr (m/sqrt(v) is +-1), a large
    # coherent change on a 40 x 2560 model at 128 tokens a step: peaks of 3e-5 and 1.5e-5 gave
    # loss spikes above step 1's (6.06 and 5.66 against 5.72 and 5.63) once the warm-up passed
    # about 1.1e-5, while updates of 3.75e-6 took the loss from 5.63 to 4.0 in 3 steps
    # (bench/peer-results/demo_infinity_3b_v3)
    p.add_argument("--lr", type=float, default=6e-6, help="the peak lr (WarmupDecayLR: linear warm-up, linear decay)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (the lr rises from --lr/(warmup+1) to --lr)")
    p.add_argument("--raw-mib", type=int, default=1024, help="MiB dd writes and reads for the raw disk rates")
    p.add_argument("--sub-group", type=int, default=20_000_000)
    p.add_argument("--bf16", action="store_true", help='"bf16": {"enabled": true} (default fp32)')
    p.add_argument("--bf16-matmul", choices=["fp32", "native"], default="native" if _bf16_gemm() else "fp32",
                   help="with --bf16: torch's bf16 Linear matmuls (the default where the CPU has AVX512-BF16 or "
                        "AMX-BF16) or fp32 matmuls on bf16 tensors (the default elsewhere)")
    p.add_argument("--min-avail-gib", type=float, default=3.0, help="stop when MemAvailable is below this")
    p.add_argument("--pid-file", help="write this process's PID here")
    p.add_argument("--json", help="write the per-step rows here")
    args = p.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    watch = _Watch(args.min_avail_gib)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # one process: no torchrun variables left over
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
    rank = int(os.environ.get("RANK", "0"))
    import logging

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", stream=sys.stdout)
    import zeroshard
    from zeroshard.models import global_batch
    from zeroshard.models.corpus import stdlib_corpus
    from zeroshard.models.gpt import GPT, GPTConfig

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    os.makedirs(args.nvme_path, exist_ok=True)
    cfg = GPTConfig(vocab_size=256, block_size=max(64, args.seq), n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    say(f"model: GPT {args.layers} x {args.embd}, {n / 1e9:.3f}e9 parameters, built on meta; "
          f"model states {'bf16' if args.bf16 else 'fp32'} + AdamW = {16 * n / 1e9:.1f} GB "
          f"({'2 + 2 + 4 + 8' if args.bf16 else '4 + 4 + 8'} bytes/parameter: parameters, gradients, "
          f"{'fp32 masters, ' if args.bf16 else ''}Adam states); on disk {(14 if args.bf16 else 16) * n / 1e9:.1f} GB "
          f"({'2 + 4 + 8' if args.bf16 else '4 + 4 + 8: the shard and its fp32 master are two files'}), "
          f"gradients in memory {(2 if args.bf16 else 4) * n / 1e9:.1f} GB (all ranks)")
    block = 12 * args.embd * args.embd + 13 * args.embd
    where = {"device": "nvme", "nvme_path": args.nvme_path}
    config = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": args.steps,
                                                           "warmup_min_lr": args.lr / (args.warmup + 1),
                                                           "warmup_max_lr": args.lr, "warmup_num_steps": args.warmup,
                                                           "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "sub_group_size": args.sub_group, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": block,
                              "offload_optimizer": {**where, "buffer_count": 3},
                              "offload_param": {**where, "buffer_count": 2, "buffer_size": block}},
        "zeroshard": {"stage3_unit_classes": ["Block"]},
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
        if args.bf16_matmul == "fp32":
            _fp32_matmul_linear()
        say(f"bf16 Linear matmuls: {'torch bf16 (oneDNN)' if args.bf16_matmul == 'native' else 'fp32 on bf16 tensors'}"
            f" (--bf16-matmul {args.bf16_matmul}; this CPU {'has' if _bf16_gemm() else 'has no'} bf16 GEMM instructions)")
    started = time.perf_counter()
    engine = zeroshard.initialize(model, config)
    init_s, init_rss = time.perf_counter() - started, _rss_peak_gib()
    world = engine.comm.world_size
    say(f"initialize: {init_s:.1f} s (stopped {watch.stopped_s:.1f} s of it), peak RSS {init_rss:.2f} GiB "
        f"= {init_rss * 2**30 * world / n:.2f} bytes/parameter over {world} rank(s); RSS now {_rss_peak_gib('VmRSS:'):.2f} GiB")
    say(f"the optimizer steps {engine.step_mode}")
    opt = engine.optimizer
    tiers = [opt.store.tier] + engine.param_tiers
    disk = _disk_of(args.nvme_path)

    def total(*values: float) -> list[float]:  # summed over the ranks (they share the disk)
        t = torch.tensor(values, dtype=torch.float64)
        if world > 1:
            engine.comm.all_reduce(t, "sum", what="demo byte counts").wait()
        return t.tolist()

    def raw_rates() -> tuple[float, float]:
        """The disk's (write, read) GB/s: the better of dd with 1 MiB and with 64 MiB blocks (a large
        block reaches the disk as several requests at once), so the bound is not inflated by a
        slow single stream. Rank 0 measures while the others wait."""
        rates = [0.0] * 4
        if rank == 0:
            rates = [*_dd_rates(args.nvme_path, args.raw_mib, 1), *_dd_rates(args.nvme_path, args.raw_mib, 64)]
        w1, r1, w64, r64 = total(*rates)
        say(f"raw disk (dd O_DIRECT, {args.raw_mib} MiB): 1 MiB blocks write {w1:.3f} GB/s, read {r1:.3f} GB/s; "
            f"64 MiB blocks write {w64:.3f} GB/s, read {r64:.3f} GB/s")
        return max(w1, w64), max(r1, r64)

    raw = [raw_rates()]
    on_disk = total(sum(t.bytes_on_disk for t in tiers))[0]
    say(f"disk {disk}: {on_disk / 1e9:.1f} GB in the run folders after initialize; the I/O lower bound uses write "
        f"{raw[0][0]:.3f} GB/s, read {raw[0][1]:.3f} GB/s")
    tokens = stdlib_corpus(8_000_000)
    say(f"corpus: {tokens.numel():,} bytes of the Python standard library's sources (vocabulary 256); "
        f"{args.micro * args.seq * world} tokens per step; lr: linear warm-up over {args.warmup} step(s) from "
        f"{args.lr / (args.warmup + 1):g} to "
        f"{args.lr:g}, then linear decay to 0 at step {args.steps}")
    rows = []

    def dump(disk_bytes: float) -> None:  # after every step too: a stopped run keeps its rows
        if args.json and rank == 0:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world_size": world, "params": n, "disk_bytes": disk_bytes,
                           "initialize_s": round(init_s, 1), "initialize_peak_rss_gib": round(init_rss, 2),
                           "raw_gbs": raw, "rows": rows}, f, indent=1)

    def waits() -> float:
        return opt.store.io_wait_s + sum(t.ahead.wait_s for t in engine.param_tiers if t.ahead)

    def io_bytes() -> tuple[int, int]:
        return sum(t.io.bytes_read for t in tiers), sum(t.io.bytes_written for t in tiers)

    for step in range(args.steps):
        lr = opt.param_groups[0]["lr"]
        x, y = global_batch(tokens, args.micro * world, args.seq, step)
        x, y = x[rank * args.micro:(rank + 1) * args.micro], y[rank * args.micro:(rank + 1) * args.micro]
        (r0, w0), wait0, stop0 = io_bytes(), waits(), watch.stopped_s
        ticks, marks = [_io_ticks_ms(disk)], [time.perf_counter()]
        _, loss = engine(x, y)
        ticks.append(_io_ticks_ms(disk)), marks.append(time.perf_counter())
        engine.backward(loss)
        ticks.append(_io_ticks_ms(disk)), marks.append(time.perf_counter())
        engine.step()
        ticks.append(_io_ticks_ms(disk)), marks.append(time.perf_counter())
        r1, w1 = io_bytes()
        read, written, loss_sum = total(r1 - r0, w1 - w0, loss.item())
        step_s = marks[-1] - marks[0]
        bound = read / 1e9 / raw[0][1] + written / 1e9 / raw[0][0]
        busy = [(ticks[i + 1] - ticks[i]) / 1000 / max(marks[i + 1] - marks[i], 1e-9) for i in range(3)]
        row = {"step": step + 1, "loss": round(loss_sum / world, 4), "lr": float(f"{lr:.3g}"), "step_s": round(step_s, 1),
               "fwd_s": round(marks[1] - marks[0], 1), "bwd_s": round(marks[2] - marks[1], 1),
               "opt_step_s": round(marks[3] - marks[2], 1), "io_wait_s": round(waits() - wait0, 1),
               "read_gb": round(read / 1e9, 2), "written_gb": round(written / 1e9, 2),
               "io_bound_s": round(bound, 1), "step_over_bound": round(step_s / bound, 2) if bound else None,
               "disk_busy": round((ticks[-1] - ticks[0]) / 1000 / step_s, 2),
               "busy_fwd_bwd_step": [round(b, 2) for b in busy], "peak_rss_gib": round(_rss_peak_gib(), 2),
               "stopped_s": round(watch.stopped_s - stop0, 1),
               "load_avg": float(open("/proc/loadavg").read().split()[0])}
        rows.append(row)
        say(json.dumps(row))
        dump(on_disk)
    raw.append(raw_rates())
    say(f"raw disk after the steps: write {raw[1][0]:.3f} GB/s, read {raw[1][1]:.3f} GB/s (the bounds above use the "
        "rates measured before the first step)")
    losses = [r["loss"] for r in rows]
    if len(losses) >= 6:
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        say(f"loss: first 3 steps' mean {first:.4f}, last 3 steps' mean {last:.4f} "
            f"({'falling' if last < first else 'NOT falling'}); highest step after the first: "
            f"{max(losses[1:]):.4f} ({'below' if max(losses[1:]) <= losses[0] else 'ABOVE'} the first, {losses[0]:.4f})")
    on_disk = total(sum(t.bytes_on_disk for t in tiers))[0]
    say(f"disk space used by the run folders: {on_disk / 1e9:.1f} GB (checked against free space at start); "
        f"peak RSS {_rss_peak_gib():.2f} GiB (rank 0); memory_stats: "
        + json.dumps({k: round(v / 2**30, 2) for k, v in engine.memory_stats().items() if k.startswith("tier")})
        + " GiB")
    dump(on_disk)
    engine.close()


if __name__ == "__main__":
    main()
