"""The cluster: GPUs, links, host memory and NVMe, with documented defaults.

Figures are vendor peak numbers (dense, no sparsity) from the data sheets named
in each entry; what a job achieves is a fraction of them, set by the named
constants below and overridable on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroshard.policies import ConfigError

from zeroshard.estimate.byte_units import GB, GIB

__all__ = [
    "GpuSpec", "LinkSpec", "Cluster", "GPUS", "INTER_NODE_LINKS", "gpu_spec", "inter_node_link",
    "ACHIEVED_FLOPS_FRACTION", "ACHIEVED_LINK_FRACTION", "DEFAULT_HOST_MEM_BW", "DEFAULT_NVME_BW",
]

# Model FLOP utilisation well-tuned dense-transformer training reaches on these GPUs
# (Megatron-LM reports 0.4-0.55, Narayanan et al. 2021; ZeRO-3 jobs typically 0.3-0.45).
ACHIEVED_FLOPS_FRACTION = 0.40
# Bus bandwidth NCCL reaches relative to the link's unidirectional peak (nccl-tests busbw
# for large messages: ~0.8 on NVLink and InfiniBand).
ACHIEVED_LINK_FRACTION = 0.80
# Host memory bandwidth a node's CPU optimizer step can use (2-socket DDR4/DDR5 server,
# ~200-400 GB/s STREAM triad); CPU Adam is bound by it, not by FLOPs.
DEFAULT_HOST_MEM_BW = 200 * GB
# Aggregate sequential NVMe bandwidth per node (one PCIe Gen4 x4 drive ~6-7 GB/s read).
DEFAULT_NVME_BW = 6 * GB


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory: int  # bytes
    peak_flops: float  # dense bf16/fp16 tensor FLOP/s (fp32 accumulate)
    intra_node_bw: float  # bytes/s one GPU sends to its node peers (NVLink, or PCIe if none)
    pcie_bw: float  # bytes/s host <-> device, one direction
    source: str


# Memory is what the device reports (80GB A100 = 80 GiB); H200 is sold as 141 GB decimal.
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("v100-32gb", 32 * GIB, 125e12, 150 * GB, 16 * GB, "V100 SXM2 data sheet; NVLink2 6x25 GB/s"),
    GpuSpec("a100-40gb", 40 * GIB, 312e12, 300 * GB, 32 * GB, "A100 data sheet; NVLink3 600 GB/s bidir"),
    GpuSpec("a100-80gb", 80 * GIB, 312e12, 300 * GB, 32 * GB, "A100 data sheet; NVLink3 600 GB/s bidir"),
    GpuSpec("h100-80gb", 80 * GIB, 989e12, 450 * GB, 64 * GB, "H100 SXM data sheet; NVLink4 900 GB/s bidir"),
    GpuSpec("h200", 141 * GB, 989e12, 450 * GB, 64 * GB, "H200 SXM data sheet; NVLink4 900 GB/s bidir"),
    GpuSpec("l40s", 48 * GIB, 362e12, 32 * GB, 32 * GB, "L40S data sheet; no NVLink, PCIe Gen4"),
    GpuSpec("rtx3090", 24 * GIB, 71e12, 32 * GB, 32 * GB, "Ampere GA102 whitepaper (fp32 acc.)"),
    GpuSpec("rtx4090", 24 * GIB, 165e12, 32 * GB, 32 * GB, "Ada whitepaper (fp16 tensor, fp32 acc.)"),
    GpuSpec("mi300x", 192 * GIB, 1307e12, 448 * GB, 64 * GB, "MI300X data sheet; Infinity Fabric 7x64 GB/s"),
)}


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bw_per_node: float  # bytes/s a node sends off-node, one direction, all NICs together
    source: str


INTER_NODE_LINKS: dict[str, LinkSpec] = {l.name: l for l in (
    LinkSpec("ib-ndr-8x", 400 * GB, "8 x 400 Gb/s InfiniBand NDR (DGX H100)"),
    LinkSpec("ib-hdr-8x", 200 * GB, "8 x 200 Gb/s InfiniBand HDR (DGX A100)"),
    LinkSpec("efa-p4d", 50 * GB, "AWS p4d: 4 x 100 Gb/s EFA"),
    LinkSpec("ib-hdr-1x", 25 * GB, "1 x 200 Gb/s InfiniBand HDR"),
    LinkSpec("roce-100g", 12.5 * GB, "1 x 100 Gb/s Ethernet (RoCE)"),
    LinkSpec("eth-25g", 3.125 * GB, "1 x 25 Gb/s Ethernet"),
)}


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key not in table:
        raise ConfigError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return table[key]


def gpu_spec(name: str) -> GpuSpec:
    return _lookup(GPUS, name, "GPU")


def inter_node_link(name: str) -> LinkSpec:
    return _lookup(INTER_NODE_LINKS, name, "inter-node link")


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` devices; data-parallel size N = nodes * gpus_per_node."""

    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    inter_node_bw: float  # bytes/s per node
    host_mem: int  # bytes of CPU memory per node
    nvme: int = 0  # bytes of NVMe per node (0: none)
    host_mem_bw: float = DEFAULT_HOST_MEM_BW
    nvme_bw: float = DEFAULT_NVME_BW
    achieved_flops: float | None = None  # FLOP/s per GPU; None: peak * ACHIEVED_FLOPS_FRACTION
    # ZeRO++ quantize + dequantize rate per device, bytes of the 16/32-bit tensor per second
    # (bench/bench_quantize.py's "q+dq"); None: timing's stated rate (QUANTIZE_BW on a GPU,
    # CPU_QUANTIZE_BW where the host is the device)
    quantize_bw: float | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("inter_node_bw", "host_mem", "nvme", "host_mem_bw", "nvme_bw"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.achieved_flops is not None and self.achieved_flops <= 0:
            raise ConfigError(f"achieved FLOP/s must be positive, got {self.achieved_flops}")
        if self.quantize_bw is not None and self.quantize_bw <= 0:
            raise ConfigError(f"quantize + dequantize rate must be positive bytes/s, got {self.quantize_bw}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flops(self) -> float:
        return self.achieved_flops or self.gpu.peak_flops * ACHIEVED_FLOPS_FRACTION

    def with_size(self, nodes: int, gpus_per_node: int | None = None) -> "Cluster":
        return replace(self, nodes=nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)
