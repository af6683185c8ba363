"""ZeRO++'s block quantization as sizes only (no torch, so the estimator imports it): the
constants and the blocking rule that comm.quantization runs and the estimator counts bytes with.

A row of `n` values is cut into `nb = ceil(n / max_block)` blocks of equal size
`block = ceil(n / nb)` (rounded up to even for int4: two values share a byte); the last block is
padded with zeros, so any size works and fewer than `nb` (int4: `2 nb`) padding values
travel. Each block keeps one fp32 scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QUANT_BLOCK_SIZE = 2048  # elements sharing one scale (ZeRO++'s default group size)
SCALE_BYTES = 4  # one fp32 scale per block
QWZ_BITS = 8  # qwZ's weights travel as int8
QGZ_BITS = 4  # qgZ's gradients travel as int4 (ZeRO++'s default); 8 is built too
QMAX = {8: 127, 4: 7}  # the largest quantized magnitude of each built width


@dataclass(frozen=True)
class Blocks:
    """How a row of `n` values is blocked for `bits`-bit quantization."""

    n: int
    bits: int
    count: int  # blocks
    size: int  # values per block

    @property
    def padded(self) -> int:
        return self.count * self.size

    @property
    def payload_bytes(self) -> int:
        """Bytes of quantized values of one row (padding included: it is sent)."""
        return self.padded * self.bits // 8

    @property
    def wire_bytes(self) -> int:
        """Payload plus scales of one row."""
        return self.payload_bytes + self.count * SCALE_BYTES


def plan_blocks(n: int, bits: int, max_block: int = QUANT_BLOCK_SIZE) -> Blocks:
    if bits not in QMAX:
        raise ValueError(f"quantization to {bits} bits: only 8 (int8) and 4 (int4) are built")
    if n < 1 or max_block < 2:
        raise ValueError(f"cannot block {n} values in blocks of at most {max_block}")
    count = math.ceil(n / max_block)
    size = math.ceil(n / count)
    if bits == 4 and size % 2:
        size += 1
    return Blocks(n, bits, count, size)
