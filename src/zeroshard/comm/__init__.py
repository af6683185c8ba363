"""Collectives behind one small interface, their ledger, and the topology."""

from zeroshard.comm.collectives import Comm, Handle
from zeroshard.comm.ledger import COLLECTIVES, PAPER_FACTOR, CommLedger, ring_sent_bytes
from zeroshard.comm.quantize import QUANT_BLOCK_SIZE, Blocks, dequantize, plan_blocks, quantize
from zeroshard.comm.topology import (INTER_NODE, INTRA_NODE, SCOPES, Group, Hierarchy, Topology,
                                     setup_topology, world_size_hint)
from zeroshard.comm.zeropp import QGZ_BITS, QuantizedAllGather, QuantizedHierarchicalReduceScatter

__all__ = ["COLLECTIVES", "INTER_NODE", "INTRA_NODE", "PAPER_FACTOR", "QGZ_BITS", "QUANT_BLOCK_SIZE", "SCOPES",
           "Blocks", "Comm", "CommLedger", "Group", "Handle", "Hierarchy", "QuantizedAllGather",
           "QuantizedHierarchicalReduceScatter", "Topology", "dequantize", "plan_blocks", "quantize",
           "ring_sent_bytes", "setup_topology", "world_size_hint"]
