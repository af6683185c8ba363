"""ZeRO++ collectives: they implement comm.interfaces' `AllGather`, `AllToAll` and
`ReduceScatter` and return `Comm`'s `Handle`, whose `wait()` finishes the work (dequantize,
reduce, the second hop):

* `QuantizedAllGather` (qwZ): `all_gather(output, input)` sends the shard as int8 with one
  fp32 scale per block and dequantizes into `output` (its dtype: bf16 or fp32) on wait.
* `QuantizedAllToAll`: `all_to_all(output, input)` of g rows (row j to group rank j) sent
  as int4 / int8 with block scales, dequantized into `output` on wait.
* `QuantizedHierarchicalReduceScatter` (qgZ): `reduce_scatter(output, input)` as two
  `QuantizedAllToAll` hops, inside the node then across nodes, summing each hop's
  dequantized contributions in fp32. The input is reordered before hop 1 so that
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

from zeroshard.comm.blocks import QGZ_BITS, QUANT_BLOCK_SIZE, QWZ_BITS, plan_blocks
from zeroshard.comm.collectives import Comm, Handle
from zeroshard.comm.interfaces import AllGather, AllToAll, ReduceScatter
from zeroshard.comm.quantization import dequantize, quantize
from zeroshard.comm.topology import Hierarchy
from zeroshard.policies import CommError


def _scales(rows: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.empty(rows, count, dtype=torch.float32, device=device)


class _OnComm:
    """A collective over `self.comm`'s group: its rank and size are the group's. Its payload
    buffers are the comm's scratch buffers, given back once dequantized: a 32 MiB payload
    allocated afresh each call faults every page in again."""

    comm: Comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


class QuantizedAllGather(_OnComm, AllGather):
    """qwZ: an all-gather whose payload is int8 plus fp32 block scales."""

    bits = QWZ_BITS

    def __init__(self, comm: Comm, block: int = QUANT_BLOCK_SIZE) -> None:
        self.comm, self.block = comm, block

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        comm, n = self.comm, self.comm.world_size
        comm.check_sizes("all_gather", output, input)
        if n == 1:  # nothing leaves the rank: nothing to quantize
            return comm.all_gather(output, input, what)
        if not (output.dtype.is_floating_point and input.dtype == output.dtype):
            raise CommError(f"qwZ all-gather of {input.dtype} into {output.dtype}: only floating-point tensors "
                            "of one dtype are quantized; this is a zeroshard bug, please report it.")
        blocks = plan_blocks(input.numel(), self.bits, self.block)
        dev, bytes_, count = input.device, blocks.payload_bytes, blocks.count
        q_flat, q_all_flat = self.comm.scratch(bytes_, torch.int8, dev), self.comm.scratch(n * bytes_, torch.int8, dev)
        q, scales = quantize(input.reshape(1, -1), blocks, out=(q_flat, _scales(1, count, dev)))
        q_all, s_all = q_all_flat.view(n, bytes_), _scales(n, count, dev)

        def finish() -> None:
            dequantize(q_all, s_all, blocks, output.dtype, out=output.view(n, -1))
            self.comm.give_back(q_flat, q_all_flat)

        def call():
            return [comm.launch_all_gather(q_all.view(-1), q.view(-1)),
                    comm.launch_all_gather(s_all.view(-1), scales.view(-1))]

        return comm.issue("all_gather", output, output.numel(), what + " [qwZ int8]", call,
                          wire_bytes=n * blocks.wire_bytes, finish=finish, dtype_name="int8")


class QuantizedAllToAll(_OnComm, AllToAll):
    """An all-to-all of g rows (row j goes to group rank j) quantized to `bits` with fp32
    block scales per row; `output` (g rows, floating point) holds the dequantized rows
    received, row i from group rank i."""

    def __init__(self, comm: Comm, bits: int = QGZ_BITS, block: int = QUANT_BLOCK_SIZE) -> None:
        plan_blocks(2, bits)  # an unbuilt width fails here, not at the first gradient
        self.comm, self.bits, self.block = comm, bits, block

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        comm, g = self.comm, self.comm.world_size
        rows = input.reshape(g, -1)
        width = rows.shape[1]
        if output.numel() != input.numel() or not output.dtype.is_floating_point:
            raise CommError(f"quantized all-to-all of {input.numel()} elements into {output.numel()} "
                            f"{output.dtype}; this is a zeroshard bug, please report it.")
        out = output.view(g, width)
        if g == 1:  # a group of one sends nothing: no quantization either
            return comm.issue("all_to_all", input, input.numel(), what, lambda: None,
                              finish=lambda: out.copy_(rows))
        blocks = plan_blocks(width, self.bits, self.block)
        dev, size = input.device, g * blocks.payload_bytes
        q_in_flat, q_out_flat = self.comm.scratch(size, torch.int8, dev), self.comm.scratch(size, torch.int8, dev)
        q_in, scales = quantize(rows, blocks, out=(q_in_flat, _scales(g, blocks.count, dev)))
        q_out, s_out = q_out_flat.view(g, -1), torch.empty_like(scales)

        def finish() -> None:
            dequantize(q_out, s_out, blocks, out.dtype, out=out)
            self.comm.give_back(q_in_flat, q_out_flat)

        def call():
            return [comm.launch_all_to_all(q_out, q_in), comm.launch_all_to_all(s_out, scales)]

        return comm.issue("all_to_all", input, input.numel(), what, call,
                          wire_bytes=g * blocks.wire_bytes, finish=finish, dtype_name=f"int{self.bits}")


class QuantizedHierarchicalReduceScatter(_OnComm, ReduceScatter):
    """qgZ: a reduce-scatter done as two quantized all-to-alls (intra-node, then inter-node)."""

    def __init__(self, comm: Comm, hierarchy: Hierarchy, bits: int = QGZ_BITS,
                 block: int = QUANT_BLOCK_SIZE) -> None:
        self.comm, self.bits, self.block = comm, bits, block
        intra, inter = comm.on(hierarchy.intra), comm.on(hierarchy.inter)
        if intra.world_size * inter.world_size != comm.world_size:
            raise CommError(f"qgZ: {inter.world_size} nodes x {intra.world_size} ranks is not the world "
                            f"size {comm.world_size}; this is a zeroshard bug, please report it.")
        self.intra, self.inter = QuantizedAllToAll(intra, bits, block), QuantizedAllToAll(inter, bits, block)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """As `Comm.reduce_scatter`: `output` (this rank's chunk) may be a view into `input`."""
        self.comm.check_sizes("reduce_scatter", input, output)
        if self.comm.world_size == 1:
            return self.comm.reduce_scatter(output, input, what)
        nodes, local, s = self.inter.world_size, self.intra.world_size, output.numel()
        parts = input.reshape(nodes, local, s).transpose(0, 1).reshape(local, nodes * s)
        hop1 = torch.empty(local, nodes * s, dtype=torch.float32, device=input.device)

        def second_hop() -> None:
            node_sum = hop1.sum(dim=0)  # this node's sum of chunks (m', l) for every node m'
            hop2 = torch.empty(nodes, s, dtype=torch.float32, device=input.device)
            self.inter.all_to_all(hop2, node_sum.view(nodes, s), what + " [qgZ hop 2, inter-node]").wait()
            output.copy_(hop2.sum(dim=0).view_as(output))

        return self.intra.all_to_all(hop1, parts, what + " [qgZ hop 1, intra-node]").then(second_hop)
