"""FSDP2's transient model states and collectives, sampled during one untimed step.

At rest FSDP2 holds sharded parameters, sharded gradients and optimizer states (what
`peers.count_states` counts). While a step runs it also holds each group's unsharded
parameters (from its all-gather until it reshards), unsharded gradients (until their
reduce-scatter) and the flat all-gather output / reduce-scatter input of each collective.
`TransientSampler` samples the bytes of those at every module's forward entry and exit, after
every unsharded gradient is accumulated, and at every collective call, and counts the
collectives' elements (the torch.distributed functions FSDP2 calls are wrapped while the
sampler is open, and restored after). Its peak, added to the at-rest bytes, is FSDP2's peak
model states as `zeroshard bench` reports it: an upper bound of the simultaneous peak, since
the at-rest gradients are counted throughout. zeroshard's own peak comes from its ledger.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["COLLECTIVES", "TransientSampler"]

# the torch.distributed functions FSDP2 calls: (the tensor whose elements a call moves, paper factor)
COLLECTIVES = {
    "all_gather_single": (lambda output_tensor, *a, **kw: output_tensor, 1),
    "reduce_scatter_single": (lambda *a, **kw: kw["input"] if "input" in kw else a[1], 1),
    "all_reduce": (lambda tensor, *a, **kw: tensor, 2),
}


def _fsdp_params(module: nn.Module) -> list:
    """Every FSDPParam of the module tree (one per original parameter)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.modules() if hasattr(m, "_get_fsdp_state")]
    return [fp for group in groups if group is not None for fp in group.fsdp_params]


class TransientSampler:
    """A context manager: hooks and collective wrappers installed on entry, removed on exit."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.fsdp_params = _fsdp_params(module)
        self.peak = {"params": 0, "grads": 0, "sum": 0}
        self.counts: dict[str, list[int]] = {}  # name -> [calls, elements]
        self._handles: list = []
        self._originals: dict[str, Any] = {}

    def _live(self) -> tuple[int, int]:
        pbytes = gbytes = 0
        seen = set()
        for fp in self.fsdp_params:
            up = getattr(fp, "_unsharded_param", None)
            if up is None:
                continue
            st = up.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                pbytes += st.nbytes()
            if up.grad is not None:
                gbytes += up.grad.untyped_storage().nbytes()
        return pbytes, gbytes

    def sample(self, *_: Any, flat_params: int = 0, flat_grads: int = 0) -> None:
        p, g = self._live()
        p, g = p + flat_params, g + flat_grads
        self.peak["params"], self.peak["grads"] = max(self.peak["params"], p), max(self.peak["grads"], g)
        self.peak["sum"] = max(self.peak["sum"], p + g)

    def _wrap(self, name: str) -> None:
        fn, buffer_of = getattr(dist, name), COLLECTIVES[name][0]
        self._originals[name] = fn

        def counted(*a, **kw):
            buf = buffer_of(*a, **kw)
            c = self.counts.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += buf.numel()
            nbytes = buf.numel() * buf.element_size()  # coexists with the unsharded tensors at the call
            self.sample(**{"flat_grads" if name == "reduce_scatter_single" else "flat_params": nbytes})
            return fn(*a, **kw)

        setattr(dist, name, counted)

    def __enter__(self) -> "TransientSampler":
        for m in self.module.modules():
            self._handles.append(m.register_forward_pre_hook(lambda mod, a: self.sample()))
            self._handles.append(m.register_forward_hook(lambda mod, a, o: self.sample()))
        for fp in self.fsdp_params:  # the unsharded Parameters exist after the first forward
            up = getattr(fp, "_unsharded_param", None)
            if up is not None:
                self._handles.append(up.register_post_accumulate_grad_hook(self.sample))
        for name in COLLECTIVES:
            self._wrap(name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        for h in self._handles:
            h.remove()

    def figures(self, at_rest: int) -> dict[str, Any]:
        """The step's peak model states (at rest + the sampled transient peak) and its collectives."""
        return {"peak_model_states": at_rest + self.peak["sum"], "unsharded_params": self.peak["params"],
                "unsharded_grads": self.peak["grads"], "unsharded_sum": self.peak["sum"],
                "collectives": {n: {"calls": c[0], "elements": c[1]} for n, c in self.counts.items()},
                "paper_elements": sum(COLLECTIVES[n][1] * c[1] for n, c in self.counts.items())}
