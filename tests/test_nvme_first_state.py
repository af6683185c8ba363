"""A sub-group's first step on the NVMe tier starts torch's Adam / AdamW from zeroed states in
its swap buffer (optim.first_state.first_state_in) instead of letting torch allocate them: the
3.15B demo's first step spent its gap faulting in 25 GB of fresh zeros (issue 24). The
state must be the one torch would have created: the step that follows equals a plain
optimizer's bit for bit, for every option that changes the state torch makes."""

from __future__ import annotations

import pytest
import torch

from zeroshard.optim.first_state import first_state_in


@pytest.mark.parametrize("cls, options", [
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.AdamW, {"foreach": False}),
    (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.Adam, {"weight_decay": 0.1, "maximize": True, "fused": True}),
])
def test_first_state_in_the_buffer_steps_like_torchs_own(cls, options):
    g = torch.Generator().manual_seed(0)
    values, grads = torch.randn(1000, generator=g), [torch.randn(1000, generator=g) for _ in range(3)]
    mine, ref = values.clone(), values.clone()
    opt_mine, opt_ref = cls([mine], lr=1e-2, **options), cls([ref], lr=1e-2, **options)
    buffer = torch.full((3 * 1000,), float("nan"))  # a swap buffer holding another sub-group's values
    views = [buffer[1000:2000], buffer[2000:3000]]
    assert first_state_in(opt_mine, mine, views if not options.get("amsgrad") else
                          [buffer[1000:2000], buffer[2000:3000], torch.full((1000,), float("nan"))])
    state = opt_mine.state[mine]
    assert state["exp_avg"].data_ptr() == views[0].data_ptr()  # in the buffer, not a new allocation
    assert state["exp_avg_sq"].data_ptr() == views[1].data_ptr()
    for grad in grads:
        mine.grad, ref.grad = grad.clone(), grad.clone()
        opt_mine.step(), opt_ref.step()
    assert torch.equal(mine, ref)
    for name, value in opt_ref.state[ref].items():
        got = opt_mine.state[mine][name]
        assert got.dtype == value.dtype and got.device == value.device and torch.equal(got, value), name


def test_other_optimizers_and_later_steps_keep_torchs_own_state():
    p = torch.zeros(10)
    views = [torch.empty(10), torch.empty(10)]
    assert not first_state_in(torch.optim.SGD([p], lr=0.1, momentum=0.9), p, views)  # momentum = first gradient
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(10)
    opt.step()
    assert not first_state_in(opt, p, views)  # a state exists: it is the one the buffer gets
