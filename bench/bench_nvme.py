"""Benchmark: zeroshard's NVMe tier (ZeRO-Infinity) on this machine.

    python bench/bench_nvme.py --nvme-path /tmp/nvme_bench            # "50m" GPT, ~3-6 min on 2 cores
    python bench/bench_nvme.py --nvme-path /tmp/nvme_bench --quick    # "mini" GPT smoke run
    python bench/bench_nvme.py --nvme-path /tmp/nvme_bench --mib 256 --io-only   # part 1 only, ~1 min

1. Swap I/O vs the raw disk, same path, same run: `dd` with oflag=direct / iflag=direct
   (1 MiB blocks) beside zeroshard's I/O engine (offload/aio.py: thread pool, os.pwritev/preadv,
   O_DIRECT) writing and reading the same number of bytes with the default aio settings;
   --rounds interleaved rounds, medians.
2. Step time of one process (world size 1, stage 3, fp32, AdamW) with the optimizer states
   on the host (offload_optimizer: cpu), in files (nvme), and with the parameters in files too.
   Per variant: median step time over the measured steps (the first step, which creates the
   optimizer states, is a warm-up), the time the step spent waiting for I/O, and the bytes the
   tiers read and wrote per step.
3. DeepSpeed stage 3 + NVMe: its async_io op needs libaio; whether it can be built here is
   printed (and the run skipped when it cannot).

The machine may be shared: numbers are noisy; run it twice before trusting a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def _dd(path: str, mib: int) -> tuple[float, float]:
    """(write, read) GB/s of dd with O_DIRECT on `path`."""
    target = os.path.join(path, "dd-probe.bin")

    def rate(args: list[str]) -> float:
        out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
        return int(m.group(1)) / float(m.group(2)) / 1e9

    try:
        w = rate(["if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
        r = rate([f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        if os.path.exists(target):
            os.unlink(target)
    return w, r


def _engine(path: str, mib: int, request_mib: int = 0, block_kib: int = 1024, queue_depth: int = 8
            ) -> tuple[float, float, str]:
    """(write, read) GB/s of the I/O engine moving `mib` MiB in requests of `request_mib` MiB
    (0: one request), all submitted at once as the swap pipeline does, with the given aio knobs."""
    from zeroshard.offload.aio import IOEngine, aligned_empty
    from zeroshard.offload.nvme import aio_settings
    from zeroshard.policies import AioPolicy

    settings, _ = aio_settings(AioPolicy(block_size=block_kib << 10, queue_depth=queue_depth))
    folder = tempfile.mkdtemp(dir=path)
    io = IOEngine(folder, settings)
    size = (request_mib or mib) << 20
    try:
        f = io.open("swap.bin")
        buf = aligned_empty(mib << 20)
        buf.fill_(3)
        spans = [(o, min(size, (mib << 20) - o)) for o in range(0, mib << 20, size)]
        t = time.perf_counter()
        for h in [io.write(f, buf[o:o + n], o) for o, n in spans]:
            h.wait()
        os.fsync(io._fds[f][0])
        w = (mib << 20) / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for h in [io.read(f, buf[o:o + n], o) for o, n in spans]:
            h.wait()
        r = (mib << 20) / (time.perf_counter() - t) / 1e9
        return w, r, io.describe()
    finally:
        io.close()
        shutil.rmtree(folder, ignore_errors=True)


def _sweep(path: str, mib: int, requests: list[int], blocks: list[int], depths: list[int]) -> list[dict]:
    """dd beside the engine for each (request size, aio block size, queue depth), interleaved."""
    rows = []
    for req in requests:
        for block in blocks:
            for depth in depths:
                dd_w, dd_r = _dd(path, mib)
                w, r, _ = _engine(path, mib, req, block, depth)
                rows.append({"request_mib": req, "block_kib": block, "queue_depth": depth,
                             "dd_write_gbs": round(dd_w, 3), "engine_write_gbs": round(w, 3),
                             "write_ratio": round(w / dd_w, 2), "dd_read_gbs": round(dd_r, 3),
                             "engine_read_gbs": round(r, 3), "read_ratio": round(r / dd_r, 2)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _step_times(preset: str, offload: str, path: str, steps: int, seq: int, micro: int) -> dict:
    """One process, stage 3; `offload` in cpu | nvme | nvme+params."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    import zeroshard
    from zeroshard.models import build_gpt, global_batch, synthetic_tokens

    torch.manual_seed(0)
    model = build_gpt(preset)
    vocab = model.config.vocab_size
    where = {"device": "nvme", "nvme_path": path} if offload.startswith("nvme") else {"device": "cpu"}
    zero = {"stage": 3, "offload_optimizer": dict(where), "sub_group_size": 2_000_000,
            "stage3_param_persistence_threshold": 0}
    if offload == "nvme+params":
        zero["offload_param"] = {**where, "buffer_count": 4, "buffer_size": 50_000_000}
    cfg = {"train_batch_size": micro, "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero,
           "zeroshard": {"stage3_unit_classes": ["Block"]}}
    engine = zeroshard.initialize(model, cfg)
    tokens = synthetic_tokens(200_000, vocab)
    opt = engine.optimizer
    swap = opt.store if hasattr(opt.store, "tier") else None  # the NVMe swap pipeline, when the optimizer has one
    tiers = [t for t in [swap and swap.tier] + engine.param_tiers if t]

    def io_state():
        wait = (swap.io_wait_s if swap else 0.0) + sum(t.ahead.wait_s for t in engine.param_tiers if t.ahead)
        return (wait, sum(t.io.bytes_read for t in tiers if hasattr(t, "io")),
                sum(t.io.bytes_written for t in tiers if hasattr(t, "io")))

    rows = []
    for step in range(steps + 1):
        x, y = global_batch(tokens, micro, seq, step)
        w0, r0, b0 = io_state()
        t = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        t_fb = time.perf_counter()
        engine.step()
        t_end = time.perf_counter()
        w1, r1, b1 = io_state()
        rows.append({"step_s": t_end - t, "fwd_bwd_s": t_fb - t, "opt_s": t_end - t_fb, "io_wait_s": w1 - w0,
                     "read_mb": (r1 - r0) / 1e6, "written_mb": (b1 - b0) / 1e6, "loss": loss.item()})
    engine.close()
    measured = rows[1:]
    med = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
    return {"offload": offload, "preset": preset, "params": sum(p.numel() for p in model.parameters()),
            "steps": steps, **{k: round(v, 3) for k, v in med.items()}}


def _deepspeed_nvme() -> str:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        return f"DeepSpeed not importable: {exc}"
    import io
    import contextlib

    # Not under contextlib.redirect_*: DeepSpeed's has_function() compiles its libaio probe with
    # sys.stderr.fileno() redirected, and a StringIO has no fileno(): the probe's exception is
    # swallowed as "not compatible" (a false "libaio not found" when libaio-dev is installed).
    if AsyncIOBuilder().is_compatible(verbose=False):
        return "DeepSpeed async_io is buildable here (its stage 3 + NVMe: the peer harness, system ds3_nvme)"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        AsyncIOBuilder().is_compatible(verbose=True)
    why = " ".join(line.strip() for line in buf.getvalue().splitlines() if "async_io" in line)
    return f"DeepSpeed stage 3 + NVMe cannot run here: AsyncIOBuilder().is_compatible() is False ({why})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mib", type=int, default=512, help="bytes for the I/O comparison, MiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="interleaved dd / engine rounds (medians reported)")
    p.add_argument("--io-only", action="store_true", help="part 1 only (swap I/O vs dd), then the DeepSpeed line")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--sweep", action="store_true",
                   help="with --io-only: request sizes x aio block sizes x queue depths, each beside dd")
    p.add_argument("--requests", default="8,64", help="--sweep: request sizes, MiB (what the pipeline issues)")
    p.add_argument("--blocks", default="1024,4096", help="--sweep: aio.block_size values, KiB")
    p.add_argument("--depths", default="4,8,16", help="--sweep: aio.queue_depth values")
    args = p.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    torch.set_num_threads(2)
    out: dict = {"command": " ".join(sys.argv)}
    mib = 64 if args.quick else args.mib
    rounds = [(_dd(args.nvme_path, mib), _engine(args.nvme_path, mib)) for _ in range(args.rounds)]  # interleaved
    dd_w = statistics.median(d[0] for d, _ in rounds)
    dd_r = statistics.median(d[1] for d, _ in rounds)
    en_w = statistics.median(e[0] for _, e in rounds)
    en_r = statistics.median(e[1] for _, e in rounds)
    how = rounds[0][1][2]
    out["io"] = {"mib": mib, "rounds": args.rounds, "dd_write_gbs": round(dd_w, 3), "dd_read_gbs": round(dd_r, 3),
                 "engine_write_gbs": round(en_w, 3), "engine_read_gbs": round(en_r, 3),
                 "write_ratio": round(en_w / dd_w, 2), "read_ratio": round(en_r / dd_r, 2), "engine": how}
    print(json.dumps(out["io"]), flush=True)
    if args.sweep:
        ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
        out["sweep"] = _sweep(args.nvme_path, mib, ints(args.requests), ints(args.blocks), ints(args.depths))
    preset = "mini" if args.quick else "50m"
    out["steps"] = []
    for offload in () if args.io_only else ("cpu", "nvme", "nvme+params"):
        row = _step_times(preset, offload, args.nvme_path, args.steps, 64, 4)
        out["steps"].append(row)
        print(json.dumps(row), flush=True)
    out["deepspeed"] = _deepspeed_nvme()
    print(out["deepspeed"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
