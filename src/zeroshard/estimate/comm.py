"""Communication per optimizer step per rank, by collective, in elements and bytes.

Two ways of counting, both reported:

* paper units (`paper_elements`): the ZeRO paper's volume (Rajbhandari et al. 2019,
  sec. 7): an all-gather or reduce-scatter of a Φ-element tensor moves Φ, an
  all-reduce 2Φ. So stages 0, 1 and 2 move 2Φ per step and stage 3 moves 3Φ;
  stage 1 and 2 cost no more than plain data parallelism.
* bytes sent by this rank (`sent_bytes`): a ring over n ranks sends (n-1)/n of the
  payload per all-gather or reduce-scatter (Thakur et al. 2005; what nccl-tests
  calls algorithm bandwidth * (n-1)/n).

Intra- vs inter-node split: a two-level (rail-aligned) collective over M nodes of k
ranks sends S*(M-1)/(M*k) between nodes and S*(k-1)/k inside a node per rank for a
payload of S bytes; the two add up to the flat ring's S*(N-1)/N.

ZeRO++ (Wang et al. 2023): qwZ sends the forward all-gather as int8 with one fp32
scale per block (and the backward one too when hpZ is off); hpZ serves the backward
all-gather from a secondary copy sharded inside the node, so it never crosses nodes;
qgZ replaces the gradient reduce-scatter with a two-hop all-to-all of int4 values,
intra-node then inter-node, each hop carrying only what the next needs. Quantized
bytes follow the engine's blocking (`comm.blocks.plan_blocks`: a row of r values in
ceil(r / 2048) equal blocks, padded, one fp32 scale each): qwZ blocks each rank's shard,
qgZ's hop 1 each of the k parts of a bucket (P/k values), hop 2 each of the M rows (P/N).

Quantization (`Collective.codec_bytes`): a quantized collective quantizes what it sends and
dequantizes what it receives, on the device that computes; the time model charges those
bytes at the quantize + dequantize rate (timing.QUANTIZE_BW).

Scope (`CommEstimate.sent_by_scope`, what `engine.comm_stats(by_scope=True)` records): a
collective counts wholly as inter-node when its group spans nodes (the world group on
more than one node), as intra-node when it stays in one (hpZ's backward gather, qgZ's
hop 1); qgZ's hop 2 runs on the inter-node group. (`intra_bytes` / `inter_bytes` are the
link-level split of a two-level ring instead, for the time model.)

Gradient accumulation: stage 0 and 1 reduce once per step; stage 2 reduce-scatters
every micro-step (no full gradient is kept); stage 3 also gathers every micro-step.

Global gradient norm (stages >= 1, `compute_grad_norm`, always with fp16 loss
scaling): the shards differ per rank, so one 1-element fp32 all-reduce per step
combines their sums of squares (and tells every rank about an overflow). Stage 0
holds whole gradients and needs none.

Padding: with `layout` (`padding.plan_layout` over the trainable parameter sizes) the
elements are the engine's padded buckets and `calls` counts collective launches (one
per bucket, per chunk of an all-gather over `allgather_bucket_size`); this is what
`Engine.comm_stats()` records, exactly. Without it, stage 0 moves Φ and stages 1-3
move Φ rounded up to a multiple of N, and `calls` counts the model as one bucket.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from zeroshard.comm.blocks import QGZ_BITS, QUANT_BLOCK_SIZE, QWZ_BITS, plan_blocks
from zeroshard.comm.blocks import SCALE_BYTES as QUANT_SCALE_BYTES
from zeroshard.partition.layout import gather_ranges, shard_count_for
from zeroshard.policies import ConfigError, Precision, Stage

from zeroshard.estimate.memory import Strategy, shard
from zeroshard.estimate.padding import BucketPlan
from zeroshard.estimate.byte_units import FP32_BYTES

__all__ = ["Collective", "CommEstimate", "estimate_comm", "ring_split", "QUANT_BLOCK_SIZE", "QUANT_SCALE_BYTES",
           "QGZ_BITS", "QWZ_BITS"]


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step, totalled over `calls` (micro-steps)."""

    phase: str  # "forward", "backward", "step"
    op: str  # "all_reduce", "reduce_scatter", "all_gather", "all_to_all"
    what: str
    dtype: str
    calls: int  # launches per optimizer step: repeats (micro-steps) x buckets (1 without a layout)
    elements: int  # logical tensor elements per step (padded to a multiple of the group)
    bytes: int  # logical tensor bytes per step (payload as sent, quantized where quantized)
    paper_elements: int  # ZeRO paper units: AG/RS = elements, AR = 2 x elements
    sent_bytes: int  # bytes this rank sends, all hops (ring (n-1)/n)
    intra_bytes: int  # of sent_bytes, inside the node
    inter_bytes: int  # of sent_bytes, between nodes
    overlappable: bool  # can hide behind compute (bucketed during backward, or prefetched)
    scope: str = "world"  # the group it runs on: "world", "node" (inside one node), "two_hop" (qgZ)
    # ZeRO++: bytes of 16/32-bit values this rank quantizes plus those it dequantizes per step
    # (qwZ: its shard, then the whole gathered bucket; qgZ: both hops); 0 when not quantized
    codec_bytes: int = 0


@dataclass(frozen=True)
class CommEstimate:
    collectives: tuple[Collective, ...]
    params: int
    nodes: int = 1

    def total(self, key: str) -> int:
        return sum(getattr(c, key) for c in self.collectives)

    def sent_by_scope(self) -> dict[str, dict[str, int]]:
        """{"intra_node": {op: sent bytes}, "inter_node": {op: ...}} per step, as the engine's
        ledger scopes calls: a call on a group spanning nodes is inter-node."""
        out: dict[str, dict[str, int]] = {"intra_node": {}, "inter_node": {}}

        def put(scope: str, op: str, nbytes: int) -> None:
            out[scope][op] = out[scope].get(op, 0) + nbytes

        for c in self.collectives:
            if c.scope == "two_hop":
                put("intra_node", c.op, c.intra_bytes)
                put("inter_node", c.op, c.inter_bytes)
            elif c.scope == "node" or self.nodes == 1:
                put("intra_node", c.op, c.sent_bytes)
            else:
                put("inter_node", c.op, c.sent_bytes)
        return out

    @property
    def paper_units(self) -> float:
        """Volume per step in units of Φ (the paper's 2Φ / 3Φ)."""
        return self.total("paper_elements") / self.params

    def as_dict(self) -> dict:
        keys = ("elements", "bytes", "paper_elements", "sent_bytes", "intra_bytes", "inter_bytes")
        return {"collectives": [asdict(c) for c in self.collectives],
                "totals": {k: self.total(k) for k in keys}, "paper_units_of_params": self.paper_units,
                "sent_by_scope": self.sent_by_scope()}


def ring_split(payload: float, nodes: int, per_node: int) -> tuple[int, int]:
    """(intra, inter) bytes one rank sends in a two-level all-gather or reduce-scatter
    of `payload` bytes over `nodes` x `per_node` ranks."""
    inter = payload * (nodes - 1) / (nodes * per_node)
    intra = payload * (per_node - 1) / per_node
    return int(round(intra)), int(round(inter))


def _quantized_bytes(elements: int, bits: int, n_shards: int) -> int:
    """A tensor of `elements` cut in `n_shards` rows, each block-quantized to `bits` (the
    engine's blocking, comm.blocks.plan_blocks): payload with padding, plus the scales."""
    return n_shards * plan_blocks(math.ceil(elements / n_shards), bits).wire_bytes


def estimate_comm(params: int, strategy: Strategy, nodes: int, gpus_per_node: int,
                  gradient_accumulation_steps: int = 1, layout: BucketPlan | None = None,
                  frozen: int = 0) -> CommEstimate:
    """`params`: the trainable elements (gradients, optimizer); `frozen`: parameters that
    never change (a LoRA base). Only stage 3 moves frozen parameters (gathered in forward
    and backward); gradients and the stage 1/2 re-publication cover trainable ones only.
    Paper units are in Φ = params + frozen."""
    if frozen < 0:
        raise ConfigError(f"frozen parameter count must not be negative, got {frozen}")
    if gradient_accumulation_steps < 1:
        raise ConfigError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    s, gas = strategy, gradient_accumulation_steps
    n = nodes * gpus_per_node
    if layout is not None:
        if layout.shard_count != shard_count_for(s.stage, n):
            raise ConfigError(f"layout is split {layout.shard_count} ways; stage {int(s.stage)} on {n} ranks "
                              f"splits {shard_count_for(s.stage, n)} ways")
        padded = layout.padded_total
        buckets = layout.buckets
        gathers = sum(len(gather_ranges(sh, p, s.allgather_bucket_size, n))
                      for sh, p in zip(layout.shards, layout.padded))
    else:
        padded = params if s.stage == Stage.DATA_PARALLEL else shard(params, n) * n
        buckets = gathers = 1
    gathered = padded + (shard(frozen, n) * n if frozen else 0)  # stage 3 gathers frozen units too
    dtype = s.precision.value
    pb, gb = s.param_bytes, s.grad_bytes
    out: list[Collective] = []

    def add(phase, op, what, calls, elements, payload, overlap, group_nodes=nodes, group_per_node=gpus_per_node,
            dtype_=dtype, split=None, launches=1, scope="world", codec=0):
        """`calls` repeats per step of a whole-model collective of `elements`, issued as
        `launches` collectives (buckets) each time; `codec`: bytes quantized + dequantized per call."""
        factor = 2 if op == "all_reduce" else 1
        if split is None:
            intra, inter = ring_split(payload, group_nodes, group_per_node)
            intra, inter = factor * intra, factor * inter
        else:
            intra, inter = split
        out.append(Collective(phase=phase, op=op, what=what, dtype=dtype_, calls=calls * launches,
                              elements=elements * calls, bytes=int(payload) * calls,
                              paper_elements=factor * elements * calls, sent_bytes=(intra + inter) * calls,
                              intra_bytes=intra * calls, inter_bytes=inter * calls, overlappable=overlap,
                              scope=scope, codec_bytes=int(codec) * calls))

    if s.stage == Stage.DATA_PARALLEL:
        add("backward", "all_reduce", "gradients", 1, padded, gb * padded, s.overlap_comm, launches=buckets)
    elif s.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS):
        rs_calls = 1 if s.stage == Stage.OPTIMIZER_STATES else gas
        add("backward", "reduce_scatter", "gradients", rs_calls, padded, gb * padded,
            s.stage == Stage.GRADIENTS and s.overlap_comm, launches=buckets)
        add("step", "all_gather", "updated parameters", 1, padded, pb * padded, False, launches=gathers)
    else:
        # buckets as the engine gathers and reduces them: one per unit (with a layout), frozen
        # parameters as one more gathered bucket; without a layout the model is one bucket
        reduced = list(layout.padded) if layout is not None else [padded]
        gathered_buckets = reduced + ([shard(frozen, n) * n] if frozen else [])
        hp, k_, m_ = s.hpz_partition_size, gpus_per_node, nodes
        if hp > 1 and gpus_per_node % hp:
            raise ConfigError(f"zero_hpz_partition_size {hp} must divide gpus per node {gpus_per_node}")
        qwz_bytes = sum(_quantized_bytes(b, QWZ_BITS, n) for b in gathered_buckets)
        qwz_codec = pb * sum(b // n + b for b in gathered_buckets)  # quantize the shard, dequantize the whole
        n_units = len(gathered_buckets) if layout is not None else 1
        for phase in ("forward", "backward"):
            if phase == "backward" and hp > 1:
                add(phase, "all_gather", f"parameters (hpZ, within {hp} ranks)", gas, gathered,
                    pb * gathered, True, group_nodes=1, group_per_node=hp, scope="node", launches=n_units)
            elif s.quantized_weights:
                add(phase, "all_gather", "parameters (qwZ int8 + scales)", gas, gathered, qwz_bytes, True,
                    dtype_="int8", launches=n_units, codec=qwz_codec)
            else:
                add(phase, "all_gather", "parameters", gas, gathered, pb * gathered, True, launches=n_units)
        if s.quantized_gradients and n > 1:
            # hop 1: all-to-all inside the node of the full gradient (k parts of P/k), int4 + scales;
            # hop 2: all-to-all across nodes of the node-reduced 1/k slice (M rows of P/N).
            hop1 = sum(_quantized_bytes(b, QGZ_BITS, k_) for b in reduced) if k_ > 1 else 0
            hop2 = sum(_quantized_bytes(b // k_, QGZ_BITS, m_) for b in reduced) if m_ > 1 else 0
            intra = hop1 * (k_ - 1) // k_
            inter = hop2 * (m_ - 1) // m_
            # hop 1 quantizes the bucket and dequantizes the k parts received (the bucket's size
            # again); hop 2 the same with the node's 1/k slice; a hop inside a group of one is a copy
            qgz_codec = gb * sum((2 * b if k_ > 1 else 0) + (2 * (b // k_) if m_ > 1 else 0) for b in reduced)
            add("backward", "all_to_all", f"gradients (qgZ int{QGZ_BITS}, 2-hop)", gas, padded, hop1 + hop2, True,
                dtype_=f"int{QGZ_BITS}", split=(intra, inter), scope="two_hop", launches=2 * len(reduced),
                codec=qgz_codec)
        else:
            add("backward", "reduce_scatter", "gradients", gas, padded, gb * padded, True, launches=len(reduced))
    if s.stage >= Stage.OPTIMIZER_STATES and (s.compute_grad_norm or s.precision == Precision.FP16) and n > 1:
        add("step", "all_reduce", "global gradient norm", 1, 1, FP32_BYTES, False, dtype_="fp32")
    return CommEstimate(collectives=tuple(out), params=params + frozen, nodes=nodes)

