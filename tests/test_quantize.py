"""Block quantization for ZeRO++ (comm.quantization): error bounds, any size, bf16 without an
fp16 cast, non-finite values kept visible, the wire size. No process group needed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zeroshard.comm import QUANT_BLOCK_SIZE, dequantize, plan_blocks, quantize

QMAX = {8: 127, 4: 7}


# The kernels scale a value by 1/scale (scale = absmax/qmax): three fp32 roundings, so x/step is
# off by up to ~3 ulp of qmax, and the dequantize and the difference round once more each. A value
# within that of a half step may round to its far neighbour: the error then exceeds half a step by
# up to ~5 qmax ulp of a step, relative 10 qmax ulp of the half step (7.6e-5 for int8).
def _rounding_slack(bits: int) -> float:
    return 10 * QMAX[bits] * 2.0 ** -24


def _block_bound(x: torch.Tensor, blocks) -> torch.Tensor:
    """Per element: half a quantization step of its block, absmax / (2 qmax)."""
    padded = torch.zeros(x.shape[0], blocks.padded)
    padded[:, : blocks.n] = x.float()
    amax = padded.view(x.shape[0], blocks.count, blocks.size).abs().amax(dim=2, keepdim=True)
    step = (amax / QMAX[blocks.bits]).expand(-1, -1, blocks.size).reshape(x.shape[0], -1)[:, : blocks.n]
    return step / 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), rows=st.integers(1, 3), bits=st.sampled_from([8, 4]),
       log_scale=st.floats(-20, 30), seed=st.integers(0, 2**16), max_block=st.sampled_from([64, 2048]))
@example(n=660, rows=3, bits=8, log_scale=-4.9921875, seed=23592, max_block=64)  # x/step = -87.4999926, rounded to -88
def test_error_within_half_a_step_of_its_block(n, rows, bits, log_scale, seed, max_block):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * math.exp(log_scale)
    blocks = plan_blocks(n, bits, max_block)
    assert blocks.padded >= n and blocks.padded - n < blocks.count * (2 if bits == 4 else 1)
    assert blocks.size <= max_block + (bits == 4)
    q, scales = quantize(x, blocks)
    assert q.dtype == torch.int8 and q.shape == (rows, blocks.payload_bytes)
    assert scales.dtype == torch.float32 and scales.shape == (rows, blocks.count)
    y = dequantize(q, scales, blocks)
    err = (y - x).abs()
    bound = _block_bound(x, blocks)
    assert bool((err <= bound * (1 + _rounding_slack(bits)) + 1e-30).all()), ((err - bound) / bound).max().item()


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_large_values_do_not_overflow(bits):
    """bf16 holds values far beyond fp16's 65504; a cast to fp16 would make them inf."""
    x = torch.tensor([[3.0e38, -1.0e30, 7.0e5, 1.0, -2.5e38]], dtype=torch.bfloat16)
    blocks = plan_blocks(x.shape[1], bits)
    q, s = quantize(x, blocks)
    y = dequantize(q, s, blocks, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
    assert abs(y[0, 0].float().item() - 3.0e38) <= 3.0e38 / QMAX[bits] / 2 * 1.01


def test_sizes_that_do_not_divide_the_block_are_padded_not_dropped():
    n = QUANT_BLOCK_SIZE * 3 + 5
    blocks = plan_blocks(n, 8)
    assert blocks.count == 4 and blocks.padded >= n
    x = torch.arange(n, dtype=torch.float32).view(1, -1)
    q, s = quantize(x, blocks)
    y = dequantize(q, s, blocks)
    assert y.shape == (1, n)
    assert (y - x).abs().max().item() <= n / 127 / 2 * 1.0001  # the tail block too


def test_zero_block_and_non_finite_values():
    x = torch.zeros(1, 4096)
    x[0, 3000] = float("inf")
    blocks = plan_blocks(4096, 8, 2048)
    y = dequantize(*quantize(x, blocks), blocks)
    assert bool((y[0, :2048] == 0).all())  # an all-zero block stays exactly zero
    assert not bool(torch.isfinite(y[0, 2048:]).all())  # an overflow stays visible


def test_wire_bytes_are_payload_plus_scales():
    b8, b4 = plan_blocks(5000, 8), plan_blocks(5000, 4)
    assert b8.wire_bytes == b8.padded + 4 * b8.count
    assert b4.wire_bytes == b4.padded // 2 + 4 * b4.count
    with pytest.raises(ValueError, match="only 8"):
        plan_blocks(10, 2)
