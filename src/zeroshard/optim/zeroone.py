"""0/1 Adam (Lu et al. 2022, arXiv:2202.06009), DeepSpeed's `ZeroOneAdam`, at ZeRO stage 0.

Step t (counted from 1) of each parameter, with g the gradient:

  variance phase (t <= var_freeze_step):
    t a multiple of the variance interval: the stage all-reduced g in full;
        v = b2 v + (1-b2) g^2;  m = b1 m + (1-b1) g
    else: the stage reduced nothing; m = b1 m + (1-b1) onebit_mean(g_local)
    the interval starts at 1 and doubles after every `var_update_scaler` variance updates
  frozen phase (t > var_freeze_step): v fixed, no gradient reduction; local steps
    m = b1 m + (1-b1) g_local;  u += -lr * update;  lrs += lr
    every `local_step_interval` steps (1, doubled after every `local_step_scaler` frozen steps,
    at most `local_step_clipper`) the ranks synchronise: the local updates are undone,
    u' = onebit_mean(u * (sqrt(v) + eps)),  m = -u' / lrs,  p += u' / (sqrt(v) + eps)
  both: update = m / (sqrt(v) + eps) + weight_decay * p;  p -= lr * update

As DeepSpeed's zoadam.py: no bias correction, the errors reset once when the variance freezes
(they then carry another quantity), and between synchronisations each rank's parameters are
its own. The two intervals follow from t alone, so nothing but the step count, m, v, u and
lrs is state (checkpoints resume them). Unlike DeepSpeed, the first step is a real step (its
first call drops the gradient to allocate buffers).
"""

from __future__ import annotations

import torch

from zeroshard.optim.onebit import OneBitBase

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OneBitBase):
    algorithm = "0/1 Adam"

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("0/1 Adam has no AMSGrad variant (DeepSpeed refuses it too)")
        if lr < 0 or eps < 0 or weight_decay < 0 or var_freeze_step < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps}, weight_decay {weight_decay} or var_freeze_step")
        if min(var_update_scaler, local_step_scaler, local_step_clipper) < 1:
            raise ValueError("var_update_scaler, local_step_scaler and local_step_clipper must be >= 1")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      var_freeze_step=int(var_freeze_step), var_update_scaler=int(var_update_scaler),
                                      local_step_scaler=int(local_step_scaler),
                                      local_step_clipper=int(local_step_clipper)))
        self.var_freeze_step, self.var_update_scaler = int(var_freeze_step), int(var_update_scaler)
        self.local_step_scaler, self.local_step_clipper = int(local_step_scaler), int(local_step_clipper)
        self._intervals = [1, 1, 0]  # the variance interval at step [0]: (step, interval, updates since doubling)
        self._errors_reset = False

    def var_interval(self, t: int) -> int:
        """The variance interval in force at step t (t <= var_freeze_step)."""
        if t < self._intervals[0]:
            self._intervals = [1, 1, 0]
        step, interval, count = self._intervals
        while step < t:  # advance over step `step`, which updated v if it was a multiple
            if step % interval == 0:
                count += 1
                if count == self.var_update_scaler:
                    interval, count = interval * 2, 0
            step += 1
        self._intervals = [step, interval, count]
        return interval

    def local_interval(self, t: int) -> int:
        """The synchronisation interval at frozen step t."""
        doublings = (t - self.var_freeze_step - 1) // self.local_step_scaler
        return min(self.local_step_clipper, 2 ** min(doublings, 62))

    def reduces_gradients(self) -> bool:
        t = self.steps_done + 1
        return t <= self.var_freeze_step and t % self.var_interval(t) == 0

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "exp_avg" not in state:
            for name in ("exp_avg", "exp_avg_sq", "momentum_accumulator"):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["lrs"] = torch.zeros((), dtype=torch.float32)
        t = self._count_step(state)
        frozen = t > self.var_freeze_step
        if frozen and not self._errors_reset:  # the errors now carry u, not g: start them afresh
            self.reset_errors()
            self._errors_reset = True
        (beta1, beta2), m, v, u, g = group["betas"], state["exp_avg"], state["exp_avg_sq"], \
            state["momentum_accumulator"], p.grad
        lr, eps = group["lr"], group["eps"]
        if frozen:
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)
            state["lrs"] += lr
        elif t % self.var_interval(t) == 0:
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        else:
            g = g.clone()
            self.onebit_mean(p, g)
            self.mask_momentum(p, group, g)  # DeepSpeed masks the 1-bit gradient here
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        denom = (v + eps).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(eps)
        update = m / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-lr)
        if not frozen:
            return
        u.add_(update, alpha=-lr)
        if t % self.local_interval(t) == 0:  # synchronise
            p.sub_(u)
            u.mul_(denom)
            self.onebit_mean(p, u)
            self.mask_momentum(p, group, u)  # and the exchanged accumulated update
            torch.div(u, -state["lrs"], out=m)
            p.add_(u / denom)
            u.zero_()
            state["lrs"].zero_()
