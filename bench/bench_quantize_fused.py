"""The fused C quantizer prototype (bench/quantize_fused.c, issue 24) against comm.quantization:
same payload, scales and dequantized values, and its quantize + dequantize CPU time beside a
copy's, one thread, interleaved in one process.

    gcc -O3 -march=native -fno-math-errno -ffp-contract=off -fPIC -shared -o /tmp/fused.so bench/quantize_fused.c
    python bench/bench_quantize_fused.py /tmp/fused.so
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

from zeroshard.comm import dequantize, plan_blocks, quantize


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.zs_quantize.argtypes = [ptr, i32, i64, i64, i64, i32, ptr, ptr, i64, i64]
    lib.zs_dequantize.argtypes = [ptr, ptr, i32, i64, i64, i64, ptr, i32, i64, i64]
    torch.set_num_threads(1)

    def fq(x, b):
        rows = x.reshape(-1, b.n)
        pay = torch.empty(rows.shape[0], b.payload_bytes, dtype=torch.int8)
        sc = torch.empty(rows.shape[0], b.count)
        lib.zs_quantize(rows.data_ptr(), int(x.dtype == torch.bfloat16), b.n, b.count, b.size, b.bits,
                        pay.data_ptr(), sc.data_ptr(), 0, rows.shape[0] * b.count)
        return pay, sc

    def fdq(pay, sc, b, out):
        lib.zs_dequantize(pay.data_ptr(), sc.data_ptr(), b.bits, b.n, b.count, b.size, out.data_ptr(),
                          int(out.dtype == torch.bfloat16), 0, sc.shape[0] * b.count)
        return out

    g, cases, bad = torch.Generator().manual_seed(1), 0, 0
    for n in (1, 7, 2048, 2049, 5000, 70001):
        for rows in (1, 3):
            for dtype in (torch.float32, torch.bfloat16):
                for bits in (8, 4):
                    for max_block in (64, 2048):
                        x = (torch.randn(rows, n, generator=g) * 10).to(dtype)
                        if n > 3000:
                            x[:, 100:2200] = 0
                        b = plan_blocks(n, bits, max_block)
                        (q1, s1), (q2, s2) = quantize(x, b), fq(x, b)
                        d1, d2 = dequantize(q1, s1, b, dtype), fdq(q2, s2, b, torch.empty(rows, n, dtype=dtype))
                        cases += 1
                        bad += not (torch.equal(q1, q2) and torch.equal(s1, s2) and torch.equal(d1, d2))
    print(f"{cases} cases, {bad} differ from comm.quantization")
    print("MiB dtype     CPU GB/s: copy  quantize  dequantize  q+dq / copy (medians of 7, int8)")
    for mib in (1, 4, 16, 64):
        for dtype in (torch.float32, torch.bfloat16):
            numel = (mib << 20) // torch.empty(0, dtype=dtype).element_size()
            x = torch.randn(numel).to(dtype)
            dst, out, b = torch.empty_like(x), torch.empty(1, numel, dtype=dtype), plan_blocks(numel, 8)
            q, s = fq(x, b)
            fns = {"c": lambda: dst.copy_(x), "q": lambda: fq(x, b), "d": lambda: fdq(q, s, b, out)}
            got = {k: [] for k in fns}
            for f in fns.values():
                f()
            for _ in range(7):
                for k, f in fns.items():
                    t = time.process_time()
                    f()
                    got[k].append(time.process_time() - t)
            m = {k: statistics.median(v) for k, v in got.items()}
            nb = numel * x.element_size()
            print(f"{mib:3} {str(dtype)[6:]:9} {nb / m['c'] / 1e9:15.2f} {nb / m['q'] / 1e9:9.2f} "
                  f"{nb / m['d'] / 1e9:11.2f} {m['c'] / (m['q'] + m['d']):12.2f}")


if __name__ == "__main__":
    main()
