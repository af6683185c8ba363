"""comm.quantize_native, the fused C kernel comm.quantization runs on CPU tensors (issue 24):
the same payload, scales and dequantized values as the torch formulation (quantize_torch /
dequantize_torch) on every case below, and a quiet fallback to the torch ops where no C
compiler builds it (what a CI machine without gcc runs)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zeroshard.comm.quantization as quantization
from zeroshard.comm import plan_blocks
from zeroshard.comm import quantize_native as native

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=f"no fused kernel here: {native.status()}")


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """An empty cache directory and no loaded kernel; the real one is loaded again after."""
    monkeypatch.setenv("ZEROSHARD_CACHE_DIR", str(tmp_path / "cache"))
    native.reset()
    yield tmp_path / "cache"
    monkeypatch.undo()
    native.reset()


def _same(x: torch.Tensor, blocks, out_given: bool = False) -> None:
    """Kernel and torch ops agree on payload, scales and the dequantized values."""
    dtype = x.dtype
    q1, s1 = quantization.quantize(x, blocks)
    q2, s2 = quantization.quantize_torch(x, blocks)
    assert torch.equal(q1, q2), (q1 != q2).nonzero()[:5].tolist()
    assert torch.equal(s1.nan_to_num(-1.0), s2.nan_to_num(-1.0))
    rows = s1.shape[0]
    if out_given:
        y1 = torch.full((rows, blocks.n), 7.0, dtype=dtype)
        assert quantization.dequantize(q1, s1, blocks, dtype, out=y1) is not None
    else:
        y1 = quantization.dequantize(q1, s1, blocks, dtype)
    y2 = quantization.dequantize_torch(q2, s2, blocks, dtype)
    assert y1.dtype == y2.dtype == dtype
    assert torch.equal(y1.float().nan_to_num(-1.0), y2.float().nan_to_num(-1.0))
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32  # either output from either input
    assert torch.equal(quantization.dequantize(q1, s1, blocks, other).float().nan_to_num(-1.0),
                       quantization.dequantize_torch(q2, s2, blocks, other).float().nan_to_num(-1.0))


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5000), rows=st.integers(1, 3), bits=st.sampled_from([8, 4]), bf16=st.booleans(),
       max_block=st.sampled_from([2, 64, 2048, 4096]), log_scale=st.floats(-40, 40), zero_from=st.integers(0, 5000),
       seed=st.integers(0, 2**16), out_given=st.booleans())
def test_kernel_equals_the_torch_ops(n, rows, bits, bf16, max_block, log_scale, zero_from, seed, out_given):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * math.exp(log_scale)  # denormal to huge blocks
    x[:, zero_from: zero_from + 700] = 0  # all-zero blocks (scale 0)
    _same(x.bfloat16() if bf16 else x, plan_blocks(n, bits, max_block), out_given)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_equals_the_torch_ops_on_non_finite_and_ties(dtype, bits):
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(0))
    x[0, 5], x[0, 1000], x[1, 200] = float("inf"), float("nan"), -float("inf")  # non-finite scales
    x[1, 2048:2048 + 64] = torch.arange(64) - 31.5  # halves: round half to even decides
    # scale 1 + 2^-8 (absmax 127.49609375 or 7.02734375): q x scale halfway between two bf16
    # values, so a dequantize to bf16 must round those ties to even
    step = 1 + 2 ** -8
    x[0, 2176:2176 + 128] = torch.linspace(-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1, 128).round() * step
    x[1, 2500:2600] = torch.randn(100) * 1e-42  # denormals
    x[1, 2600:] = -0.0
    for max_block in (64, 2048):
        _same(x.to(dtype), plan_blocks(3000, bits, max_block))


@needs_kernel
def test_quantize_runs_the_kernel_on_cpu_tensors(monkeypatch):
    """Where the kernel is built, fp32 and bf16 CPU tensors never reach the torch ops (without
    it the equality tests above would compare the torch ops with themselves)."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch ops ran where the kernel applies")

    monkeypatch.setattr(quantization, "quantize_torch", refuse)
    monkeypatch.setattr(quantization, "dequantize_torch", refuse)
    for dtype in (torch.float32, torch.bfloat16):
        blocks = plan_blocks(5000, 4)
        q, s = quantization.quantize(torch.ones(2, 5000, dtype=dtype), blocks)
        assert bool((quantization.dequantize(q, s, blocks, dtype) == 1).all())
    assert native.status().startswith("fused C kernel")
    # fp16 (and a non-contiguous input) stay on the torch ops
    with pytest.raises(AssertionError, match="torch ops ran"):
        quantization.quantize(torch.ones(1, 64, dtype=torch.float16), plan_blocks(64, 8))
    with pytest.raises(AssertionError, match="torch ops ran"):
        quantization.quantize(torch.ones(64, 2).t(), plan_blocks(64, 8))


@pytest.mark.parametrize("how", ["switch", "no compiler", "compiler fails"])
def test_without_a_compiler_the_torch_ops_run_and_nothing_is_printed(fresh_kernel, monkeypatch, capfd, how):
    if how == "switch":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    else:
        monkeypatch.setenv("CC", "/nonexistent/cc" if how == "no compiler" else "false")
    blocks = plan_blocks(3000, 4, 64)
    x = torch.randn(2, 3000).bfloat16()
    q, s = quantization.quantize(x, blocks)
    y = quantization.dequantize(q, s, blocks, torch.bfloat16)
    assert native.kernel() is None
    expected = {"switch": "disabled by", "no compiler": "no C compiler", "compiler fails": "C build failed"}[how]
    assert native.status().startswith("torch ops: " + expected), native.status()
    q2, s2 = quantization.quantize_torch(x, blocks)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert torch.equal(y, quantization.dequantize_torch(q2, s2, blocks, torch.bfloat16))
    assert capfd.readouterr() == ("", "")
    assert not list(fresh_kernel.glob("*.so"))


@needs_kernel
def test_built_once_into_the_cache_and_loaded_by_the_next_process(fresh_kernel, capfd):
    assert native.kernel() is not None
    built = list(fresh_kernel.glob("zeroshard_quantize_*.so"))
    assert len(built) == 1 and not [p for p in fresh_kernel.iterdir() if p.is_dir()]  # no temporary left
    mtime = built[0].stat().st_mtime_ns
    code = "import zeroshard.comm.quantize_native as n; print(n.status())"
    env = {**os.environ, "ZEROSHARD_CACHE_DIR": str(fresh_kernel), "CC": "/nonexistent/cc-not-needed"}
    # a second process loads the cached build; it still asks the compiler for its version
    # (part of the key), so with no compiler it falls back instead of loading a stale build
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("torch ops: no C compiler"), done.stderr
    env.pop("CC")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"fused C kernel {built[0]}", done.stderr
    assert built[0].stat().st_mtime_ns == mtime
    assert capfd.readouterr() == ("", "")


@needs_kernel
@pytest.mark.parametrize("dtype,bits", [(torch.float32, 8), (torch.float32, 4), (torch.bfloat16, 8), (torch.bfloat16, 4)])
def test_cpu_tensors_take_the_kernel_not_the_torch_ops(monkeypatch, dtype, bits):
    """Where the kernel is built, CPU fp32/bf16 tensors never reach the torch formulation (the
    timing test below is slow-marked: its bound depends on the machine)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch ops ran where the fused kernel applies")

    x = torch.randn(3, 5000).to(dtype)
    blocks = plan_blocks(5000, bits)
    expected = quantization.quantize(x, blocks)
    monkeypatch.setattr(quantization, "quantize_torch", refuse)
    monkeypatch.setattr(quantization, "dequantize_torch", refuse)
    q, s = quantization.quantize(x, blocks)
    assert torch.equal(q, expected[0]) and torch.equal(s, expected[1])
    quantization.dequantize(q, s, blocks, dtype, out=torch.empty_like(x))


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("dtype,bits", [(torch.float32, 4), (torch.bfloat16, 8), (torch.bfloat16, 4)])
def test_quantize_plus_dequantize_keeps_up_with_a_copy(dtype, bits):
    """Issue 24's bar is q+dq >= 0.5 of a copy (bench/bench_quantize.py measures it); this bounds
    it loosely at 0.25 in the fastest of 11 interleaved rounds of CPU time; the torch ops measure
    0.05-0.15 here. Slow-marked: on a slower machine bf16 int8 measured 0.246 (4 MiB, idle), so
    the bound is a property of the machine as much as of the code; the default run checks the
    dispatch above instead."""
    numel = (4 << 20) // torch.empty(0, dtype=dtype).element_size()
    x = torch.randn(1, numel).to(dtype)
    blocks, dst, out = plan_blocks(numel, bits), torch.empty_like(x), torch.empty_like(x)
    q, s = quantization.quantize(x, blocks)
    best = {"copy": math.inf, "q": math.inf, "dq": math.inf}
    for _ in range(11):
        for name, fn in (("copy", lambda: dst.copy_(x)), ("q", lambda: quantization.quantize(x, blocks)),
                         ("dq", lambda: quantization.dequantize(q, s, blocks, dtype, out=out))):
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)
    assert best["copy"] / (best["q"] + best["dq"]) >= 0.25, best
