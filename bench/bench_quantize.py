"""Benchmark: ZeRO++ block quantization (comm.quantization) beside a plain copy, same tensors,
same process, same threads (issue 24).

    python bench/bench_quantize.py                    # 1, 4, 16, 64 MiB; 1 thread; 9 rounds
    python bench/bench_quantize.py --threads 1,2 --rounds 5 --sizes 1,16
    python bench/bench_quantize.py --torch-ops        # also the torch formulation, interleaved

The rows are what `quantize` / `dequantize` run: the fused C kernel on CPU tensors where it
builds (comm.quantize_native; the first line says which), else the torch ops. With
`--torch-ops` every round also times quantize_torch / dequantize_torch on the same tensors
("torch" rows), so both implementations are compared in one run.

For each size (MiB of the 16/32-bit input), dtype (fp32, bf16) and width (int8: qwZ, int4: qgZ),
every round times, interleaved, one `dst.copy_(x)` of the same tensor into a buffer allocated
before the round, one `quantize(x)` and one `dequantize`, each into a preallocated output (`out=`,
as qwZ and qgZ do with their pooled payloads; a version without `out=` allocates its output). GB/s are bytes of the
input over the time; "q+dq" is the input over quantize + dequantize (the cost a quantized
collective adds per byte it quantizes and dequantizes once); "q+dq / copy" is the ratio of the
two in the same round, and "same, CPU time" that ratio in CPU seconds of the process (what
waiting for a core on a loaded machine does not inflate); "best, CPU" is the fastest copy over
the fastest quantize plus the fastest dequantize, in CPU seconds (what the code does when no
other process takes its core or its cache). The table gives medians over the rounds and
(min-max) spread: the machine is shared, so only figures of one round and one process are compared.

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


def _case(x: torch.Tensor, bits: int, rounds: int, quantize=quantize, dequantize=dequantize
          ) -> dict[str, list[float]]:
    blocks = plan_blocks(x.numel(), bits)
    row = x.view(1, -1)
    dst = torch.empty_like(x)
    q, s = quantize(row, blocks)
    takes_out = "out" in inspect.signature(dequantize).parameters
    out, q_out = torch.empty_like(row), (torch.empty_like(q), torch.empty_like(s))
    deq = (lambda: dequantize(q, s, blocks, x.dtype, out=out)) if takes_out else \
        (lambda: dequantize(q, s, blocks, x.dtype))
    quant = (lambda: quantize(row, blocks, out=q_out)) if "out" in inspect.signature(quantize).parameters else \
        (lambda: quantize(row, blocks))
    nbytes = x.numel() * x.element_size()
    for _ in range(2):  # warm-up: pages touched, allocator primed
        dst.copy_(x), quant(), deq()
    got: dict[str, list[float]] = {"copy": [], "quantize": [], "dequantize": [], "q+dq": [], "ratio": [],
                                   "cpu ratio": [], "cpu copy": [], "cpu q": [], "cpu dq": []}
    for _ in range(rounds):
        (t_copy, c_copy), (t_q, c_q), (t_dq, c_dq) = _timed(lambda: dst.copy_(x)), \
            _timed(quant), _timed(deq)
        if c_q + c_dq > 0:
            got["cpu ratio"].append(c_copy / (c_q + c_dq))
        got["cpu copy"].append(c_copy), got["cpu q"].append(c_q), got["cpu dq"].append(c_dq)
        got["copy"].append(nbytes / t_copy / 1e9)
        got["quantize"].append(nbytes / t_q / 1e9)
        got["dequantize"].append(nbytes / t_dq / 1e9)
        got["q+dq"].append(nbytes / (t_q + t_dq) / 1e9)
        got["ratio"].append(t_copy / (t_q + t_dq))
    return got


def _best(r: dict[str, list[float]]) -> float:
    """Copy over quantize + dequantize in CPU seconds, each the fastest of its rounds: what
    the code can do when no other process evicts its cache or takes its core."""
    q_dq = min(r["cpu q"]) + min(r["cpu dq"])
    return min(r["cpu copy"]) / q_dq if q_dq > 0 else 0.0


def _fmt(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1", help="torch threads, comma-separated")
    ap.add_argument("--sizes", default="1,4,16,64", help="MiB of the input, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--torch-ops", action="store_true", help="also time the torch formulation, interleaved")
    args = ap.parse_args()
    import zeroshard.comm.quantization as impl

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; "
          f"{impl.__file__}")
    try:
        from zeroshard.comm import quantize_native
        print(f"quantize / dequantize on CPU: {quantize_native.status()}")
    except ImportError:  # a checkout from before the kernel
        print("quantize / dequantize on CPU: torch ops (no comm.quantize_native)")
    impls = [("", quantize, dequantize)]
    if args.torch_ops:
        impls.append(("torch", impl.quantize_torch, impl.dequantize_torch))
    print(f"GB/s of the input, median over {args.rounds} rounds (min-max); copy and quantize interleaved")
    print(f"{'impl':5} {'thr':>3} {'MiB':>4} {'dtype':6} {'int':>3}  {'copy':>20} {'quantize':>20} {'dequantize':>20} "
          f"{'q+dq':>20} {'q+dq / copy':>20} {'same, CPU time':>20} {'best, CPU':>9}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for mib in (int(m) for m in args.sizes.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                numel = (mib << 20) // torch.empty(0, dtype=dtype).element_size()
                x = torch.randn(numel, generator=torch.Generator().manual_seed(mib)).to(dtype)
                for bits, (name, q_fn, dq_fn) in ((b, i) for b in (8, 4) for i in impls):
                    r = _case(x, bits, args.rounds, q_fn, dq_fn)
                    print(f"{name:5} {threads:>3} {mib:>4} {str(dtype)[6:]:6} {bits:>3}  {_fmt(r['copy']):>20} "
                          f"{_fmt(r['quantize']):>20} {_fmt(r['dequantize']):>20} {_fmt(r['q+dq']):>20} "
                          f"{_fmt(r['ratio']):>20} {_fmt(r['cpu ratio'] or [0.0]):>20} {_best(r):>9.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
