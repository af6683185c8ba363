"""Step time: compute, communication, PCIe, CPU optimizer and NVMe, each reported.

compute: nanoGPT's `estimate_mfu` (Kaplan et al. 2020 appendix; PaLM appendix B):
    FLOPs per token = 6Φ + 12·L·h·s  (forward 1/3, backward 2/3; attention term)
activation checkpointing repeats the forward: 8Φ + 16·L·h·s.
communication: bytes / (link bandwidth x ACHIEVED_LINK_FRACTION), intra- and
inter-node hops in sequence; collectives that overlap (bucketed reduce during
backward, stage-3 prefetch) hide behind the compute of their phase.
offload: PCIe copies, the CPU optimizer (bound by host memory bandwidth) and NVMe
reads/writes of the partitions, added without overlap (a conservative bound).
quantization (ZeRO++ qwZ / qgZ): every byte of a 16/32-bit tensor a quantized collective
quantizes or dequantizes (`Collective.codec_bytes`) costs 1 / (2 x rate) seconds, on the device
that computes and without overlap: it competes with compute for the same cores or SMs. The rate
is `quantize_bw` where given (estimate_time's argument, else the Cluster's: a measured
bench/bench_quantize.py "q+dq"), else the stated QUANTIZE_BW on a GPU or CPU_QUANTIZE_BW where
the host is the device. So ZeRO++ wins only where the link time it saves exceeds that, and the
planner (which ranks by `step`) does not recommend it where it loses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zeroshard.policies import OffloadDevice, Stage

from zeroshard.estimate.comm import CommEstimate
from zeroshard.estimate.hardware import ACHIEVED_LINK_FRACTION, Cluster
from zeroshard.estimate.memory import Strategy, shard
from zeroshard.estimate.model_size import ModelShape
from zeroshard.estimate.byte_units import FP32_BYTES, GB

__all__ = ["TimeEstimate", "estimate_time", "flops_per_token", "FLOPS_PER_PARAM_PER_TOKEN",
           "RECOMPUTE_FLOPS_PER_PARAM_PER_TOKEN", "ATTENTION_FLOPS_COEF", "BACKWARD_FRACTION", "QUANTIZE_BW",
           "CPU_QUANTIZE_BW", "quantization_seconds", "quantize_rate"]

FLOPS_PER_PARAM_PER_TOKEN = 6  # 2 forward + 4 backward (Kaplan et al. 2020, sec. 2.1)
RECOMPUTE_FLOPS_PER_PARAM_PER_TOKEN = 2  # one more forward under activation checkpointing
FROZEN_SKIPPED_FLOPS_PER_PARAM_PER_TOKEN = 2  # no weight gradient for a frozen parameter
ATTENTION_FLOPS_COEF = 12  # 12 * L * h * s per token (nanoGPT estimate_mfu; PaLM appendix B)
BACKWARD_FRACTION = 2 / 3  # share of the step's compute in backward
# ZeRO++'s quantize + dequantize rate on the device that computes, in bytes of the 16/32-bit
# tensor per second: bench/bench_quantize.py's "q+dq" (the input over quantize time plus
# dequantize time). On a GPU zeroshard quantizes with torch ops, about 7 passes over the tensor
# (~40 bytes of memory traffic per fp32 element for quantize + dequantize), so about HBM
# bandwidth x 4 / 40: ~150 GB/s on an A100 (1.6 TB/s), ~300 GB/s on an H100 (not measured: no
# GPU here); 100 GB/s is the stated figure.
QUANTIZE_BW = 100 * GB
# Where the host is the device (zeroshard on gloo), CPU tensors run comm.quantize_native's fused
# kernel, one thread per rank: 2-3 GB/s q+dq on a loaded 2-core VM (bench/RESULTS.md), so 2 GB/s
# is the stated figure. Pass a machine's own as Cluster(quantize_bw=...).
CPU_QUANTIZE_BW = 2 * GB


def flops_per_token(shape: ModelShape, seq: int, checkpointing: bool) -> float:
    """A frozen parameter (LoRA base) skips its weight gradient, 2 of its 6 FLOPs per token:
    the backward still carries the activation gradient through it."""
    scale = (FLOPS_PER_PARAM_PER_TOKEN + (RECOMPUTE_FLOPS_PER_PARAM_PER_TOKEN if checkpointing else 0))
    scale /= FLOPS_PER_PARAM_PER_TOKEN
    dense = FLOPS_PER_PARAM_PER_TOKEN * shape.params + ATTENTION_FLOPS_COEF * shape.layers * shape.hidden * seq
    return scale * dense - FROZEN_SKIPPED_FLOPS_PER_PARAM_PER_TOKEN * shape.frozen_params


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per optimizer step on one rank."""

    compute: float
    comm_total: float  # if nothing overlapped
    comm_intra: float
    comm_inter: float
    comm_exposed: float  # what overlap leaves on the critical path
    pcie: float
    cpu_optimizer: float
    nvme: float
    tokens_per_step: int  # all ranks
    quantization: float = 0.0  # ZeRO++ quantize + dequantize (qwZ, qgZ), not overlapped

    @property
    def step(self) -> float:
        return self.compute + self.comm_exposed + self.pcie + self.cpu_optimizer + self.nvme + self.quantization

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step

    def as_dict(self) -> dict:
        return {**asdict(self), "step": self.step, "tokens_per_second": self.tokens_per_second}


def quantize_rate(cluster: Cluster, host_is_device: bool = False, quantize_bw: float | None = None) -> float:
    """ZeRO++'s quantize + dequantize rate (bytes/s): `quantize_bw`, else the cluster's, else
    the stated one for the device kind (read when called)."""
    if quantize_bw is not None:
        return quantize_bw
    if cluster.quantize_bw is not None:
        return cluster.quantize_bw
    return CPU_QUANTIZE_BW if host_is_device else QUANTIZE_BW


def quantization_seconds(comm: CommEstimate, quantize_bw: float | None = None) -> float:
    """Seconds per step one rank spends quantizing and dequantizing (ZeRO++): each byte of
    `codec_bytes` at half the quantize + dequantize rate (`QUANTIZE_BW` unless given)."""
    rate = QUANTIZE_BW if quantize_bw is None else quantize_bw
    if rate <= 0:
        raise ValueError(f"quantize + dequantize rate must be positive, got {rate}")
    return sum(col.codec_bytes for col in comm.collectives) / (2 * rate)


def estimate_time(shape: ModelShape, strategy: Strategy, cluster: Cluster, comm: CommEstimate, seq: int,
                  micro_batch: int, gradient_accumulation_steps: int = 1,
                  quantize_bw: float | None = None) -> TimeEstimate:
    """`quantize_bw`: ZeRO++'s quantize + dequantize rate in bytes/s (default: `quantize_rate`,
    the cluster's or the stated one for the device kind)."""
    s, c, gas = strategy, cluster, gradient_accumulation_steps
    n, k_node = c.world_size, c.gpus_per_node
    tokens_rank = micro_batch * seq * gas
    compute = flops_per_token(shape, seq, s.activation_checkpointing) * tokens_rank / c.flops

    intra_bw = c.gpu.intra_node_bw * ACHIEVED_LINK_FRACTION
    inter_bw = c.inter_node_bw / k_node * ACHIEVED_LINK_FRACTION  # the node's NICs shared by its ranks
    hidden_window = {"forward": compute * (1 - BACKWARD_FRACTION), "backward": compute * BACKWARD_FRACTION}
    comm_intra = comm_inter = exposed = 0.0
    by_phase: dict[str, float] = {}
    for col in comm.collectives:
        t_intra = col.intra_bytes / intra_bw
        t_inter = col.inter_bytes / inter_bw if col.inter_bytes else 0.0
        comm_intra += t_intra
        comm_inter += t_inter
        if col.overlappable and col.phase in hidden_window:
            by_phase[col.phase] = by_phase.get(col.phase, 0.0) + t_intra + t_inter
        else:
            exposed += t_intra + t_inter
    for phase, t in by_phase.items():
        exposed += max(0.0, t - hidden_window[phase])

    own = shard(shape.trainable_params, n)  # optimizer partition: trainable parameters only
    own_params = own + shard(shape.frozen_params, n)  # stage-3 parameter shards, frozen base included
    pcie_bw = c.gpu.pcie_bw * ACHIEVED_LINK_FRACTION
    pcie = cpu = nvme = 0.0
    if s.offload_optimizer != OffloadDevice.NONE:
        grad_copies = gas if s.stage >= Stage.GRADIENTS else 1
        pcie += (s.grad_bytes * own * grad_copies + s.param_bytes * own) / pcie_bw
        # CPU Adam reads master, states and fp32 grad, writes master, states and the 16-bit copy.
        touched = own * (2 * s.k + FP32_BYTES + s.param_bytes)
        cpu += k_node * touched / c.host_mem_bw
        if s.offload_optimizer == OffloadDevice.NVME:
            nvme += k_node * (2 * s.k + 2 * FP32_BYTES) * own / c.nvme_bw  # states and fp32 grads, read + write
    if s.offload_param != OffloadDevice.NONE:
        fetches = 2 * gas  # forward and backward gather of every unit
        pcie += s.param_bytes * own_params * fetches / pcie_bw
        if s.offload_param == OffloadDevice.NVME:  # read per fetch; only updated (trainable) shards written
            nvme += k_node * s.param_bytes * (own_params * fetches + own) / c.nvme_bw
    return TimeEstimate(compute=compute, comm_total=comm_intra + comm_inter, comm_intra=comm_intra,
                        comm_inter=comm_inter, comm_exposed=exposed, pcie=pcie, cpu_optimizer=cpu, nvme=nvme,
                        tokens_per_step=tokens_rank * n,
                        quantization=quantization_seconds(comm, quantize_rate(c, s.host_is_device, quantize_bw)))
