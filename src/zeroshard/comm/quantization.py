"""Block-wise symmetric quantization for ZeRO++ (qwZ int8, qgZ int4 / int8) in plain torch
ops. The blocking (comm.blocks.plan_blocks): rows cut in
equal blocks, the last padded with zeros. Each block keeps one fp32 scale, `absmax / qmax`
(qmax 127 for int8, 7 for int4), and values are rounded to the nearest step: the error of an
element is at most scale / 2 = absmax / (2 qmax) of its block.

The arithmetic runs in fp32 whatever the input dtype: bf16 and fp32 go to fp32
exactly, and nothing is cast to fp16 (DeepSpeed's kernels cast bf16 to fp16, which
overflows above 65504). An all-zero block gets scale 0 and dequantizes to zeros; a
non-finite value makes its block's scale non-finite, so an overflow stays visible
after dequantization instead of being clipped away.

Speed (bench/bench_quantize.py, bench/RESULTS.md): quantization walks the blocks in chunks of
about CHUNK_ELEMENTS values, so the second read of a chunk (absmax, then scale and round) and
its fp32 working buffer stay in cache and no full-size float temporary is allocated; the
payload is written in place. Dequantization converts the payload straight into the caller's
output (`out=`) and scales it there: one write of the output, no temporary of its size.

On CPU tensors (fp32, bf16; contiguous) both run comm.quantize_native's fused C kernel when it
builds: the same payload, scales and values bit for bit (tests/test_quantize_native.py), in
one pass per block each way instead of five to seven. `quantize_torch` / `dequantize_torch`
are the torch formulation, run where the kernel does not apply (GPU tensors, fp16, no C
compiler) and kept as the reference the kernel is tested against.
"""

from __future__ import annotations

import sys
import threading

import torch

from zeroshard.comm import quantize_native as native
from zeroshard.comm.blocks import QMAX as _QMAX
from zeroshard.comm.blocks import Blocks


_LITTLE_ENDIAN = sys.byteorder == "little"  # int4 packing reads byte pairs as int16
CHUNK_ELEMENTS = 1 << 17  # values per pass and torch thread: 512 KiB of fp32, one core's L2


class _Work:
    """The fp32 buffers a (de)quantization reuses for every chunk of `per` blocks, kept per
    thread and device between calls: a fresh megabyte per call costs its page faults."""

    _local = threading.local()

    def __init__(self, values: torch.Tensor, small: torch.Tensor) -> None:
        self.values, self.small = values, small

    @classmethod
    def get(cls, per: int, size: int, device: torch.device) -> "_Work":
        cache = cls._local.__dict__.setdefault("buffers", {})
        have = cache.get(device)
        if have is None or have.values.numel() < per * size or have.small.shape[1] < per:
            have = cls(torch.empty(max(per * size, CHUNK_ELEMENTS), dtype=torch.float32, device=device),
                       torch.empty(2, max(per, 64), dtype=torch.float32, device=device))
            cache[device] = have
        return have

    def block_view(self, b: int, size: int) -> torch.Tensor:
        return self.values[: b * size].view(b, size)


def _quantize_chunk(v: torch.Tensor, qmax: int, scales: torch.Tensor, q: torch.Tensor, work: _Work) -> None:
    """Blocks `v` (b, size) of one chunk: their scales into `scales` (b,), their rounded
    values into `q` (b, size; int8). Every pass after the first reads the chunk from cache."""
    b, size = v.shape
    f = work.block_view(b, size)
    if v.dtype != torch.float32:  # bf16 / fp16 -> fp32 once (exact), then fp32 passes
        v = f.copy_(v)
    low, inv = work.small[0, :b], work.small[1, :b]
    torch.amax(v, dim=1, out=scales)  # absmax = max(max, -min): two fast reductions, no |v|
    torch.amin(v, dim=1, out=low)     # temporary (NaN and inf propagate into the scale)
    torch.maximum(scales, low.neg_(), out=scales)
    scales.div_(qmax)
    # 1 / scale, 0 where the scale is 0 (an all-zero block quantizes to zeros) or not finite
    # (the block's values do not matter: its scale carries the overflow)
    torch.reciprocal(scales, out=inv).nan_to_num_(nan=0.0, posinf=0.0)
    torch.mul(v, inv.unsqueeze(1), out=f)
    # |v| <= absmax, so |v / scale| <= qmax (to within an ulp): rounding keeps it in range, no clamp
    q.copy_(f.round_())


def _dequantize_chunk(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, work: _Work) -> None:
    """`out` (b, size) = `q` (b, size; int8) x `scales` (b,), computed in fp32."""
    if out.dtype == torch.float32:
        out.copy_(q).mul_(scales.unsqueeze(1))  # int8 -> fp32 exact, then scaled in cache
    else:
        out.copy_(work.block_view(*q.shape).copy_(q).mul_(scales.unsqueeze(1)))  # fp32, rounded once


def _chunks(blocks: Blocks) -> tuple[int, int, list[tuple[int, int]]]:
    """Blocks per chunk (CHUNK_ELEMENTS per torch thread: each thread's share stays in its core's
    cache, and fewer, larger ops mean fewer of the threads' joins), the blocks without padding
    (all but a padded last one) and the chunks of those, as (first, end) block indices."""
    count, size = blocks.count, blocks.size
    per = max(1, min(count, CHUNK_ELEMENTS * max(1, torch.get_num_threads()) // size))
    full = count if blocks.padded == blocks.n else count - 1
    return per, full, [(lo, min(full, lo + per)) for lo in range(0, full, per)]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_for(*tensors: torch.Tensor):
    """The fused kernel where it applies to these tensors (CPU, contiguous), else None. Plain
    attribute tests, no generator: a call's fixed cost counts for the small buckets of a
    small model (bench/RESULTS.md)."""
    for t in tensors:
        if not (t.is_cpu and t.is_contiguous()):
            return None
    return native.kernel()


def _as_rows(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    return t if t.dim() == 2 and t.shape[0] == r and t.shape[1] == n else t.view(r, n)


def quantize(x: torch.Tensor, blocks: Blocks,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`: (rows, n) or (n,). Returns (payload, scales): payload int8 of shape
    (rows, payload_bytes) (int4: two values per byte, low nibble first, stored as int8 bits),
    scales fp32 (rows, count); written into `out` (payload, scales) of those sizes when given,
    except by the torch ops at int4 (they pack into new tensors): use the tensors returned."""
    n = blocks.n
    rows = x if x.dim() == 2 and x.shape[1] == n else x.reshape(-1, n)
    r = rows.shape[0]
    lib = (_kernel_for(rows) if out is None else _kernel_for(rows, *out)) if x.dtype in _NATIVE_DTYPES else None
    if lib is None:
        return quantize_torch(x, blocks, out)
    if out is not None:
        payload, scales = _as_rows(out[0], r, blocks.payload_bytes), _as_rows(out[1], r, blocks.count)
    else:
        payload = torch.empty(r, blocks.payload_bytes, dtype=torch.int8)
        scales = torch.empty(r, blocks.count, dtype=torch.float32)
    if lib.zs_quantize(rows.data_ptr(), x.dtype == torch.bfloat16, n, blocks.count, blocks.size,
                       blocks.bits, payload.data_ptr(), scales.data_ptr(), 0, r * blocks.count):
        raise MemoryError(f"quantize: no memory for a working block of {blocks.size} values")
    return payload, scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, blocks: Blocks,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize`: (rows, n) in `dtype` (computed in fp32), written into `out`
    ((rows, n) of `dtype`, e.g. the all-gather's output) when given."""
    r = scales.shape[0]
    dst = torch.empty(r, blocks.n, dtype=dtype, device=payload.device) if out is None else _as_rows(out, r, blocks.n)
    native_ok = dst.dtype in _NATIVE_DTYPES and scales.dtype == torch.float32 and payload.dtype == torch.int8
    lib = _kernel_for(payload, scales, dst) if native_ok else None
    if lib is None:
        return dequantize_torch(payload, scales, blocks, dtype, dst)
    if payload.numel() != r * blocks.payload_bytes or scales.numel() != r * blocks.count:
        raise ValueError(f"dequantize: {payload.numel()} payload bytes and {scales.numel()} scales for {r} rows "
                         f"of {blocks.payload_bytes} and {blocks.count}; pass quantize's (payload, scales)")
    lib.zs_dequantize(payload.data_ptr(), scales.data_ptr(), blocks.bits, blocks.n, blocks.count, blocks.size,
                      dst.data_ptr(), dst.dtype == torch.bfloat16, 0, r * blocks.count)
    return dst


def quantize_torch(x: torch.Tensor, blocks: Blocks,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` in torch ops (any device and floating dtype): the reference."""
    rows = x.reshape(-1, blocks.n)
    r, count, size, n = rows.shape[0], blocks.count, blocks.size, blocks.n
    if out is not None and blocks.bits == 8:
        values, scales = out[0].view(r, blocks.padded), out[1].view(r, count)
    else:
        scales = torch.empty(r, count, dtype=torch.float32, device=x.device)
        values = torch.empty(r, blocks.padded, dtype=torch.int8, device=x.device)  # int4: unpacked first
    per, full, spans = _chunks(blocks)
    work, qmax = _Work.get(per, size, x.device), _QMAX[blocks.bits]
    for i in range(r):
        v, qv = rows[i, : full * size].view(full, size), values[i, : full * size].view(full, size)
        for lo, hi in spans:
            _quantize_chunk(v[lo:hi], qmax, scales[i, lo:hi], qv[lo:hi], work)
        if full < count:  # the last block, padded with zeros (fp32: exact for bf16 and fp32)
            tail = torch.zeros(1, size, dtype=torch.float32, device=x.device)
            tail[0, : n - full * size] = rows[i, full * size :]
            _quantize_chunk(tail, qmax, scales[i, full:], values[i, full * size :].view(1, size), work)
    if blocks.bits == 8:
        return values, scales
    # int4: each pair (even, odd) read as one little-endian int16 w = odd' << 8 | even', both
    # offset by 8 to 1..15; the byte even' | odd' << 4 is the low byte of w | (w >> 4). Whole
    # int16 ops, not strided byte ops (which do not vectorize)
    if not _LITTLE_ENDIAN:
        u = values.add_(8).view(torch.uint8).view(r, blocks.padded // 2, 2)
        return torch.bitwise_left_shift(u[:, :, 1], 4).bitwise_or_(u[:, :, 0]).view(torch.int8), scales
    w = values.add_(8).view(torch.int16)
    packed = torch.bitwise_right_shift(w, 4).bitwise_or_(w).bitwise_and_(0xFF)
    return packed.to(torch.uint8).view(torch.int8), scales


def dequantize_torch(payload: torch.Tensor, scales: torch.Tensor, blocks: Blocks,
                     dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """`dequantize` in torch ops: the reference."""
    r, count, size, n = scales.shape[0], blocks.count, blocks.size, blocks.n
    out = torch.empty(r, n, dtype=dtype, device=payload.device) if out is None else out.view(r, n)
    if blocks.bits == 8:
        q = payload.reshape(r, blocks.padded)
    else:
        # each byte b to the int16 (b >> 4) << 8 | (b & 15): read as two int8, the (even, odd) pair
        u = payload.reshape(r, blocks.padded // 2).view(torch.uint8)
        if _LITTLE_ENDIAN:
            w = u.to(torch.int16)
            q = torch.bitwise_left_shift(w, 4).bitwise_or_(w).bitwise_and_(0x0F0F).view(torch.int8)
        else:
            q = torch.stack([u & 15, u >> 4], dim=2).view(torch.int8)
        q = q.view(r, blocks.padded).sub_(8)
    per, full, spans = _chunks(blocks)
    work = _Work.get(per, size, payload.device) if out.dtype != torch.float32 else None
    for i in range(r):
        o, qi = out[i, : full * size].view(full, size), q[i, : full * size].view(full, size)
        for lo, hi in spans:
            _dequantize_chunk(qi[lo:hi], scales[i, lo:hi], o[lo:hi], work)
        if full < count:
            out[i, full * size :] = q[i, full * size : n].float().mul_(scales[i, full:])
    return out
