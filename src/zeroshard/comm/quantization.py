"""Block-wise symmetric quantization for ZeRO++ (qwZ int8, qgZ int4 / int8): vectorized
torch ops, no Python loop over blocks. The blocking (comm.blocks.plan_blocks): rows cut in
equal blocks, the last padded with zeros. Each block keeps one fp32 scale, `absmax / qmax`
(qmax 127 for int8, 7 for int4), and values are rounded to the nearest step: the error of an
element is at most scale / 2 = absmax / (2 qmax) of its block.

The arithmetic runs in fp32 whatever the input dtype: bf16 and fp32 go to fp32
exactly, and nothing is cast to fp16 (DeepSpeed's kernels cast bf16 to fp16, which
overflows above 65504). An all-zero block gets scale 0 and dequantizes to zeros; a
non-finite value makes its block's scale non-finite, so an overflow stays visible
after dequantization instead of being clipped away.
"""

from __future__ import annotations

import torch

from zeroshard.comm.blocks import QMAX as _QMAX
from zeroshard.comm.blocks import Blocks


def quantize(x: torch.Tensor, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`: (rows, n) or (n,). Returns (payload, scales): payload int8 of shape
    (rows, payload_bytes) (int4: two values per byte, low nibble first, stored as int8 bits),
    scales fp32 (rows, count)."""
    rows = x.reshape(-1, blocks.n)
    r = rows.shape[0]
    if blocks.padded == blocks.n:
        v = rows.view(r, blocks.count, blocks.size)  # read as it is; the fp32 math below copies once
    else:
        v = torch.zeros(r, blocks.padded, dtype=torch.float32, device=x.device)
        v[:, : blocks.n] = rows  # fp32: exact for bf16 and fp32 inputs
        v = v.view(r, blocks.count, blocks.size)
    qmax = _QMAX[blocks.bits]
    scales = v.abs().amax(dim=2).float() / qmax  # the absmax of bf16 values is a bf16 value: exact
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.mul(v, inv.unsqueeze(2))  # fp32 (inv is fp32): the one full-size float temporary
    q.round_().clamp_(-qmax, qmax)
    if blocks.bits == 8:
        return q.to(torch.int8).view(r, blocks.padded), scales
    u = q.add_(8).to(torch.uint8).view(r, blocks.padded // 2, 2)  # 1..15: fits a nibble
    packed = u[:, :, 0] | (u[:, :, 1] << 4)
    return packed.view(torch.int8), scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, blocks: Blocks,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: (rows, n) in `dtype` (computed in fp32)."""
    r = scales.shape[0]
    if blocks.bits == 8:
        q = payload.reshape(r, blocks.padded).to(torch.float32)
    else:
        u = payload.reshape(r, blocks.padded // 2).view(torch.uint8)
        q = torch.empty(r, blocks.padded // 2, 2, dtype=torch.float32, device=payload.device)
        q[:, :, 0].copy_(u & 15)
        q[:, :, 1].copy_(u >> 4)
        q = q.view(r, blocks.padded).sub_(8)
    v = q.view(r, blocks.count, blocks.size).mul_(scales.unsqueeze(2))
    return v.view(r, blocks.padded)[:, : blocks.n].to(dtype)
