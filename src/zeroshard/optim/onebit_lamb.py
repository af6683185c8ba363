"""1-bit Lamb (Li et al. 2021, arXiv:2104.06069), DeepSpeed's `OneBitLamb`, at ZeRO stage 0.

Per model tensor k (a span of a flat bucket), step t counted from 1:

  warm-up (t <= freeze_step), over the stage's full all-reduce: Lamb without bias correction
      m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  (at t = freeze_step: v_fresh = v)
      u = m / (sqrt(v) + eps) + wd p;  c = clamp(|p_k| / |u_k|, min_coeff, max_coeff) (1 if a norm is 0)
      c_frozen_k = coeff_beta c_frozen_k + (1-coeff_beta) c   (where c != 1);  p -= lr c u
  compression (t > freeze_step): v frozen, no gradient reduction
      at the first such step, s_k = mean_j(|m_j| / sqrt(n_j)) / (|m_k| / sqrt(n_k)) over every tensor
      of the optimizer, so that all momenta have one magnitude in the exchange
      m_prev = m;  m = onebit_mean(s (b1 m + (1-b1) g_local)) / s     (one scale per bucket)
      g~ = (m - b1 m_prev) / (1-b1);  v_fresh = b2 v_fresh + (1-b2) g~^2
      u = m / (sqrt(v) + eps) + wd p
      f_k = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps)) over tensor k; with weight decay
      f = f r + (1 - r), r = min(1, |m / (sqrt(v) + eps)| / |u|); f clamped to [factor_min,
      factor_max] and to within factor_threshold of the last step's;  p -= lr c_frozen f u

As DeepSpeed's lamb.py, whose exchange is one flat tensor of every momentum with one scale;
here each bucket is one exchange with one scale (the per-tensor rescaling s makes the
difference small). Unlike it, the first step is a real step, and `eps_inside_sqrt` is honoured.
"""

from __future__ import annotations

import torch

from zeroshard.optim.onebit import OneBitBase

__all__ = ["OneBitLamb"]


class OneBitLamb(OneBitBase):
    algorithm = "1-bit Lamb"
    one_scale = True
    # one value per model tensor of a bucket, in its slot order: checkpoints find them by tensor name
    per_tensor_states = ("lamb_coeff_freeze", "last_factor", "scaling_coeff")

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        if amsgrad:
            raise ValueError("1-bit Lamb has no AMSGrad variant (DeepSpeed refuses it too)")
        if lr < 0 or eps < 0 or weight_decay < 0 or freeze_step < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps}, weight_decay {weight_decay} or freeze_step {freeze_step}")
        if not all(0.0 <= b < 1.0 for b in (*betas, coeff_beta)):
            raise ValueError(f"invalid betas {betas} or coeff_beta {coeff_beta}: each must be in [0, 1)")
        if not (0 <= min_coeff <= max_coeff and 0 < factor_min <= factor_max and factor_threshold >= 0):
            raise ValueError("invalid min_coeff/max_coeff, factor_min/factor_max or factor_threshold")
        super().__init__(params, dict(lr=lr, freeze_step=int(freeze_step), bias_correction=bias_correction,
                                      betas=tuple(betas), eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                                      weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff,
                                      coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
                                      factor_threshold=factor_threshold))
        self.freeze_step = int(freeze_step)

    def reduces_gradients(self) -> bool:
        return self.steps_done < self.freeze_step

    def _momentum_scales(self) -> None:
        """s_k for every tensor of every parameter, from the momenta as they are now."""
        rms = {id(p): torch.stack([self.state[p]["exp_avg"].view(-1)[a:a + n].norm() / n ** 0.5
                                   for a, n in self.spans(p)])
               for g in self.param_groups for p in g["params"] if "exp_avg" in self.state[p]}
        united = torch.cat(list(rms.values())).mean()
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in rms:
                    self.state[p]["scaling_coeff"] = united / rms[id(p)]

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        state, spans = self.state[p], self.spans(p)
        if "exp_avg" not in state:
            for name in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["lamb_coeff_freeze"] = torch.zeros(len(spans))
            state["last_factor"] = torch.ones(len(spans))
        t = self._count_step(state)
        (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
        m, v, fresh, g = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"], p.grad
        sqrt = (lambda x: (x + eps).sqrt_()) if group["eps_inside_sqrt"] else (lambda x: x.sqrt().add_(eps))
        if t <= self.freeze_step:
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            if t == self.freeze_step:
                fresh.copy_(v)
            update = m / sqrt(v)
            if wd:
                update.add_(p, alpha=wd)
            self._warmup_step(p, update, spans, state, group)
            return
        if "scaling_coeff" not in state:
            self._momentum_scales()
        scale = self._per_element(state["scaling_coeff"], spans, p)
        last = m.clone()
        m.mul_(b1).add_(g, alpha=1.0 - b1).mul_(scale)
        self.onebit_mean(p, m)
        m.div_(scale)
        self.mask_momentum(p, group, m)
        rebuilt = (m - last * b1) / (1.0 - b1)
        fresh.mul_(b2).addcmul_(rebuilt, rebuilt, value=1.0 - b2)
        denom = sqrt(v)
        prelim = m / denom
        update = prelim + p * wd if wd else prelim
        ratio_of = denom / sqrt(fresh)
        for k, (a, n) in enumerate(spans):
            factor = ratio_of.view(-1)[a:a + n].max()
            if wd:
                u_norm = update.view(-1)[a:a + n].norm()
                r = torch.clamp(prelim.view(-1)[a:a + n].norm() / u_norm, max=1.0) if u_norm > 0 else 1.0
                factor = factor * r + (1.0 - r)
            factor = factor.clamp(group["factor_min"], group["factor_max"])
            lastf = state["last_factor"][k]
            factor = factor.clamp(lastf * (1.0 - group["factor_threshold"]), lastf * (1.0 + group["factor_threshold"]))
            state["last_factor"][k] = factor
            p.view(-1)[a:a + n].sub_(update.view(-1)[a:a + n] * (group["lr"] * state["lamb_coeff_freeze"][k] * factor))

    @staticmethod
    def _per_element(values: torch.Tensor, spans, p: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as `p` holding values[k] over span k (1 over padding)."""
        out = torch.ones_like(p).view(-1)
        for k, (a, n) in enumerate(spans):
            out[a:a + n] = values[k]
        return out.view_as(p)

    def _warmup_step(self, p, update, spans, state, group) -> None:
        """Lamb's step per tensor; the trust ratio's running mean is what the compression stage uses."""
        beta = group["coeff_beta"]
        for k, (a, n) in enumerate(spans):
            w, u = p.view(-1)[a:a + n], update.view(-1)[a:a + n]
            w_norm, u_norm = w.norm(), u.norm()
            coeff = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]) if w_norm > 0 and u_norm > 0 \
                else torch.tensor(1.0)
            if coeff != 1.0:
                state["lamb_coeff_freeze"][k] = beta * state["lamb_coeff_freeze"][k] + (1.0 - beta) * coeff
            w.sub_(u * (group["lr"] * coeff))
