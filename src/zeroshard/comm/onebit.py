"""Error-compensated 1-bit all-reduce: the collective of the 1-bit optimizer family (1-bit Adam,
Tang et al. 2021, arXiv:2102.02888; 0/1 Adam; 1-bit Lamb), as DeepSpeed's `compressed_allreduce`
describes it.

The mean over ranks of a flat fp32 tensor that holds several model tensors (`spans`), each
sent as one sign bit per element and one fp32 scale per tensor, in two hops:

  worker  x = value + worker_error;  s = |x| / sqrt(numel(x));  worker_error = x - s * sign(x)
          the signs of chunk j of every tensor go to rank j (all-to-all, packed 8 per byte),
          every rank's scales to every rank (all-gather)
  server  rank j averages its chunk: y = mean_i(s_i * sign_i) + server_error;
          s' = |y| / sqrt(numel(y));  server_error = y - s' * sign(y)
          the signs and scales of every chunk go to every rank (two all-gathers)
  result  chunk j of each tensor = s'_j * sign_j

sign(0) is +1, as DeepSpeed's (1 bit cannot say 0). Each tensor is padded to a multiple of
8 x world size elements (whole bytes per chunk); the padding takes part in the error feedback,
as in DeepSpeed, and is never written back. The scales are per tensor and per chunk, as
DeepSpeed's per-parameter calls have them; here one call serves every tensor of the flat
buffer, so a bucket costs four collectives, not four per parameter. The ledger sees the packed
bytes (uint8) and the scales (fp32): about 1/32 of an fp32 all-reduce's bytes.
"""

from __future__ import annotations

import math

import torch

from zeroshard.comm.collectives import Comm

__all__ = ["OneBitAllReduce", "pack_signs", "unpack_signs"]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """(rows, 8k) bools -> (rows, k) uint8, the first element in the highest bit."""
    rows = positive.shape[0]
    bits = positive.view(rows, -1, 8).to(torch.uint8) * _BITS.to(positive.device)
    return bits.sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """(rows, k) uint8 -> (rows, 8k) of +1.0 / -1.0."""
    rows = packed.shape[0]
    positive = (packed.unsqueeze(-1) & _BITS.to(packed.device)) != 0
    return positive.view(rows, -1).float().mul_(2.0).sub_(1.0)


class OneBitAllReduce:
    """Compressed mean of one flat tensor of `numel` elements whose model tensors lie at `spans`
    ((start, length) each); keeps that tensor's worker and server errors between calls."""

    def __init__(self, comm: Comm, numel: int, spans: list[tuple[int, int]], device: torch.device,
                 what: str = "", one_scale: bool = False) -> None:
        """`one_scale`: one scale per rank (and per server chunk) over all the tensors together, as
        1-bit Lamb exchanges its whole momentum as one flat tensor (rescaled per tensor first)."""
        n = comm.world_size
        self.comm, self.n, self.what = comm, n, what
        spans = [(s, ln) for s, ln in spans if ln > 0]
        chunks = [math.ceil(ln / (8 * n)) * 8 for _, ln in spans]  # per tensor, per rank
        self.columns = sum(chunks)
        src = torch.full((n, self.columns), numel, dtype=torch.long)  # index `numel`: a zero (padding)
        seg = torch.empty(self.columns, dtype=torch.long)
        col = 0
        for t, ((start, length), c) in enumerate(zip(spans, chunks)):
            seg[col:col + c] = t
            for j in range(n):
                lo, hi = j * c, min((j + 1) * c, length)
                if hi > lo:
                    src[j, col:col + hi - lo] = torch.arange(start + lo, start + hi)
            col += c
        self.src, self.seg = src.to(device), seg.to(device)
        self.valid = self.src < numel
        per_rank = torch.tensor(chunks, dtype=torch.float32, device=device)
        self.worker_numel, self.server_numel = per_rank * n, per_rank
        self.tensors = len(spans)
        if one_scale:
            self.seg.zero_()
            self.worker_numel, self.server_numel = self.worker_numel.sum(0, keepdim=True), per_rank.sum(0, keepdim=True)
            self.tensors = 1
        self.worker_error = torch.zeros(n, self.columns, device=device)
        self.server_error = torch.zeros(self.columns, device=device)

    @property
    def error_bytes(self) -> int:
        return self.worker_error.nbytes + self.server_error.nbytes

    def reset_errors(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def _scales(self, x: torch.Tensor, numel: torch.Tensor) -> torch.Tensor:
        """Per tensor: its L2 norm over `x`'s columns (all rows) / sqrt(its element count)."""
        squares = (x * x).sum(0) if x.dim() == 2 else x * x
        sums = torch.zeros(self.tensors, device=x.device).index_add_(0, self.seg, squares)
        return sums.div_(numel).sqrt_()

    def __call__(self, value: torch.Tensor) -> None:
        """Replace `value` (flat, fp32) by the compressed mean over ranks, in place."""
        n, cols, flat = self.n, self.columns, value.view(-1)
        x = torch.cat([flat, flat.new_zeros(1)])[self.src].add_(self.worker_error)  # (n, cols), rank-major
        scale = self._scales(x, self.worker_numel)
        positive = x >= 0
        torch.sub(x, scale[self.seg] * positive.float().mul_(2.0).sub_(1.0), out=self.worker_error)
        packed = pack_signs(positive).reshape(-1)
        received = torch.empty_like(packed)
        scales = torch.empty(n * self.tensors, device=flat.device)
        self.comm.all_to_all(received, packed, what=f"1-bit signs of {self.what}").wait()
        self.comm.all_gather(scales, scale, what=f"1-bit worker scales of {self.what}").wait()
        # server: this rank's chunk of every tensor, averaged over the ranks' signed scales
        y = (unpack_signs(received.view(n, -1)) * scales.view(n, -1)[:, self.seg]).sum(0).div_(n)
        y.add_(self.server_error)
        server_scale = self._scales(y, self.server_numel)
        positive = y >= 0
        torch.sub(y, server_scale[self.seg] * positive.float().mul_(2.0).sub_(1.0), out=self.server_error)
        mine = pack_signs(positive.view(1, cols)).view(-1)
        signs = torch.empty(n * mine.numel(), dtype=torch.uint8, device=flat.device)
        server_scales = torch.empty(n * self.tensors, device=flat.device)
        self.comm.all_gather(signs, mine, what=f"1-bit server signs of {self.what}").wait()
        self.comm.all_gather(server_scales, server_scale, what=f"1-bit server scales of {self.what}").wait()
        result = unpack_signs(signs.view(n, -1)).mul_(server_scales.view(n, -1)[:, self.seg])
        flat[self.src[self.valid]] = result[self.valid]
