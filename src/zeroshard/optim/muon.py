"""Muon (K. Jordan et al. 2024, "Muon: An optimizer for hidden layers"), DeepSpeed's `Muon`.

Written from the public reference algorithm (MIT): each parameter group says `use_muon`.
A Muon group's matrices get momentum orthogonalized by Newton-Schulz; every other parameter
(embeddings, the head, biases, norms) gets AdamW, as DeepSpeed's `MuonWithAuxAdam` does:

    Muon half, per matrix W with gradient G:
        M = momentum * M + (1 - momentum) * G              (state `momentum_buffer`)
        U = (1 - momentum) * G + momentum * M              (Nesterov blend)
        O = NS5(U) * sqrt(max(1, rows / cols))             (a 4-D filter is viewed as rows x rest)
        W = W * (1 - lr * weight_decay) - lr * O
    NS5: X = U / (|U|_F + 1e-7), transposed when rows > cols, then 5 times
        A = X X^T;  X = 3.4445 X + (-4.7750 A + 2.0315 A A) X
    Adam half: AdamW (bias-corrected moments `exp_avg`, `exp_avg_sq`; decay decoupled unless
        `adam_w_mode` is false, then added to the gradient as L2).

Newton-Schulz needs the whole matrix; the momentum and the blend are elementwise. zeroshard
steps flat fp32 shards of buckets, so the sharded optimizer tells Muon, per master, where each
parameter lies in its bucket, which part of the bucket this rank's shard is, and how to gather
the bucket (`place_matrices`). At stage 0 the shard is the whole bucket: nothing moves. At
stages 1-3 each rank updates the momentum on its own shard, blends U there, then all-gathers U
of the Muon buckets through zeroshard.comm (4 bytes x the Muon bucket elements per rank per
step, as the ledger counts an all-gather: on the wire each rank receives (N-1)/N of that);
every rank then orthogonalizes the matrices that overlap its shard (a matrix cut by a shard
boundary is computed on both ranks: the same fp32 inputs, the same result) and keeps its own
slice. Adam buckets move nothing extra. DeepSpeed gathers the gradient (and at stage 1-2 with
offload also the momentum) instead; the traffic is of the same order.

Precision: zeroshard runs Newton-Schulz in fp32 on any device. DeepSpeed runs it in bf16
(`ns_method` "standard") or fp16 ("gram": the same iteration written on the Gram matrix
X X^T, equal in exact arithmetic) on GPUs, so its matrices differ from these by half-precision
rounding (about 1e-2 relative); both `ns_method` values are accepted here and computed by the
standard iteration in fp32. `per_head_muon` (per-attention-head orthogonalization) is not built.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from zeroshard.optim.per_tensor import PerTensorOptimizer

__all__ = ["Muon", "newton_schulz", "orthogonal_update"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}

Gather = Callable[[torch.Tensor], torch.Tensor]  # this rank's shard -> the whole padded bucket


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix, in fp32,
    batched over leading dimensions."""
    a, b, c = NS_COEFFS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def orthogonal_update(u: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The Muon step direction of a whole parameter of `shape` whose blended update is `u`
    (any layout of its elements, row-major), flat."""
    if len(shape) < 2:
        raise ValueError(f"Muon orthogonalizes matrices: a parameter of shape {tuple(shape)} is in a use_muon "
                         "group; tag it use_muon = False (Adam) instead")
    m = u.reshape(shape)
    if m.dim() == 4:  # convolution filters: out_channels x the rest
        m = m.reshape(shape[0], -1)
    scale = math.sqrt(max(1.0, shape[-2] / shape[-1]))
    return (newton_schulz(m) * scale).reshape(-1)


class Muon(PerTensorOptimizer):
    algorithm = "Muon"

    """Muon with an auxiliary AdamW, over param groups that each carry `use_muon` (see the
    module docstring); DeepSpeed's per-half defaults fill what a group leaves out."""

    def __init__(self, params, adam_w_mode: bool = True) -> None:
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise ValueError("Muon takes param groups (dicts), each with use_muon = True or False")
        for group in groups:
            if "use_muon" not in group:
                raise ValueError("Muon: every param group needs use_muon = True (matrices, Newton-Schulz) or "
                                 "False (AdamW); one has no use_muon")
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(key, value)
            _check_group(group)
        super().__init__(groups, dict(adam_w_mode=adam_w_mode))
        self._placed: dict[int, tuple[list[tuple[int, tuple[int, ...]]], int, int, Gather | None]] = {}

    def place_matrices(self, param: torch.Tensor, tensors: list[tuple[int, tuple[int, ...]]],
                       shard: tuple[int, int], gather: Gather | None) -> None:
        """`param` (a flat master) is elements [shard[0], shard[1]) of a flat bucket holding one
        model tensor of each `(offset, shape)` of `tensors`; `gather(x)`, given this rank's
        values of `param`'s shape, returns the whole bucket's (None: `param` is the whole
        bucket). Elements outside the tensors (padding) never change."""
        self._placed[id(param)] = (list(tensors), shard[0], shard[1], gather)

    @property
    def steps_collectively(self) -> bool:
        """Whether a step issues collectives (a Muon bucket is gathered): then every rank must step
        the same sub-groups in the same order, after backward."""
        return any(gather is not None for *_, gather in self._placed.values())

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        (self._muon_step if group["use_muon"] else self._adam_step)(p, group)

    def _muon_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta, g, m = group["momentum"], p.grad, state["momentum_buffer"]
        m.lerp_(g, 1.0 - beta)
        blended = g.lerp(m, beta)
        decay, lr = 1.0 - group["lr"] * group["weight_decay"], group["lr"]
        placed = self._placed.get(id(p))
        if placed is None:  # a whole tensor (Muon used directly, outside an engine)
            p.mul_(decay).add_(orthogonal_update(blended, tuple(p.shape)).view_as(p), alpha=-lr)
            return
        tensors, lo, hi, gather = placed
        whole = gather(blended.view(-1)) if gather is not None else blended.view(-1)
        flat = p.view(-1)
        for offset, shape in tensors:
            end = offset + math.prod(shape)
            start, stop = max(offset, lo), min(end, hi)
            if start >= stop:
                continue
            update = orthogonal_update(whole[offset:end], shape)
            part = flat[start - lo: stop - lo]
            part.mul_(decay).add_(update[start - offset: stop - offset], alpha=-lr)

    def _adam_step(self, p: torch.Tensor, group: dict) -> None:
        state = self._adam_state(p)
        step, (beta1, beta2) = int(state["step"].item()), group["betas"]
        lr, wd, g = group["lr"], group["weight_decay"], p.grad
        decoupled = group.get("adam_w_mode", True)
        if wd and not decoupled:
            g = g.add(p, alpha=wd)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / (1.0 - beta2 ** step)).sqrt_().add_(group["eps"])
        if wd and decoupled:
            p.mul_(1.0 - lr * wd)
        p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))


def _check_group(group: dict) -> None:
    if group["lr"] < 0 or group["weight_decay"] < 0:
        raise ValueError(f"invalid lr {group['lr']} or weight_decay {group['weight_decay']}")
    if group["use_muon"]:
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"invalid momentum {group['momentum']}: must be in [0, 1)")
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {list(NS_METHODS)}, got {group['ns_method']!r}")
        return
    betas = group["betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas {betas!r}: two numbers in [0, 1)")
    group["betas"] = (float(betas[0]), float(betas[1]))
    if group["eps"] < 0:
        raise ValueError(f"invalid eps {group['eps']}")
