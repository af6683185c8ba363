"""comm.quantization's torch ops (quantize_torch, the reference of the fused kernel) walk the blocks in cache-sized chunks (issue 24): the payload and scales
do not depend on the chunk size, every block is quantized (the error bound holds for each),
and dequantizing into a caller's `out=` gives what a fresh tensor gets."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zeroshard.comm.quantization as quantization
from zeroshard.comm import plan_blocks
from zeroshard.comm.quantization import dequantize_torch as dequantize
from zeroshard.comm.quantization import quantize_torch as quantize

QMAX = {8: 127, 4: 7}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), rows=st.integers(1, 3), bits=st.sampled_from([8, 4]),
       bf16=st.booleans(), chunk=st.sampled_from([1, 64, 200]), seed=st.integers(0, 2**16))
def test_chunk_size_changes_nothing_and_every_block_is_quantized(n, rows, bits, bf16, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * math.exp(seed % 20 - 10)
    if bf16:
        x = x.bfloat16()
    blocks = plan_blocks(n, bits, 64)
    whole = quantize(x, blocks)  # default chunk: all blocks of a row in one pass
    old = quantization.CHUNK_ELEMENTS
    quantization.CHUNK_ELEMENTS = chunk  # 1: one block per chunk; 200: three blocks of 64
    try:
        q, s = quantize(x, blocks)
        y = dequantize(q, s, blocks, x.dtype)
    finally:
        quantization.CHUNK_ELEMENTS = old
    assert torch.equal(q, whole[0]) and torch.equal(s, whole[1])
    out = torch.full((rows, n), float("nan"), dtype=x.dtype)
    assert dequantize(q, s, blocks, x.dtype, out=out) is not None and torch.equal(out, y)
    # each element within half a step of its own block (a block left unquantized would not be)
    padded = torch.zeros(rows, blocks.padded)
    padded[:, :n] = x.float()
    amax = padded.view(rows, blocks.count, blocks.size).abs().amax(dim=2, keepdim=True)
    half_step = (amax / QMAX[bits] / 2).expand(-1, -1, blocks.size).reshape(rows, -1)[:, :n]
    err = (y.float() - x.float()).abs()
    slack = 1e-5 if not bf16 else 2 ** -8  # bf16's own rounding of the dequantized value
    assert bool((err <= half_step * (1 + 1e-5) + x.float().abs() * slack + 1e-30).all())
