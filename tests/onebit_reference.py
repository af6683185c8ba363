"""The one-process references of tests/test_onebit.py, written from the papers (1-bit Adam,
Tang et al. 2021; 0/1 Adam, Lu et al. 2022; 1-bit Lamb, Li et al. 2021) and DeepSpeed's
description of its compressed all-reduce (DeepSpeed 0.17.6, runtime/comm/nccl.py): one process
holds the N workers' gradients (each worker's rows of the batch) and simulates every worker's
sign compression with its own error, the server's averaging of chunk j with its own error, and
the result. No zeroshard code runs here.
"""

from __future__ import annotations

import math

import torch

from oracle import MICRO, Case, batch, loss_of, make_model

N, STEPS, FREEZE = 2, 5, 3
# eps 1e-3: embedding rows no batch has touched still have v = 0 when it freezes, and a 1-bit m
# (every element +-scale) over sqrt(0) + 1e-8 throws them far, so a few ulps of difference in
# the sums would decide the comparison (DeepSpeed's users mask such rows: exp_avg_mask)
ADAM = {"lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-3, "weight_decay": 0.01}
ONEBIT = {"type": "OneBitAdam", "params": {**ADAM, "freeze_step": FREEZE, "cuda_aware": False,
                                           "comm_backend_name": "nccl"}}


def one_bit_mean(values: list[torch.Tensor], worker_err: list[torch.Tensor], server_err: list[torch.Tensor]):
    """DeepSpeed's compressed_allreduce for one tensor, all N workers in one process."""
    n, length = len(values), values[0].numel()
    padded = math.ceil(length / (8 * n)) * 8 * n
    chunk = padded // n
    sent = []
    for r, v in enumerate(values):
        x = torch.zeros(padded)
        x[:length] = v.reshape(-1)
        x += worker_err[r]
        scale = x.norm() / math.sqrt(padded)
        sign = torch.where(x >= 0, 1.0, -1.0)
        worker_err[r] = x - scale * sign
        sent.append((scale, sign))
    out = torch.zeros(padded)
    for j in range(n):
        part = slice(j * chunk, (j + 1) * chunk)
        y = sum(scale * sign[part] for scale, sign in sent) / n + server_err[j]
        scale = y.norm() / math.sqrt(chunk)
        sign = torch.where(y >= 0, 1.0, -1.0)
        server_err[j] = y - scale * sign
        out[part] = scale * sign
    return out[:length].view_as(values[0])


class SimulatedOneBitAdam:
    """1-bit Adam on N simulated workers; `step(worker_grads)` takes each worker's gradients."""

    def __init__(self, params, n=N, freeze_step=FREEZE, lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ADAM["eps"],
                 weight_decay=ADAM["weight_decay"], error_feedback=True, masks=None):
        self.params, self.n, self.freeze, self.t = list(params), n, freeze_step, 0
        self.masks = masks or [None] * len(self.params)  # DeepSpeed's exp_avg_mask, per parameter
        self.lr, self.betas, self.eps, self.wd, self.feedback = lr, betas, eps, weight_decay, error_feedback
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        pad = [math.ceil(p.numel() / (8 * n)) * 8 * n for p in self.params]
        self.worker_err = [[torch.zeros(k) for _ in range(n)] for k in pad]
        self.server_err = [[torch.zeros(k // n) for _ in range(n)] for k in pad]

    @torch.no_grad()
    def step(self, worker_grads: list[list[torch.Tensor]]):
        self.t += 1
        b1, b2 = self.betas
        for i, (p, m, v) in enumerate(zip(self.params, self.m, self.v)):
            grads = [g[i] for g in worker_grads]
            if self.t <= self.freeze:
                g = sum(grads) / self.n
                m.copy_(b1 * m + (1 - b1) * g)
                v.copy_(b2 * v + (1 - b2) * g * g)
            else:
                local = [b1 * m + (1 - b1) * g for g in grads]
                if not self.feedback:
                    self.worker_err[i] = [torch.zeros_like(e) for e in self.worker_err[i]]
                    self.server_err[i] = [torch.zeros_like(e) for e in self.server_err[i]]
                # one worker exchanges nothing (DeepSpeed's `if self.size > 1`)
                m.copy_(one_bit_mean(local, self.worker_err[i], self.server_err[i]) if self.n > 1 else local[0])
                if self.masks[i] is not None:  # after the exchange, as DeepSpeed's OnebitAdam
                    m.mul_(self.masks[i])
            p.copy_(p - self.lr * (m / (v.sqrt() + self.eps) + self.wd * p))


def simulated_reference(case: Case, make_optimizer, n: int = N) -> dict[str, torch.Tensor]:
    """One process: each step, each of `n` workers' gradient on its rows, then the simulated optimizer."""
    model = make_model(case)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params)
    for step in range(case.steps):
        x, y = batch(case, step, n)
        worker_grads = []
        for r in range(n):
            rows = slice(r * MICRO, (r + 1) * MICRO)
            grads = torch.autograd.grad(loss_of(model, x[rows], y[rows]), params)
            worker_grads.append([g.detach() for g in grads])
        opt.step(worker_grads)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


ZO_EPS = 1e-2  # 0/1 Adam divides the exchanged 1-bit u by sqrt(v) + eps twice: a larger eps keeps it conditioned
ZO = {"type": "ZeroOneAdam", "params": {**ADAM, "eps": ZO_EPS, "var_freeze_step": 3, "var_update_scaler": 1,
                                        "local_step_scaler": 1, "local_step_clipper": 2}}
ZO_STEPS = 6  # full, full, 1-bit gradient; frozen: sync, a local step (ranks differ), sync


class SimulatedZeroOneAdam:
    """0/1 Adam (Lu et al. 2022, Algorithm 1 as DeepSpeed runs it) on N simulated workers, each
    with its own copy of the parameters (they differ between synchronisations)."""

    def __init__(self, workers, n=N, var_freeze_step=3, var_update_scaler=1, local_step_scaler=1,
                 local_step_clipper=2, lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ZO_EPS,
                 weight_decay=ADAM["weight_decay"], masks=None):
        self.p = workers  # [worker][tensor]
        self.masks = masks or [None] * len(workers[0])  # DeepSpeed's exp_avg_mask, per tensor
        self.n, self.t, self.interval, self.count, self.frozen_steps = n, 0, 1, 0, 0
        self.vfs, self.vus, self.lss, self.lsc = var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = [[torch.zeros_like(p) for p in w] for w in workers]
        self.u = [[torch.zeros_like(p) for p in w] for w in workers]
        self.v = [torch.zeros_like(p) for p in workers[0]]
        self.lrs = [0.0] * n
        self.local = 1
        self._errors()

    def _errors(self):
        pad = [math.ceil(p.numel() / (8 * self.n)) * 8 * self.n for p in self.p[0]]
        self.we = [[torch.zeros(k) for _ in range(self.n)] for k in pad]
        self.se = [[torch.zeros(k // self.n) for _ in range(self.n)] for k in pad]

    def _mask(self, i):
        return 1.0 if self.masks[i] is None else self.masks[i]

    @torch.no_grad()
    def step(self, worker_grads):
        self.t += 1
        (b1, b2), n, lr = self.betas, self.n, self.lr
        frozen = self.t > self.vfs
        if frozen and self.frozen_steps == 0:
            self._errors()
        full = not frozen and self.t % self.interval == 0
        for i, v in enumerate(self.v):
            grads = [g[i] for g in worker_grads]
            if full:
                g = sum(grads) / n
                v.copy_(b2 * v + (1 - b2) * g * g)
                grads = [g] * n
            elif not frozen:
                grads = [one_bit_mean(grads, self.we[i], self.se[i]) * self._mask(i)] * n
            den = v.sqrt() + self.eps
            for r in range(n):
                m, p = self.m[r][i], self.p[r][i]
                m.copy_(b1 * m + (1 - b1) * grads[r])
                update = m / den + self.wd * p
                p.copy_(p - lr * update)
                if frozen:
                    self.u[r][i].copy_(self.u[r][i] - lr * update)
            if frozen and self.t % self.local == 0:
                lrs = self.lrs[0] + lr
                for r in range(n):
                    self.p[r][i].copy_(self.p[r][i] - self.u[r][i])
                mean = one_bit_mean([self.u[r][i] * den for r in range(n)], self.we[i], self.se[i]) * self._mask(i)
                for r in range(n):
                    self.m[r][i].copy_(-mean / lrs)
                    self.p[r][i].copy_(self.p[r][i] + mean / den)
                    self.u[r][i].zero_()
        if frozen:
            synced = self.t % self.local == 0
            self.lrs = [0.0 if synced else x + lr for x in self.lrs]
            self.frozen_steps += 1
            if self.frozen_steps % self.lss == 0:
                self.local = min(self.lsc, self.local * 2)
        elif full:
            self.count += 1
            if self.count == self.vus:
                self.interval, self.count = self.interval * 2, 0


def zero_one_reference(steps: int, masks=None) -> list[dict[str, torch.Tensor]]:
    """Each worker's model after `steps` steps of the simulation."""
    case = Case(stage=0, steps=steps)
    models = [make_model(case) for _ in range(N)]
    params = [[p for p in model.parameters() if p.requires_grad] for model in models]
    opt = SimulatedZeroOneAdam(params, masks=masks)
    for step in range(steps):
        x, y = batch(case, step, N)
        grads = []
        for r, model in enumerate(models):
            rows = slice(r * MICRO, (r + 1) * MICRO)
            grads.append([g.detach() for g in torch.autograd.grad(loss_of(model, x[rows], y[rows]), params[r])])
        opt.step(grads)
    return [{k: v.detach().float().clone() for k, v in model.state_dict().items()} for model in models]


LAMB = {"type": "OneBitLamb", "params": {**ADAM, "freeze_step": FREEZE, "max_coeff": 10.0, "min_coeff": 0.01,
                                         "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                                         "factor_threshold": 0.1}}
ONE_BUCKET = (("reduce_bucket_size", 10**8),)  # 1-bit Lamb: one exchange, one scale, as DeepSpeed's flat momentum


def one_bit_mean_flat(values, worker_err, server_err):
    """DeepSpeed's compressed_allreduce of one flat tensor holding several (each padded to 8N):
    values[r][k] is worker r's tensor k; one scale per worker and per server chunk."""
    n = len(values)
    pads = [math.ceil(v.numel() / (8 * n)) * 8 * n for v in values[0]]
    flat = [torch.cat([torch.cat([v.reshape(-1), torch.zeros(p - v.numel())]).view(n, -1)
                       for v, p in zip(vs, pads)], dim=1) for vs in values]  # [r]: (n chunks, columns)
    sent = []
    for r, x in enumerate(flat):
        x = x + worker_err[r]
        scale = x.norm() / math.sqrt(x.numel())
        sign = torch.where(x >= 0, 1.0, -1.0)
        worker_err[r] = x - scale * sign
        sent.append((scale, sign))
    out = torch.zeros_like(flat[0])
    for j in range(n):
        y = sum(scale * sign[j] for scale, sign in sent) / n + server_err[j]
        scale = y.norm() / math.sqrt(y.numel())
        sign = torch.where(y >= 0, 1.0, -1.0)
        server_err[j] = y - scale * sign
        out[j] = scale * sign
    result, col = [], 0
    for v, p in zip(values[0], pads):
        result.append(out[:, col:col + p // n].reshape(-1)[:v.numel()].view_as(v))
        col += p // n
    return result


class SimulatedOneBitLamb:
    """1-bit Lamb (Li et al. 2021, Algorithm 1 as DeepSpeed runs it) on N simulated workers."""

    def __init__(self, params, n=N, freeze_step=FREEZE, lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ADAM["eps"],
                 weight_decay=ADAM["weight_decay"], max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0,
                 factor_min=0.5, factor_threshold=0.1):
        self.params, self.n, self.freeze, self.t = list(params), n, freeze_step, 0
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.hi, self.lo, self.cb, self.fmax, self.fmin, self.fth = (max_coeff, min_coeff, coeff_beta, factor_max,
                                                                      factor_min, factor_threshold)
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.fresh = [torch.zeros_like(p) for p in self.params]
        self.frozen_coeff = [0.0] * len(self.params)
        self.last_factor = [1.0] * len(self.params)
        self.scaling = None
        columns = sum(math.ceil(p.numel() / (8 * n)) * 8 for p in self.params)
        self.worker_err = [torch.zeros(n, columns) for _ in range(n)]
        self.server_err = [torch.zeros(columns) for _ in range(n)]

    @torch.no_grad()
    def step(self, worker_grads):
        self.t += 1
        b1, b2 = self.betas
        if self.t <= self.freeze:
            for k, (p, m, v) in enumerate(zip(self.params, self.m, self.v)):
                g = sum(w[k] for w in worker_grads) / self.n
                m.copy_(b1 * m + (1 - b1) * g)
                v.copy_(b2 * v + (1 - b2) * g * g)
                if self.t == self.freeze:
                    self.fresh[k].copy_(v)
                update = m / (v.sqrt() + self.eps) + self.wd * p
                w_norm, u_norm = p.norm().item(), update.norm().item()
                coeff = min(max(w_norm / u_norm, self.lo), self.hi) if w_norm and u_norm else 1.0
                if coeff != 1.0:
                    self.frozen_coeff[k] = self.cb * self.frozen_coeff[k] + (1 - self.cb) * coeff
                p.copy_(p - self.lr * coeff * update)
            return
        if self.scaling is None:
            rms = [m.norm().item() / math.sqrt(m.numel()) for m in self.m]
            self.scaling = [sum(rms) / len(rms) / r for r in rms]
        last = [m.clone() for m in self.m]
        local = [[s * (b1 * m + (1 - b1) * w[k]) for k, (m, s) in enumerate(zip(self.m, self.scaling))]
                 for w in worker_grads]
        mean = one_bit_mean_flat(local, self.worker_err, self.server_err)
        for k, p in enumerate(self.params):
            m, v, fresh = self.m[k], self.v[k], self.fresh[k]
            m.copy_(mean[k] / self.scaling[k])
            rebuilt = (m - last[k] * b1) / (1 - b1)
            fresh.copy_(b2 * fresh + (1 - b2) * rebuilt * rebuilt)
            denom = v.sqrt() + self.eps
            prelim = m / denom
            update = prelim + self.wd * p
            factor = (denom / (fresh.sqrt() + self.eps)).max().item()
            if self.wd:
                ratio = min(1.0, prelim.norm().item() / update.norm().item())
                factor = factor * ratio + (1 - ratio)
            factor = min(max(factor, self.fmin), self.fmax)
            factor = min(max(factor, self.last_factor[k] * (1 - self.fth)), self.last_factor[k] * (1 + self.fth))
            self.last_factor[k] = factor
            p.copy_(p - self.lr * self.frozen_coeff[k] * factor * update)
