"""Stage 3's linear (stages/zero_linear.py, `memory_efficient_linear`): a released unit's
gathered weights are really freed after its forward (torch's linear saves a view of the
weight, which kept every unit's full buffer alive until backward), and training is unchanged:
bias or not, 3-D inputs, keyword calls, a frozen weight, and a weight one block shares with
another equal one process's torch run, with the option on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks

WORLD = 2
WIDTH = 1024  # a unit's weight: 4 MiB in fp32
UNITS = 12
MiB = 2**20


class Block(nn.Module):
    def __init__(self, bias: bool = True, frozen: bool = False, shared: "Block | None" = None) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, bias=bias)
        self.lin.weight.requires_grad_(not frozen)
        self.shared = [shared] if shared is not None else []  # not a submodule: its weight is another unit's

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        if self.shared:  # a keyword call on a weight of another unit (ALBERT-style sharing)
            x = x + 0.5 * F.linear(input=x, weight=self.shared[0].lin.weight, bias=None)
        return x


class Net(nn.Module):
    def __init__(self, units: int = UNITS) -> None:
        super().__init__()
        blocks = [Block(bias=i % 2 == 0, frozen=i == 3) for i in range(units)]
        blocks[-1].shared = [blocks[1]]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).sum(-1).mean()


def _config(efficient: bool | None, live_cap: int | None = None) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0}
    if live_cap is not None:
        zero["stage3_max_live_parameters"] = live_cap
    if efficient is not None:
        zero["memory_efficient_linear"] = efficient
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_optimization": zero,
            "zeroshard": {"stage3_unit_classes": ["Block"]}}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(2 * WORLD, 3, WIDTH, generator=torch.Generator().manual_seed(step))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _forward_growth(rank, world, efficient):
    """RSS growth over each forward (MiB). Large blocks are mmap'd, so a freed one leaves RSS.
    No buffer pool: a pooled buffer stays resident whether a saved view holds it or not."""
    import ctypes

    import zeroshard
    from zeroshard.partition import buffer_pool

    buffer_pool.MIN_BYTES = 1 << 62
    torch.manual_seed(0)
    engine = zeroshard.initialize(Net(), _config(efficient))
    # after the engine, which fixes glibc's thresholds for its own heap trimming (malloc_trim.py)
    ctypes.CDLL("libc.so.6").mallopt(-3, MiB)  # M_MMAP_THRESHOLD: a full buffer is its own mapping
    growth = []
    for step in range(3):
        x = _batch(step)[rank * 2:(rank + 1) * 2]
        before = _rss_mib()
        loss = engine(x)
        growth.append(_rss_mib() - before)
        engine.backward(loss)
        engine.step()
    engine.close()
    return growth


def test_forward_frees_each_released_unit():
    """Activations of one forward are ~0.1 MiB; each unit's full weight is 4 MiB. Saved views
    (the option off: torch's own linear) hold all 12 units; stage 3's linear holds none. The
    first forward is left out: it also makes the buffers that later steps reuse."""
    unit_mib = WIDTH * WIDTH * 4 / MiB
    on, off = (run_ranks(_forward_growth, WORLD, flag, timeout=300) for flag in (None, False))
    for rank in range(WORLD):
        assert max(on[rank][1:]) < 2 * unit_mib, f"rank {rank}: forward grew {on[rank]} MiB with stage 3's linear"
        assert min(off[rank][1:]) > (UNITS - 2) * unit_mib, f"rank {rank}: torch's linear grew only {off[rank]} MiB"


def _train(rank, world, efficient, live_cap):
    import zeroshard

    torch.manual_seed(0)
    engine = zeroshard.initialize(Net(), _config(efficient, live_cap))
    losses = []
    for step in range(3):
        loss = engine(_batch(step)[rank * 2:(rank + 1) * 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    return losses, state


# a cap of 1.5 units: gathering one unit in backward releases another whose backward may not have
# run yet (the shared weight's reader); stage 3's linear then gathers the weight again
@pytest.mark.parametrize("efficient, live_cap", [(True, None), (False, None), (True, 3 * WIDTH * WIDTH // 2)],
                         ids=["on", "off", "on-live-cap"])
def test_training_equals_one_process(efficient, live_cap):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    losses = []
    for step in range(3):
        x = _batch(step)
        loss = sum(model(x[r * 2:(r + 1) * 2]) for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref = model.state_dict()
    torch.manual_seed(0)
    moved = max((ref[k] - v).abs().max().item() for k, v in Net().state_dict().items())
    assert moved > 1e-3, f"the reference barely trains ({moved}): the comparison would prove nothing"
    ranks = run_ranks(_train, WORLD, efficient, live_cap, timeout=300)
    got = [sum(r[0][step] for r in ranks) / WORLD for step in range(3)]
    assert got == pytest.approx(losses, rel=1e-5)
    for _, state in ranks:
        for name, value in ref.items():
            assert torch.allclose(state[name], value, atol=1e-5, rtol=0), f"{name} off by {(state[name] - value).abs().max()}"
        assert torch.equal(state["blocks.3.lin.weight"], ref["blocks.3.lin.weight"])  # frozen
