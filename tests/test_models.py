"""Test models and synthetic data (zeroshard.models)."""

import math

import pytest
import torch

from zeroshard.models import (
    GPT_PRESETS,
    FrozenMLP,
    GPTConfig,
    batch_iterator,
    build_gpt,
    global_batch,
    num_parameters,
    synthetic_tokens,
)


def formula(cfg: GPTConfig) -> int:
    V, T, L, C = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd
    return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


@pytest.mark.parametrize(
    "preset, count",
    [("tiny", 28_032), ("mini", 834_304), ("small", 10_795_008), ("50m", 48_014_208)],
)
def test_preset_parameter_counts(preset, count):
    assert formula(GPT_PRESETS[preset]) == count
    if preset != "50m":  # building 50m is slow; the formula check covers it
        assert num_parameters(build_gpt(preset)) == count


def test_lm_head_tied_to_token_embedding():
    model = build_gpt("tiny")
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert num_parameters(model) == sum(p.numel() for p in model.parameters())


def test_init_is_deterministic_from_torch_rng():
    torch.manual_seed(3)
    a = build_gpt("tiny")
    torch.manual_seed(3)
    b = build_gpt("tiny")
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    std = a.h[0].attn.c_proj.weight.std().item()
    assert std < 0.02  # residual projections are scaled down


def test_forward_shapes_and_too_long_sequence():
    model = build_gpt("tiny")
    idx = torch.randint(0, 64, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 64) and loss is None
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tiny_gpt_loss_falls_on_synthetic_data():
    torch.manual_seed(0)
    model = build_gpt("tiny")
    tokens = synthetic_tokens(20_000, 64, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    losses = []
    for x, y in batch_iterator(tokens, batch_size=16, seq_len=16, steps=30):
        _, loss = model(x, y)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(64)) < 0.3
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_synthetic_tokens_deterministic_and_in_range():
    a = synthetic_tokens(1000, 50, seed=7)
    assert a.dtype == torch.long and a.shape == (1000,)
    assert torch.equal(a, synthetic_tokens(1000, 50, seed=7))
    assert not torch.equal(a, synthetic_tokens(1000, 50, seed=8))
    assert 0 <= a.min() and a.max() < 50


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slices_union_is_global_batch(world_size):
    tokens = synthetic_tokens(5000, 64, seed=0)
    b, steps = 3, 4
    per_rank = [
        list(batch_iterator(tokens, b, 8, rank=r, world_size=world_size, seed=5, steps=steps))
        for r in range(world_size)
    ]
    for k in range(steps):
        gx, gy = global_batch(tokens, b, 8, k, world_size=world_size, seed=5)
        assert gx.shape == (world_size * b, 8)
        assert torch.equal(torch.cat([per_rank[r][k][0] for r in range(world_size)]), gx)
        assert torch.equal(torch.cat([per_rank[r][k][1] for r in range(world_size)]), gy)
        assert torch.equal(gx[:, 1:], gy[:, :-1])  # targets are inputs shifted by one
    # One process with batch N*b sees exactly what the N ranks see.
    single = list(batch_iterator(tokens, world_size * b, 8, seed=5, steps=steps))
    for k in range(steps):
        assert torch.equal(single[k][0], global_batch(tokens, b, 8, k, world_size, seed=5)[0])


def test_frozen_mlp():
    model = FrozenMLP(frozen=(0, 2))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["layers.1.weight", "layers.1.bias", "layers.3.weight", "layers.3.bias"]
    x, y = torch.randn(5, 16), torch.randn(5, 8)
    out, loss = model(x, y)
    assert out.shape == (5, 8) and loss.ndim == 0
    loss.backward()
    assert model.layers[0].weight.grad is None and model.layers[1].weight.grad is not None
    assert model(x)[1] is None


def test_frozen_mlp_unused_parameter_gets_no_grad():
    model = FrozenMLP(with_unused=True)
    assert FrozenMLP().unused is None
    _, loss = model(torch.randn(2, 16), torch.randn(2, 8))
    loss.backward()
    assert model.unused.weight.requires_grad and model.unused.weight.grad is None
