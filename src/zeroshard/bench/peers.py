"""The systems `zeroshard bench` compares zeroshard with, each built as its users build it:
DDP, DDP + ZeroRedundancyOptimizer, FSDP2 (`fully_shard`) and DeepSpeed (optional, never a
zeroshard dependency); and the compute floor none of them can beat (`FloorRunner`). Their own
collectives are theirs; this module only builds them, steps them and counts the tensors they hold.

Every runner has the same surface: `step(x, y) -> loss` (forward, backward, optimizer step,
gradients cleared; `phases` then holds the three parts' seconds), `module`, `model_states()`
(bytes by category, counted from the real tensors after a backward and after a step, each
storage once; FSDP2's runner also samples its transients then) and `close()`. The builders
(`ddp`, `fsdp2`, `deepspeed_engine`) are also used by bench/gpu_check.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from torch import nn

from zeroshard.bench.results import WAITS
from zeroshard.bench.systems import BenchSystem

__all__ = ["AdamW", "FSDP2Runner", "FloorRunner", "PeerRunner", "TensorCount", "build_peer", "ddp", "deepspeed_engine",
           "floor_share", "fsdp2", "zero_redundancy"]


class AdamW:
    """The optimizer every system gets: torch AdamW with the fused CPU/CUDA kernel."""
    lr, betas, eps, weight_decay = 1e-4, (0.9, 0.999), 1e-8, 0.01

    @classmethod
    def kwargs(cls) -> dict[str, Any]:
        return dict(lr=cls.lr, betas=cls.betas, eps=cls.eps, weight_decay=cls.weight_decay)

    @classmethod
    def config(cls) -> dict[str, Any]:
        """The same optimizer as a DeepSpeed-style config entry."""
        return {"type": "AdamW", "params": {**cls.kwargs(), "betas": list(cls.betas)}}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The storage a rank really holds for `t`: a DTensor's local shard, DeepSpeed's stage-3 shard."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t


class TensorCount:
    """Bytes by category, each storage counted once (first category to claim it wins)."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes = {"params": 0, "grads": 0, "optimizer_states": 0}

    def add(self, category: str, t) -> None:
        if not torch.is_tensor(t):
            return
        t = _local(t)
        if t.numel() == 0:
            return
        storage = t.untyped_storage()
        if storage.data_ptr() in self._seen:
            return
        self._seen.add(storage.data_ptr())
        self.bytes[category] += storage.nbytes()

    def add_all(self, category: str, value) -> None:
        if torch.is_tensor(value):
            self.add(category, value)
        elif isinstance(value, (dict, list, tuple)):
            for v in value.values() if isinstance(value, dict) else value:
                self.add_all(category, v)


def _inner_optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding state: the object itself and what it wraps."""
    out, seen = [], set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        if isinstance(opt, torch.optim.Optimizer):
            out.append(opt)
        opt = getattr(opt, "optim", None) or getattr(opt, "optimizer", None)
    return out


def count_states(module: nn.Module, optimizer, internals: dict[str, Any] | None = None) -> dict[str, int]:
    """Parameters, gradients (`.grad` and the wrapper's gradient partitions in `internals`),
    optimizer states and fp32 masters (tensors of the optimizers' param groups that are not
    the module's parameters: counted as optimizer states, as zeroshard's ledger does)."""
    count = TensorCount()
    params = list(module.parameters())
    for p in params:
        count.add("params", p)
    for p in params:
        count.add("grads", p.grad)
    for name, value in (internals or {}).items():
        count.add_all("grads", value)
    for opt in _inner_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                count.add("grads", p.grad)
        for state in opt.state.values():
            count.add_all("optimizer_states", [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0])
        for group in opt.param_groups:
            for p in group["params"]:
                count.add("optimizer_states", p)
    return count.bytes


class PeerRunner:
    def __init__(self, module: nn.Module, wrapper, optimizer, autocast: bool) -> None:
        self.module, self.wrapper, self.optimizer = module, wrapper, optimizer
        self._autocast = autocast
        self.phases = (0.0, 0.0, 0.0)  # the last step's forward, backward, optimizer-step seconds

    def _context(self):
        if self._autocast:
            device = next(self.module.parameters()).device.type  # where the model runs, not what exists
            return torch.autocast(device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, x, y) -> torch.Tensor:
        with self._context():
            return self.wrapper(x, y)[1]

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _update(self) -> None:
        self.optimizer.step()

    def _clear_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, x, y) -> float:
        t0 = time.perf_counter()
        loss = self.forward(x, y)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self._update()
        self._clear_grads()
        self.phases = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return float(loss.detach().float())

    def internals(self) -> dict[str, Any]:
        return {}

    def model_states(self, x, y) -> dict[str, int]:
        """One untimed step: the larger of each category after backward and after the step."""
        self.backward(self.forward(x, y))
        after_backward = count_states(self.module, self.optimizer, self.internals())
        self._update()
        after_step = count_states(self.module, self.optimizer, self.internals())
        self._clear_grads()
        return {k: max(after_backward[k], after_step[k]) for k in after_backward}

    def close(self) -> None:
        pass


class FSDP2Runner(PeerRunner):
    """FSDP2 also holds transient model states: its unsharded parameters and gradients and the
    flat buffers of its collectives. `model_states` samples them during its untimed step
    (`bench.fsdp2_peak`) and leaves the figures in `peak`; the timed steps run without hooks."""

    peak: dict[str, Any] | None = None

    def model_states(self, x, y) -> dict[str, int]:
        from zeroshard.bench.fsdp2_peak import TransientSampler

        with TransientSampler(self.module) as sampler:
            at_rest = super().model_states(x, y)
        self.peak = sampler.figures(sum(at_rest.values()))
        return at_rest


def floor_share(module: nn.Module, rank: int, world: int) -> list[nn.Parameter]:
    """This rank's whole parameters of a balanced split of `module`'s by size (the largest first,
    each to the least loaded rank), as ../shared/bench-peers' floor splits them: ~1/N of the
    elements per rank, no tensor cut."""
    loads, mine = [0] * world, []
    for p in sorted(module.parameters(), key=lambda p: -p.numel()):
        r = loads.index(min(loads))
        loads[r] += p.numel()
        if r == rank:
            mine.append(p)
    return mine


class FloorRunner(PeerRunner):
    """The compute floor: the module itself (no wrapper, no hook, no collective), AdamW over this
    rank's `floor_share`, every gradient kept in place between steps (zeroed, not freed), as a
    flat gradient buffer keeps it. Its losses drift from the others' after the first step (each
    rank trains on its own rows and updates only its share): only its time and memory mean
    anything. `waits` is zero by construction: it never waits on a peer."""

    waits = dict.fromkeys(WAITS, 0.0)

    def _clear_grads(self) -> None:
        self.module.zero_grad(set_to_none=False)


class DeepSpeedRunner(PeerRunner):
    def forward(self, x, y) -> torch.Tensor:
        return self.wrapper(x, y)[1]

    def backward(self, loss: torch.Tensor) -> None:
        self.wrapper.backward(loss)

    def _update(self) -> None:
        self.wrapper.step()  # clears the gradients too

    def _clear_grads(self) -> None:
        pass

    def internals(self) -> dict[str, Any]:
        """DeepSpeed keeps reduced gradient partitions in its optimizer's attributes, not in `.grad`."""
        opt = self.wrapper.optimizer
        return {name: value for name, value in vars(opt).items()
                if "grad" in name.lower() and isinstance(value, (torch.Tensor, list, dict, tuple))}


def ddp(module: nn.Module, **ddp_kwargs):
    """torch DDP over `module` (the one place a benchmark builds it): its users' defaults plus
    `ddp_kwargs` (`zeroshard bench`: gradient_as_bucket_view=True)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, **ddp_kwargs)


def zero_redundancy(params, **adamw_kwargs):
    """torch ZeroRedundancyOptimizer over AdamW(fused) (DDP + ZeRO-1 as torch offers it)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, fused=True, **adamw_kwargs)


def fsdp2(module: nn.Module, unit_classes: list[str], bf16: bool):
    """FSDP2 as its users write it: `fully_shard` on each unit (modules of `unit_classes`), then the
    root; bf16: MixedPrecisionPolicy(param bf16, reduce fp32). Returns `module`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for m in module.modules():
        if type(m).__name__ in unit_classes:
            fully_shard(m, **kw)
    fully_shard(module, **kw)
    return module


def build_peer(system: BenchSystem, module: nn.Module, unit_classes: list[str], micro_batch: int,
               bf16: bool, device: torch.device) -> PeerRunner:
    """The peer `system` over `module` (already on every rank with the same weights)."""
    module.to(device)
    if system.family == "floor":
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        opt = torch.optim.AdamW(floor_share(module, rank, world), fused=True, **AdamW.kwargs())
        return FloorRunner(module, module, opt, autocast=bf16)
    if system.family in ("ddp", "zero1_torch"):
        wrapper = ddp(module, gradient_as_bucket_view=True)
        if system.family == "ddp":
            opt = torch.optim.AdamW(wrapper.parameters(), fused=True, **AdamW.kwargs())
        else:
            opt = zero_redundancy(wrapper.parameters(), **AdamW.kwargs())
        return PeerRunner(module, wrapper, opt, autocast=bf16)
    if system.family == "fsdp2":
        fsdp2(module, unit_classes, bf16)
        opt = torch.optim.AdamW(module.parameters(), fused=True, **AdamW.kwargs())
        return FSDP2Runner(module, module, opt, autocast=False)
    if system.family != "deepspeed":
        raise ValueError(f"{system.name}: not a peer system (family {system.family})")
    cfg = system.config(micro_batch, bf16={"enabled": bf16}, zero_allow_untested_optimizer=True,
                        wall_clock_breakdown=False)
    client = None
    if system.offload:  # DeepSpeed's own host kernel, as its offload users get
        cfg["optimizer"] = AdamW.config()
    else:  # the same fused torch kernel as every other system
        client = torch.optim.AdamW(module.parameters(), fused=True, **AdamW.kwargs())
    engine, opt = deepspeed_engine(module, cfg, client)
    return DeepSpeedRunner(engine.module, engine, opt, autocast=False)


def deepspeed_engine(module: nn.Module, config: dict[str, Any], client=None):
    """DeepSpeed's engine over `module` with `config` and an optional client optimizer; (engine,
    its optimizer). DeepSpeed's accelerator is the model's device unless DS_ACCELERATOR says."""
    on_cuda = next(module.parameters()).device.type == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                             optimizer=client, config=config, dist_init_required=False)
    return engine, opt

