"""Benchmark: ZeRO++ block quantization (comm.quantization) beside a plain copy, same tensors,
same process, same threads (issue 24).

    python bench/bench_quantize.py                    # 1, 4, 16, 64 MiB; 1 and 2 threads; 9 rounds
    python bench/bench_quantize.py --threads 1 --rounds 5 --sizes 1,16

For each size (MiB of the 16/32-bit input), dtype (fp32, bf16) and width (int8: qwZ, int4: qgZ),
every round times, interleaved, one `dst.copy_(x)` of the same tensor into a buffer allocated
before the round, one `quantize(x)` and one `dequantize` into a preallocated output (`out=`, as
qwZ's all-gather does; a version without `out=` allocates its output). GB/s are bytes of the
input over the time; "q+dq" is the input over quantize + dequantize (the cost a quantized
collective adds per byte it quantizes and dequantizes once); "q+dq / copy" is the ratio of the
two in the same round, and "same, CPU time" that ratio in CPU seconds of the process (what
waiting for a core on a loaded machine does not inflate). The table gives medians over the rounds and (min-max) spread: the
machine is shared, so only figures of one round and one process are compared.

Run it against another checkout with PYTHONPATH=<checkout>/src to measure "before".
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import torch

from zeroshard.comm import dequantize, plan_blocks, quantize


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process: every torch thread)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _case(x: torch.Tensor, bits: int, rounds: int) -> dict[str, list[float]]:
    blocks = plan_blocks(x.numel(), bits)
    row = x.view(1, -1)
    dst = torch.empty_like(x)
    q, s = quantize(row, blocks)
    takes_out = "out" in inspect.signature(dequantize).parameters
    out = torch.empty_like(row)
    deq = (lambda: dequantize(q, s, blocks, x.dtype, out=out)) if takes_out else \
        (lambda: dequantize(q, s, blocks, x.dtype))
    nbytes = x.numel() * x.element_size()
    for _ in range(2):  # warm-up: pages touched, allocator primed
        dst.copy_(x), quantize(row, blocks), deq()
    got: dict[str, list[float]] = {"copy": [], "quantize": [], "dequantize": [], "q+dq": [], "ratio": [],
                                   "cpu ratio": []}
    for _ in range(rounds):
        (t_copy, c_copy), (t_q, c_q), (t_dq, c_dq) = _timed(lambda: dst.copy_(x)), \
            _timed(lambda: quantize(row, blocks)), _timed(deq)
        if c_q + c_dq > 0:
            got["cpu ratio"].append(c_copy / (c_q + c_dq))
        got["copy"].append(nbytes / t_copy / 1e9)
        got["quantize"].append(nbytes / t_q / 1e9)
        got["dequantize"].append(nbytes / t_dq / 1e9)
        got["q+dq"].append(nbytes / (t_q + t_dq) / 1e9)
        got["ratio"].append(t_copy / (t_q + t_dq))
    return got


def _fmt(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2", help="torch threads, comma-separated")
    ap.add_argument("--sizes", default="1,4,16,64", help="MiB of the input, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import zeroshard.comm.quantization as impl

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; "
          f"{impl.__file__}")
    print(f"GB/s of the input, median over {args.rounds} rounds (min-max); copy and quantize interleaved")
    print(f"{'thr':>3} {'MiB':>4} {'dtype':6} {'int':>3}  {'copy':>20} {'quantize':>20} {'dequantize':>20} "
          f"{'q+dq':>20} {'q+dq / copy':>20} {'same, CPU time':>20}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for mib in (int(m) for m in args.sizes.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                numel = (mib << 20) // torch.empty(0, dtype=dtype).element_size()
                x = torch.randn(numel, generator=torch.Generator().manual_seed(mib)).to(dtype)
                for bits in (8, 4):
                    r = _case(x, bits, args.rounds)
                    print(f"{threads:>3} {mib:>4} {str(dtype)[6:]:6} {bits:>3}  {_fmt(r['copy']):>20} "
                          f"{_fmt(r['quantize']):>20} {_fmt(r['dequantize']):>20} {_fmt(r['q+dq']):>20} "
                          f"{_fmt(r['ratio']):>20} {_fmt(r['cpu ratio'] or [0.0]):>20}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
