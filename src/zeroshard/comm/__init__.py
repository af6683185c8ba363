"""Collectives behind typed interfaces (`AllGather`, `ReduceScatter`, `AllToAll`), their
ledger, and the topology.

Names are imported on first use (PEP 562), so the estimator can read `zeroshard.comm.blocks`
(ZeRO++'s quantization sizes, no torch) without loading torch.distributed."""

from __future__ import annotations

from zeroshard.lazy_exports import lazy_exports

_HOMES = {
    **dict.fromkeys(("Comm", "Handle"), "zeroshard.comm.collectives"),
    **dict.fromkeys(("AllGather", "AllToAll", "Collective", "ReduceScatter"), "zeroshard.comm.interfaces"),
    **dict.fromkeys(("COLLECTIVES", "PAPER_FACTOR", "CommLedger", "ring_sent_bytes"), "zeroshard.comm.ledger"),
    **dict.fromkeys(("QGZ_BITS", "QUANT_BLOCK_SIZE", "QWZ_BITS", "SCALE_BYTES", "Blocks", "plan_blocks"),
                    "zeroshard.comm.blocks"),
    **dict.fromkeys(("dequantize", "quantize"), "zeroshard.comm.quantization"),
    **dict.fromkeys(("INTER_NODE", "INTRA_NODE", "SCOPES", "Group", "Hierarchy", "Topology", "setup_topology",
                     "world_size_hint"), "zeroshard.comm.topology"),
    **dict.fromkeys(("World", "discover", "join_launcher"), "zeroshard.comm.launchers"),
    "expand_hostlist": "zeroshard.comm.hostlist",
    **dict.fromkeys(("QuantizedAllGather", "QuantizedAllToAll", "QuantizedHierarchicalReduceScatter"),
                    "zeroshard.comm.zeropp"),
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES)
