"""Checkpoint save / load / export beside the raw disk doing the same work, measured in one run.

A ~200M-parameter GPT (16 layers, width 1024; fp32, AdamW, ZeRO stage 0, world size 1)
takes one optimizer step so every Adam state exists; then `--rounds` rounds (default 4) on
the same directory, each timing

  save        engine.save_checkpoint (streaming safetensors writer, sha256 on a helper
              thread, fsync of every file, meta.json, atomic rename, `latest`)
  raw write   plain Python writing the *same bytes* (the checkpoint's files, read into memory
              beforehand) to one file in 64 MiB unbuffered writes, then one fsync
  load        engine.load_checkpoint into the same engine (sha256 of every file, then the data)
  raw read    plain Python reading the raw file back in 64 MiB reads
  export      zeroshard export --dtype fp32 (streams one tensor at a time)

Fairness: save and raw write run in alternating order (odd rounds save first, even rounds
raw first), as do load and raw read, so neither always meets the disk after the other.
Page cache: both writes end with fsync, so the time includes getting every byte to the disk,
and before each timed write `os.sync()` flushes everyone's dirty pages, so neither pays for
the other's writeback. Before each timed read the file's pages are evicted with
posix_fadvise(DONTNEED) after an fsync (clean pages are dropped without root), so reads come
from the disk. The whole system's cache is not dropped (writing /proc/sys/vm/drop_caches is
refused here, or, as root on a shared machine, would slow every other user; `--drop-caches`
does it before each timed operation where it is allowed). The checkpoint (2.4 GB) is smaller
than RAM, so the cache could hold it: the fsync and fadvise above are what keep it honest.

The ratio "of raw" is save bandwidth / raw-write bandwidth of the same bytes in the same round
(median over rounds; the median, min and max seconds of each operation are printed too): 100%
means the checkpoint machinery (header, sha256, two files, meta.json, renames, directory fsyncs)
costs nothing beyond the disk; under 100% is its overhead; over 100% means the plain write was
slower in that round (disk noise: a single run cannot beat the disk). Every file written is
deleted. GB/s is 10^9 bytes per second; the target is save >= 50% of raw write.

    python bench/bench_checkpoint.py [--rounds 4] [--dir DIR] [--drop-caches]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
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


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_all_caches() -> None:
    """The whole system's clean page cache (needs root and a writable /proc/sys)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("1\n")


def can_drop_all_caches() -> str | None:
    """None when /proc/sys/vm/drop_caches can be written, else why not."""
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
    except OSError as exc:
        return f"{DROP_CACHES}: {exc.strerror}"
    return None


def raw_write(path: str, pieces: list[bytes]) -> float:
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for piece in pieces:
            view = memoryview(piece)
            for lo in range(0, len(view), CHUNK):
                chunk = view[lo : lo + CHUNK]
                while len(chunk):
                    chunk = chunk[f.write(chunk):]
        os.fsync(f.fileno())
    return time.perf_counter() - started


def raw_read(path: str) -> float:
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    return time.perf_counter() - started


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def file_bytes(path: str) -> list[bytes]:
    out = []
    for d, _, fs in sorted(os.walk(path)):
        for name in sorted(fs):
            with open(os.path.join(d, name), "rb") as f:
                out.append(f.read())
    return out


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=".", help="where to write (a temporary directory is made inside)")
    parser.add_argument("--drop-caches", action="store_true",
                        help=f"also drop the whole page cache ({DROP_CACHES}) before each timed operation")
    args = parser.parse_args()
    for var in ("RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    why_not = can_drop_all_caches() if args.drop_caches else None
    if why_not:
        print(f"bench_checkpoint: --drop-caches: {why_not}", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    model = build_gpt(MODEL)
    params = num_parameters(model)
    engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 1,
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x = torch.randint(0, MODEL.vocab_size, (1, 16))
    engine.backward(engine(x, x)[1])
    engine.step()

    root = tempfile.mkdtemp(prefix="zeroshard-bench-ckpt-", dir=args.dir)
    ck, hf, raw = os.path.join(root, "ck"), os.path.join(root, "hf"), os.path.join(root, "raw.bin")
    runs: dict[str, list[float]] = {k: [] for k in ("save", "raw write", "load", "raw read", "export fp32")}
    sizes: dict[str, int] = {}

    def before() -> None:  # every timed operation starts with no one's dirty pages pending
        if args.drop_caches:
            drop_all_caches()
        else:
            os.sync()

    try:
        engine.save_checkpoint(ck, tag="bench")  # once, untimed: the bytes the raw write copies
        pieces = file_bytes(os.path.join(ck, "bench"))
        sizes["save"] = sizes["load"] = sizes["raw write"] = sizes["raw read"] = sum(len(p) for p in pieces)
        for r in range(args.rounds):
            rows: dict[str, float] = {}
            shutil.rmtree(ck, ignore_errors=True)
            shutil.rmtree(hf, ignore_errors=True)
            if os.path.exists(raw):
                os.remove(raw)
            writes = ["save", "raw write"] if r % 2 == 0 else ["raw write", "save"]
            for op in writes:
                before()
                rows[op] = (timed(lambda: engine.save_checkpoint(ck, tag="bench")) if op == "save"
                            else raw_write(raw, pieces))
            for op in (["load", "raw read"] if r % 2 == 0 else ["raw read", "load"]):
                drop_cache(ck if op == "load" else raw)
                before()
                rows[op] = timed(lambda: engine.load_checkpoint(ck)) if op == "load" else raw_read(raw)
            drop_cache(ck)
            before()
            rows["export fp32"] = timed(lambda: export(ck, hf))
            sizes["export fp32"] = dir_bytes(hf)
            for k, v in rows.items():
                runs[k].append(v)
            print(f"round {r + 1} ({' then '.join(writes)}): " + ", ".join(f"{k} {v:.2f}s" for k, v in rows.items()),
                  file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cache = ("whole page cache dropped before each operation" if args.drop_caches else
             "os.sync() before each operation, files evicted with fadvise(DONTNEED) before reads")
    print(f"model: GPT {MODEL.n_layer} layers x {MODEL.n_embd}, {params / 1e6:.1f}M parameters, fp32 AdamW, "
          f"stage 0, world size 1; checkpoint {sizes['save'] / 1e9:.2f} GB (fp32 master + exp_avg + exp_avg_sq); "
          f"{args.rounds} rounds, alternating order; {cache}; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'operation':<12} {'GB':>6} {'median s':>9} {'min s':>6} {'max s':>6} {'GB/s':>6} {'of raw':>7}")
    for name, base in (("raw write", None), ("save", "raw write"), ("raw read", None), ("load", "raw read"),
                       ("export fp32", "raw write")):
        med = statistics.median(runs[name])
        gbps = sizes[name] / med / 1e9
        ratio = ""
        if base is not None:  # bandwidth ratio within each round, then the median of those
            ratio = f"{statistics.median((sizes[name] / a) / (sizes[base] / b) for a, b in zip(runs[name], runs[base])):.0%}"
        print(f"{name:<12} {sizes[name] / 1e9:>6.2f} {med:>9.2f} {min(runs[name]):>6.2f} {max(runs[name]):>6.2f} "
              f"{gbps:>6.2f} {ratio:>7}")
    per_round = [b / a for a, b in zip(runs["save"], runs["raw write"])]  # same bytes: bandwidth ratio = time ratio
    save_ratio = statistics.median(per_round)
    print(f"save / raw write per round: {', '.join(f'{v:.0%}' for v in per_round)}")
    print(f"target: save >= 50% of raw write bandwidth: {'PASS' if save_ratio >= 0.5 else 'MISS'} "
          f"({save_ratio:.0%}, median of the rounds)")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
