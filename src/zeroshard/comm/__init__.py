"""Collectives behind one small interface, their ledger, and the topology."""

from zeroshard.comm.collectives import Comm, Handle
from zeroshard.comm.ledger import COLLECTIVES, PAPER_FACTOR, CommLedger, ring_sent_bytes
from zeroshard.comm.topology import Topology, setup_topology, world_size_hint

__all__ = ["COLLECTIVES", "PAPER_FACTOR", "Comm", "CommLedger", "Handle", "Topology",
           "ring_sent_bytes", "setup_topology", "world_size_hint"]
