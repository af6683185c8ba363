"""ZeRO++ collectives, behind the same calls as `Comm` and returning the same `Handle`,
whose `wait()` finishes the work (dequantize, reduce, the second hop):

* `QuantizedAllGather` (qwZ): `all_gather(output, input)` sends the shard as int8 with one
  fp32 scale per block and dequantizes into `output` (its dtype: bf16 or fp32) on wait.
* `QuantizedHierarchicalReduceScatter` (qgZ): `reduce_scatter(output, input)` as a
  quantized all-to-all in two hops, inside the node then across nodes, summing each
  hop's dequantized contributions in fp32. The input is reordered before hop 1 so that
  rank r = node m x k + local l ends with chunk r of the sum, as a reduce-scatter gives.

Rank r = m*k + l on M nodes of k ranks; chunk c of a full gradient of M*k chunks of s:

  hop 1 (intra-node, k ranks): view the gradient as (M, k, s); part l' = [:, l', :]
         (M*s values) goes to local rank l'. Local rank l sums the k parts it receives:
         chunks (m', l) for every node m', summed over this node's ranks.
  hop 2 (inter-node, the M ranks with local rank l): row m' of that (M, s) goes to node
         m'. Node m's rank l sums the M rows it receives: chunk m*k + l over all ranks.

Per rank, hop 1 sends (k-1)/k of the quantized gradient inside the node and hop 2 only
(M-1)/M of 1/k of it across nodes; each hop is one all-to-all call in the ledger, on its
group (so in its scope).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import _AG, Comm, Handle
from zeroshard.comm.quantize import QUANT_BLOCK_SIZE, dequantize, plan_blocks, quantize
from zeroshard.comm.topology import Hierarchy
from zeroshard.policies import CommError

QGZ_BITS = 4  # qgZ's gradients travel as int4 (ZeRO++'s default); 8 is built too


class QuantizedAllGather:
    """qwZ: an all-gather whose payload is int8 plus fp32 block scales."""

    bits = 8

    def __init__(self, comm: Comm, block: int = QUANT_BLOCK_SIZE) -> None:
        self.comm, self.block = comm, block

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        comm, n = self.comm, self.comm.world_size
        comm._check_sizes("all_gather", output, input)
        if n == 1:  # nothing leaves the rank: nothing to quantize
            return comm.all_gather(output, input, what)
        if not (output.dtype.is_floating_point and input.dtype == output.dtype):
            raise CommError(f"qwZ all-gather of {input.dtype} into {output.dtype}: only floating-point tensors "
                            "of one dtype are quantized; this is a zeroshard bug, please report it.")
        blocks = plan_blocks(input.numel(), self.bits, self.block)
        q, scales = quantize(input.reshape(1, -1), blocks)
        q_all = torch.empty(n, blocks.payload_bytes, dtype=torch.int8, device=input.device)
        s_all = torch.empty(n, blocks.count, dtype=torch.float32, device=input.device)

        def finish() -> None:
            output.view(n, -1).copy_(dequantize(q_all, s_all, blocks, output.dtype))

        def call():
            group = comm.group
            return [_AG(q_all.view(-1), q.view(-1), group=group, async_op=True),
                    _AG(s_all.view(-1), scales.view(-1), group=group, async_op=True)]

        return comm._issue("all_gather", output, output.numel(), what + " [qwZ int8]", call,
                           wire_bytes=n * blocks.wire_bytes, finish=finish, dtype_name="int8")


class QuantizedHierarchicalReduceScatter:
    """qgZ: a reduce-scatter done as two quantized all-to-alls (intra-node, then inter-node)."""

    def __init__(self, comm: Comm, hierarchy: Hierarchy, bits: int = QGZ_BITS,
                 block: int = QUANT_BLOCK_SIZE) -> None:
        self.comm, self.bits, self.block = comm, bits, block
        self.intra, self.inter = comm.on(hierarchy.intra), comm.on(hierarchy.inter)
        if self.intra.world_size * self.inter.world_size != comm.world_size:
            raise CommError(f"qgZ: {self.inter.world_size} nodes x {self.intra.world_size} ranks is not the world "
                            f"size {comm.world_size}; this is a zeroshard bug, please report it.")
        plan_blocks(2, bits)  # an unbuilt width fails here, not at the first gradient

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """As `Comm.reduce_scatter`: `output` (this rank's chunk) may be a view into `input`."""
        self.comm._check_sizes("reduce_scatter", input, output)
        if self.comm.world_size == 1:
            return self.comm.reduce_scatter(output, input, what)
        nodes, local, s = self.inter.world_size, self.intra.world_size, output.numel()
        parts = input.reshape(nodes, local, s).transpose(0, 1).reshape(local, nodes * s)

        def second_hop(node_sum: torch.Tensor) -> None:
            def land(total: torch.Tensor) -> None:
                output.copy_(total.view_as(output))
            self._hop(self.inter, node_sum.view(nodes, s), what + " [qgZ hop 2, inter-node]", land).wait()

        return self._hop(self.intra, parts, what + " [qgZ hop 1, intra-node]", second_hop)

    def _hop(self, comm: Comm, parts: torch.Tensor, what: str, land) -> Handle:
        """All-to-all of `parts` (g rows: row j to group rank j) quantized; on wait, the fp32
        sum of the g rows received is handed to `land`."""
        g, width = parts.shape
        if g == 1:  # a group of one sends nothing: no quantization either
            return comm._issue("all_to_all", parts, parts.numel(), what, lambda: None,
                               finish=lambda: land(parts[0].float()))
        blocks = plan_blocks(width, self.bits, self.block)
        q, scales = quantize(parts, blocks)
        q_in = q.contiguous()
        q_out, s_out = torch.empty_like(q_in), torch.empty_like(scales)

        def finish() -> None:
            land(dequantize(q_out, s_out, blocks).sum(dim=0))

        def call():
            group = comm.group
            return [dist.all_to_all_single(q_out, q_in, group=group, async_op=True),
                    dist.all_to_all_single(s_out, scales, group=group, async_op=True)]

        return comm._issue("all_to_all", parts, parts.numel(), what, call,
                           wire_bytes=g * blocks.wire_bytes, finish=finish, dtype_name=f"int{self.bits}")
