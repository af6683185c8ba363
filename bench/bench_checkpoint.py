"""Checkpoint save / load / export throughput beside the raw disk bandwidth, measured in one run.

A ~200M-parameter GPT (16 layers, width 1024; fp32, AdamW, ZeRO stage 0, world size 1)
takes one optimizer step so every Adam state exists; then, interleaved for `--rounds`
rounds on the same directory:

  raw write   plain Python: write the checkpoint's byte count in 64 MiB chunks, fsync
  save        engine.save_checkpoint (sha256 of each file, fsync, atomic rename, latest)
  raw read    plain Python: read that file back, after dropping it from the page cache
  load        engine.load_checkpoint into the same engine, cache dropped first (includes
              verifying every file's sha256 and rebuilding shards from the recorded layout)
  export      zeroshard export --dtype fp32 (streams one tensor at a time, cache dropped)

Each row is the fastest round (disk noise only ever slows a run down); GB/s is 10^9
bytes per second; the target is save >= 50% of raw write. Every file written is deleted.

    python bench/bench_checkpoint.py [--rounds 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

import zeroshard
from zeroshard.checkpoint import export
from zeroshard.models import GPTConfig, build_gpt, num_parameters

CHUNK = 64 << 20
MODEL = GPTConfig(vocab_size=256, block_size=128, n_layer=16, n_head=16, n_embd=1024)


def drop_cache(path: str) -> None:
    """Evict `path` (a file, or every file under a directory) from the page cache; the pages
    are clean after fsync, so the kernel honours this without root."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: str, nbytes: int, block: bytes) -> float:
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(block)[: min(left, len(block))])
        os.fsync(f.fileno())
    return time.perf_counter() - started


def raw_read(path: str) -> float:
    drop_cache(path)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    return time.perf_counter() - started


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=".", help="where to write (a temporary directory is made inside)")
    args = parser.parse_args()
    for var in ("RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)

    torch.manual_seed(0)
    model = build_gpt(MODEL)
    params = num_parameters(model)
    engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 1,
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x = torch.randint(0, MODEL.vocab_size, (1, 16))
    engine.backward(engine(x, x)[1])
    engine.step()

    root = tempfile.mkdtemp(prefix="zeroshard-bench-ckpt-", dir=args.dir)
    block = os.urandom(CHUNK)
    best: dict[str, float] = {}
    sizes: dict[str, int] = {}
    try:
        for r in range(args.rounds):
            shutil.rmtree(os.path.join(root, "ck"), ignore_errors=True)
            shutil.rmtree(os.path.join(root, "hf"), ignore_errors=True)
            seconds = timed(lambda: engine.save_checkpoint(os.path.join(root, "ck"), tag="bench"))
            sizes["save"] = sizes["load"] = dir_bytes(os.path.join(root, "ck", "bench"))
            sizes["raw write"] = sizes["raw read"] = sizes["save"]
            rows = {"save": seconds}
            raw = os.path.join(root, "raw.bin")
            rows["raw write"] = raw_write(raw, sizes["save"], block)
            rows["raw read"] = raw_read(raw)
            os.remove(raw)
            drop_cache(os.path.join(root, "ck"))
            rows["load"] = timed(lambda: engine.load_checkpoint(os.path.join(root, "ck")))
            drop_cache(os.path.join(root, "ck"))
            rows["export fp32"] = timed(lambda: export(os.path.join(root, "ck"), os.path.join(root, "hf")))
            sizes["export fp32"] = dir_bytes(os.path.join(root, "hf"))
            for k, v in rows.items():
                best[k] = min(best.get(k, float("inf")), v)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in rows.items()), file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"model: GPT {MODEL.n_layer} layers x {MODEL.n_embd}, {params / 1e6:.1f}M parameters, fp32 AdamW, "
          f"stage 0, world size 1; checkpoint {sizes['save'] / 1e9:.2f} GB (fp32 master + exp_avg + exp_avg_sq); "
          f"fastest of {args.rounds} rounds; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'operation':<12} {'GB':>6} {'seconds':>8} {'GB/s':>6} {'of raw':>7}")
    for name, raw in (("raw write", None), ("save", "raw write"), ("raw read", None), ("load", "raw read"),
                      ("export fp32", "raw write")):
        gbps = sizes[name] / best[name] / 1e9
        ratio = "" if raw is None else f"{gbps / (sizes[raw] / best[raw] / 1e9):.0%}"
        print(f"{name:<12} {sizes[name] / 1e9:>6.2f} {best[name]:>8.2f} {gbps:>6.2f} {ratio:>7}")
    save_ratio = (sizes["save"] / best["save"]) / (sizes["raw write"] / best["raw write"])
    print(f"target: save >= 50% of raw write bandwidth: {'PASS' if save_ratio >= 0.5 else 'MISS'} ({save_ratio:.0%})")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
