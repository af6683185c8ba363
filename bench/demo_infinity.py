"""ZeRO-Infinity headline demo: a GPT decoder whose model states are about twice this machine's
RAM, trained for a few optimizer steps with stage 3 + parameters and optimizer states on the
NVMe tier, in one process, built on the meta device (never materialized whole).

    python bench/demo_infinity.py --nvme-path /tmp/zs_infinity                    # 3.15B parameters
    python bench/demo_infinity.py --nvme-path /tmp/zs_infinity --layers 2 --embd 512   # smoke run
    python bench/demo_infinity.py --nvme-path /tmp/zs_infinity --bf16   # bf16 compute (2-byte grads)

Model: the repository's GPT (models/gpt.py), n_layer x n_embd (default 40 x 2560: 3.15e9
parameters; fp32 + AdamW model states = 16 bytes/parameter = 50 GB). It is built under
torch.device("meta"); zeroshard's stage 3 materializes one Block at a time (reset_parameters),
writes its shard to the NVMe tier and forgets it. Masters and Adam states go to the optimizer's
files in sub-groups of --sub-group elements.

Per step it prints: loss, wall time split into forward+backward and optimizer step, the time
the process was blocked on NVMe I/O (optimizer swap waits + parameter read-ahead waits), bytes
read/written by the tiers, disk busy share (io_ticks of the disk under nvme_path over the step's
wall time, /proc/diskstats), and the peak RSS of the process so far (VmHWM). At the end: the bytes
on disk. The machine may be shared: timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
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


class _Fp32Linear(torch.autograd.Function):
    """y = x W^T + b for bf16 tensors, each matmul done in fp32 and the result rounded to bf16
    (what bf16 hardware does with its fp32 accumulators). This AVX2 CPU has no bf16 GEMM: torch's
    bf16 matmul of grad_output @ W (the input gradient) runs ~40-60x slower than fp32 here. Saves
    (x, W) as F.linear does; the fp32 copies are temporaries of one Linear at a time."""

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
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--sub-group", type=int, default=20_000_000)
    p.add_argument("--bf16", action="store_true", help='"bf16": {"enabled": true} (default fp32)')
    p.add_argument("--bf16-matmul", choices=["fp32", "native"], default="fp32",
                   help="with --bf16: Linear matmuls in fp32 on bf16 tensors (default; no bf16 GEMM on AVX2) or torch's bf16")
    p.add_argument("--min-avail-gib", type=float, default=3.0, help="stop when MemAvailable is below this")
    p.add_argument("--pid-file", help="write this process's PID here")
    p.add_argument("--json", help="write the per-step rows here")
    args = p.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    watch = _Watch(args.min_avail_gib)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    import zeroshard
    from zeroshard.models import synthetic_tokens, global_batch
    from zeroshard.models.gpt import GPT, GPTConfig

    os.makedirs(args.nvme_path, exist_ok=True)
    cfg = GPTConfig(vocab_size=256, block_size=max(64, args.seq), n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: GPT {args.layers} x {args.embd}, {n / 1e9:.3f}e9 parameters, built on meta; "
          f"model states {'bf16' if args.bf16 else 'fp32'} + AdamW = {16 * n / 1e9:.1f} GB "
          f"({'2 + 2 + 4 + 8' if args.bf16 else '4 + 4 + 8'} bytes/parameter: parameters, gradients, "
          f"{'fp32 masters, ' if args.bf16 else ''}Adam states); on disk {(14 if args.bf16 else 16) * n / 1e9:.1f} GB "
          f"({'2 + 4 + 8' if args.bf16 else '4 + 4 + 8: the shard and its fp32 master are two files'}), "
          f"gradients in memory {(2 if args.bf16 else 4) * n / 1e9:.1f} GB", flush=True)
    block = 12 * args.embd * args.embd + 13 * args.embd
    where = {"device": "nvme", "nvme_path": args.nvme_path}
    config = {
        "train_batch_size": args.micro, "train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
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
    started = time.perf_counter()
    engine = zeroshard.initialize(model, config)
    init_s, init_rss = time.perf_counter() - started, _rss_peak_gib()
    print(f"initialize: {init_s:.1f} s (stopped {watch.stopped_s:.1f} s of it), peak RSS {init_rss:.2f} GiB "
          f"= {init_rss * 2**30 / n:.2f} bytes/parameter; "
          f"RSS now {_rss_peak_gib('VmRSS:'):.2f} GiB", flush=True)
    opt = engine.optimizer
    tiers = [opt.store.tier] + engine.param_tiers
    disk = _disk_of(args.nvme_path)
    on_disk = sum(t.bytes_on_disk for t in tiers)
    print(f"disk {disk}: {on_disk / 1e9:.1f} GB in the run folders after initialize", flush=True)
    tokens = synthetic_tokens(100_000, cfg.vocab_size)
    rows = []

    def dump(disk_bytes: int) -> None:  # after every step too: a stopped run keeps its rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "params": n, "disk_bytes": disk_bytes, "initialize_s": round(init_s, 1),
                           "initialize_peak_rss_gib": round(init_rss, 2), "rows": rows}, f, indent=1)

    def waits() -> float:
        return opt.store.io_wait_s + sum(t.ahead.wait_s for t in engine.param_tiers if t.ahead)

    for step in range(args.steps):
        x, y = global_batch(tokens, args.micro, args.seq, step)
        r0, w0 = sum(t.io.bytes_read for t in tiers), sum(t.io.bytes_written for t in tiers)
        wait0, ticks0, stop0 = waits(), _io_ticks_ms(disk), watch.stopped_s
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        ticks = _io_ticks_ms(disk) - ticks0
        row = {"step": step + 1, "loss": round(loss.item(), 4), "step_s": round(t2 - t0, 1),
               "fwd_bwd_s": round(t1 - t0, 1), "opt_step_s": round(t2 - t1, 1), "io_wait_s": round(waits() - wait0, 1),
               "read_gb": round((sum(t.io.bytes_read for t in tiers) - r0) / 1e9, 2),
               "written_gb": round((sum(t.io.bytes_written for t in tiers) - w0) / 1e9, 2),
               "disk_busy": round(ticks / 1000 / (t2 - t0), 2), "peak_rss_gib": round(_rss_peak_gib(), 2),
               "stopped_s": round(watch.stopped_s - stop0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        dump(on_disk)
    on_disk = sum(t.bytes_on_disk for t in tiers)
    print(f"disk space used by the run folders: {on_disk / 1e9:.1f} GB (checked against free space at start); "
          f"peak RSS {_rss_peak_gib():.2f} GiB; memory_stats: "
          + json.dumps({k: round(v / 2**30, 2) for k, v in engine.memory_stats().items() if k.startswith("tier")})
          + " GiB", flush=True)
    dump(on_disk)
    engine.close()


if __name__ == "__main__":
    main()
