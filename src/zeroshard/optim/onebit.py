"""1-bit Adam (Tang et al. 2021, arXiv:2102.02888), DeepSpeed's `OneBitAdam`, at ZeRO stage 0.

Two phases, switched by `freeze_step` (counted in optimizer steps):

  warm-up (steps 1 .. freeze_step): Adam over the gradient the stage all-reduced in full
      m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  compression (later steps): v is frozen; the stage does not reduce gradients (the optimizer
      tells it, `reduces_gradients()`), each rank updates m with its own gradient and the ranks
      exchange m with the error-compensated 1-bit all-reduce (comm/onebit.py):
      m = onebit_mean(b1 m + (1-b1) g_local)
  both:  p = p - lr * (m / (sqrt(v) + eps) + weight_decay * p)

As DeepSpeed's OnebitAdam: no bias correction (it accepts `bias_correction` and never applies
it; zeroshard says so at load), weight decay added to the update (decoupled), and the worker
and server errors kept per tensor. Unlike it, the first step is a real Adam step (DeepSpeed's
first call only allocates its buffers and drops that step's gradient), and `eps_inside_sqrt`
is honoured (m / sqrt(v + eps)). The errors live beside the states (`error_bytes`), not in
`state`, so checkpoints hold Adam's states only and load on any world size; like DeepSpeed,
a loaded run starts with zero errors.

The compression needs the whole of each tensor on every rank: stage 0 (DeepSpeed refuses the
1-bit family under ZeRO). A flat bucket is told where its tensors lie (`split_into_tensors`).
Without a process group (`connect` never called, or one rank) it is Adam as above.
"""

from __future__ import annotations

import torch

from zeroshard.optim.per_tensor import PerTensorOptimizer
from zeroshard.policies import ONEBIT_SHARDED, ConfigError

__all__ = ["OneBitAdam", "OneBitBase"]


class OneBitBase(PerTensorOptimizer):
    """What the family shares: the tensors of each flat parameter, the process group, the
    compressed all-reduce per parameter, and the question the stage asks before each step."""

    sharded_refusal = ONEBIT_SHARDED
    one_scale = False  # one 1-bit scale per flat parameter, not per tensor (1-bit Lamb)
    # a param group's `exp_avg_mask` (DeepSpeed's: the momentum, once exchanged 1-bit, is
    # multiplied by it, so elements whose momentum is always 0, such as BERT's unused position
    # rows, do not take the +-scale the sign code gives every element). It comes from the script
    # each run and is not saved in checkpoints (as in DeepSpeed, the current group's mask wins).
    # 0/1 Adam masks what it exchanges: the 1-bit gradient and the synchronised accumulated update.
    unsaved_group_keys = ("exp_avg_mask",)

    def __init__(self, params, defaults: dict) -> None:
        super().__init__(params, defaults)
        self._flat_masks: dict[int, torch.Tensor] = {}
        self._tensors: dict[int, list[tuple[int, int]]] = {}
        self._comm = None
        self._allreduce: dict[int, object] = {}
        self.steps_done = 0  # optimizer steps completed (all sub-groups of a step count once)

    def split_into_tensors(self, param: torch.Tensor, spans: list[tuple[int, int]]) -> None:
        """`param` (a flat bucket) holds one model tensor at each (start, length) of `spans`;
        elements outside them (padding) take no part in the exchange."""
        self._tensors[id(param)] = list(spans)

    def mask_momentum(self, p: torch.Tensor, group: dict, m: torch.Tensor) -> None:
        """m *= the group's exp_avg_mask, laid out over `p`'s tensors (each tensor takes the
        mask in its own shape; a flat bucket of several tensors takes it once per tensor)."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        flat = self._flat_masks.get(id(p))
        if flat is None:
            flat = torch.ones(p.numel(), dtype=m.dtype, device=m.device)
            for a, n in self.spans(p):
                if mask.numel() != n:
                    raise ConfigError(f"exp_avg_mask has {mask.numel()} elements but a parameter of its group has "
                                      f"{n}: give each masked parameter a group of its own, with a mask of its shape")
                flat[a:a + n] = mask.reshape(-1).to(flat)
            self._flat_masks[id(p)] = flat
        m.view(-1).mul_(flat)

    def connect(self, comm) -> None:
        """The group whose ranks exchange compressed values (the stage's world group)."""
        self._comm = comm

    @property
    def distributed(self) -> bool:
        return self._comm is not None and self._comm.world_size > 1

    def spans(self, p: torch.Tensor) -> list[tuple[int, int]]:
        return self._tensors.get(id(p), [(0, p.numel())])

    def onebit_mean(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """`value` (shaped as `p`) := its error-compensated 1-bit mean over the ranks."""
        if not self.distributed:
            return
        op = self._allreduce.get(id(p))
        if op is None:
            from zeroshard.comm.onebit import OneBitAllReduce

            op = self._allreduce[id(p)] = OneBitAllReduce(self._comm, p.numel(), self.spans(p), p.device,
                                                          what=f"a {p.numel()}-element parameter",
                                                          one_scale=self.one_scale)
        op(value)

    @property
    def error_bytes(self) -> int:
        """Bytes of the worker and server errors (not in `state`: see the module docstring)."""
        return sum(op.error_bytes for op in self._allreduce.values())

    def reset_errors(self) -> None:
        for op in self._allreduce.values():
            op.reset_errors()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.steps_done = max((int(s["step"].item()) for s in self.state.values() if "step" in s), default=0)
        self.reset_errors()  # as DeepSpeed: errors are per rank and not saved

    def reduces_gradients(self) -> bool:
        """Whether the stage must all-reduce the gradients of the coming step in full."""
        raise NotImplementedError

    def _count_step(self, state: dict) -> int:
        """This parameter's step number, counted in a scalar tensor (as torch's Adam and Lamb keep it)."""
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        state["step"] += 1
        step = int(state["step"].item())
        self.steps_done = max(self.steps_done, step)
        return step


class OneBitAdam(OneBitBase):
    algorithm = "1-bit Adam"

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("1-bit Adam has no AMSGrad variant (DeepSpeed refuses it too)")
        if lr < 0 or eps < 0 or weight_decay < 0 or freeze_step < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps}, weight_decay {weight_decay} or freeze_step {freeze_step}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(params, dict(lr=lr, freeze_step=int(freeze_step), bias_correction=bias_correction,
                                      betas=tuple(betas), eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                                      weight_decay=weight_decay))
        self.freeze_step = int(freeze_step)

    def reduces_gradients(self) -> bool:
        return self.steps_done < self.freeze_step

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # per parameter, from its own count: the sub-groups of one step all decide alike
        compressed = self._count_step(state) > self.freeze_step
        (beta1, beta2), m, v, g = group["betas"], state["exp_avg"], state["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        if compressed:
            self.onebit_mean(p, m)  # g was this rank's own: the exchange of m is the only reduction
            self.mask_momentum(p, group, m)
        else:
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        update = m / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])
