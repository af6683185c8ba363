"""The test oracle of DESIGN.md section 9, shared by the stage tests.

For fp32, ZeRO stage k on N ranks with micro-batch b trains like one process with
batch N x b (x gradient-accumulation steps), step for step. `train_reference` is that
one process: plain torch, no zeroshard. `train_engine` is one rank under zeroshard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from zeroshard.models import FrozenMLP, build_gpt, global_batch, synthetic_tokens

SEQ, VOCAB, MICRO = 16, 64, 2
LRS = {"sgd": 0.05, "adamw": 2e-3}


@dataclass(frozen=True)
class Case:
    model: str = "gpt"  # "gpt" (tiny, tied embeddings) or "mlp" (frozen layers)
    stage: int = 0
    optimizer: str = "sgd"  # "sgd" (momentum 0.9) or "adamw"
    gas: int = 1
    clip: float = 0.0
    precision: str = "fp32"
    steps: int = 5
    zero: tuple[tuple[str, Any], ...] = ()  # extra zero_optimization keys

    def with_(self, **kw) -> "Case":
        return replace(self, **kw)


def hf_model(kind: str) -> torch.nn.Module:
    """Tiny transformers models built from a config: no download, dropout off."""
    import transformers as hf

    if kind == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return hf.LlamaForCausalLM(hf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def wide_hf_model(kind: str) -> torch.nn.Module:
    """The shapes of issue 9, where size-chosen units went wrong: GPT-2 n_embd 128 x 6 layers,
    Llama hidden 96 x 5 layers; and a Qwen2. Small vocabulary, dropout off."""
    import transformers as hf

    if kind == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(
            n_layer=6, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    cls, cfg = {"llama": (hf.LlamaForCausalLM, hf.LlamaConfig), "qwen2": (hf.Qwen2ForCausalLM, hf.Qwen2Config)}[kind]
    return cls(cfg(hidden_size=96, intermediate_size=192, num_hidden_layers=5, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                   eos_token_id=0, tie_word_embeddings=False))


def make_model(case: Case) -> torch.nn.Module:
    torch.manual_seed(1234)
    if case.model.startswith("wide-"):
        return wide_hf_model(case.model[5:])
    if case.model.startswith("hf-"):
        return hf_model(case.model[3:])
    if case.model == "gpt":
        return build_gpt("tiny")
    if case.model.startswith("gpt-"):
        import models3

        kind = case.model[4:]
        return {"ckpt-reentrant": lambda: models3.CheckpointedGPT(True),
                "ckpt-nonreentrant": lambda: models3.CheckpointedGPT(False),
                "skip": models3.SkippingGPT, "outside": models3.OutsideReadGPT,
                "reuse": models3.ReusedBlockGPT}[kind]()
    if case.model == "lora":
        import models3

        return models3.LoRAStack()
    return FrozenMLP(d_in=16, d_hidden=32, d_out=8, n_layers=4, frozen=(0, 2))


def batch(case: Case, micro_index: int, world_size: int):
    """The full (all ranks') micro-batch number `micro_index`."""
    if case.model.startswith(("gpt", "hf-", "wide-")):
        tokens = synthetic_tokens(4096, VOCAB, seed=7)
        return global_batch(tokens, MICRO, SEQ, micro_index, world_size, seed=3)
    g = torch.Generator().manual_seed(10_000 + micro_index)
    x = torch.randn(world_size * MICRO, 16, generator=g)
    return x, torch.tanh(x[:, :8] * 2.0) + 0.1 * torch.randn(world_size * MICRO, 8, generator=g)


def loss_of(model, x, y):
    inner = getattr(model, "module", model)
    if type(inner).__module__.startswith("transformers"):
        return model(input_ids=x, labels=y).loss
    return model(x, y)[1]


def optimizer_section(case: Case) -> dict[str, Any]:
    if case.optimizer == "sgd":
        return {"type": "SGD", "params": {"lr": LRS["sgd"], "momentum": 0.9}}
    return {"type": "AdamW", "params": {"lr": LRS["adamw"], "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}}


def torch_optimizer(case: Case, params):
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LRS["sgd"], momentum=0.9)
    return torch.optim.AdamW(params, lr=LRS["adamw"], betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def config_for(case: Case, world_size: int) -> dict[str, Any]:
    zero = {"stage": case.stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 2000, **dict(case.zero)}
    extra = {k: v for k, v in zero.items() if k.startswith("zeroshard.")}
    zero = {k: v for k, v in zero.items() if not k.startswith("zeroshard.")}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case.gas,
        "gradient_clipping": case.clip,
        "optimizer": optimizer_section(case),
        "zero_optimization": zero,
    }
    if case.stage == 3:  # gather units: the transformer blocks, unless the case says otherwise
        block = {"hf-gpt2": "GPT2Block", "hf-llama": "LlamaDecoderLayer", "lora": "LoRALinear"}.get(case.model, "Block")
        cfg["zeroshard"] = {"stage3_unit_classes": [block]}
    for key, value in extra.items():
        cfg.setdefault("zeroshard", {})[key.split(".", 1)[1]] = list(value) if isinstance(value, tuple) else value
    if case.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_reference(case: Case, world_size: int, make_optimizer=None) -> dict[str, torch.Tensor]:
    """`make_optimizer(params)`: the one-process optimizer, if not the case's torch one."""
    model = make_model(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (make_optimizer or (lambda params: torch_optimizer(case, params)))(trainable)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    for step in range(case.steps):
        for m in range(case.gas):
            x, y = batch(case, step * case.gas + m, world_size)
            (loss_of(model, x, y) / case.gas).backward()
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], case.clip)
        opt.step()
        # zeros, not None: a parameter unused in a step gets a zero gradient, as under DDP and
        # DeepSpeed, so momentum and Adam moments still move it
        opt.zero_grad(set_to_none=False)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train_engine(case: Case, rank: int, world_size: int, config: dict | None = None):
    import zeroshard

    engine = zeroshard.initialize(make_model(case), config or config_for(case, world_size))
    return engine, run_steps(engine, case, rank, world_size)


def run_steps(engine, case: Case, rank: int, world_size: int, after_step=None) -> list[float]:
    """`case.steps` optimizer steps of `engine` on rank `rank`'s rows; the micro-step losses.
    `after_step(step)` runs after each optimizer step."""
    losses = []
    for step in range(case.steps):
        for m in range(case.gas):
            x, y = batch(case, step * case.gas + m, world_size)
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = loss_of(engine, x[lo:hi], y[lo:hi])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def paper_units(comm: dict) -> int:
    """Volume in the ZeRO paper's units from `engine.comm_stats()`: an all-reduce counts twice."""
    from zeroshard.comm import PAPER_FACTOR

    return sum(PAPER_FACTOR[op] * stats["elements"] for op, stats in comm.items())


def sgd_close(got: dict, ref: dict, tol: float = 1e-5) -> list[str]:
    """Names whose max difference exceeds `tol` x the tensor's largest entry."""
    bad = []
    for name, r in ref.items():
        scale = r.abs().max().item() or 1.0
        if (got[name] - r).abs().max().item() > tol * scale:
            bad.append(f"{name}: {(got[name] - r).abs().max().item():.3g} > {tol * scale:.3g}")
    return bad


def adam_fraction_off(got: dict, ref: dict, rel: float = 1e-3) -> float:
    """Fraction of all entries that differ by more than `rel` relative (the 2% rule)."""
    off = total = 0
    for name, r in ref.items():
        g = got[name]
        off += ((g - r).abs() > rel * r.abs() + 1e-12).sum().item()
        total += r.numel()
    return off / total


def assert_matches(case: Case, got: dict, ref: dict) -> None:
    assert set(got) == set(ref), f"state dict keys differ: {set(got) ^ set(ref)}"
    if case.optimizer == "sgd":
        bad = sgd_close(got, ref)
        assert not bad, f"{case}: SGD parameters differ beyond 1e-5 of their largest entry: {bad[:5]}"
    else:
        frac = adam_fraction_off(got, ref)
        assert frac <= 0.02, f"{case}: {frac:.2%} of AdamW entries differ by > 1e-3 relative (limit 2%)"
