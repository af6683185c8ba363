"""A policy-gradient loop written with OpenRLHF's DeepSpeed calls (openrlhf/utils/deepspeed/,
openrlhf/trainer/ray/ppo_actor.py, read at 3c3be62), for a tiny Llama built from a config.

An ordinary DeepSpeed script: it imports nothing of zeroshard. Under `zeroshard launch` at
ZeRO-3 (configs as OpenRLHF's get_train_ds_config / get_eval_ds_config write them, AdamW from
the config with its two weight-decay groups, a scheduler factory, gradient clipping) it runs
- a policy engine, a reference engine and an EMA engine (no optimizer, parameters offloaded);
- each iteration: `broadcast_to_vllm` (per parameter: the full shape from `ds_shape` read
  before `GatheredParameters([param])`, rank 0's values broadcast into a plain copy, the
  "inference engine"), a rollout (old log-probs from that copy, reference log-probs from the
  reference engine under no_grad), `reload_deepspeed_states`, micro-steps of a clipped
  policy-gradient loss with a k3 KL to the reference (accumulated over 2 micro-batches per
  rank), OpenRLHF's `moving_average` after each micro-step, `offload_deepspeed_states`;
- `moving_average` gathers only `[p for p in (param, ema) if hasattr(p, "ds_id") and
  p.ds_status == ZeroParamStatus.NOT_AVAILABLE]`. OpenRLHF's main passes no modifier_rank, so
  DeepSpeed drops the update (OpenRLHF PR #1357 adds modifier_rank=0): the EMA engine takes the
  fixed form, a second one ("released") OpenRLHF's form as it stands.
With `--plain`: the same loop in one process without DeepSpeed (torch AdamW, the EMA over the
full parameters) at the same global batch. Rank 0 prints one `RESULT {json}` line and saves
the final EMA (and the released-form EMA) to `--out`.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report  # noqa: E402
from trl_common import WORDS, llama  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MICRO = len(WORDS) + 4, 12, 8, 2
LR, MAX_NORM, BETA_EMA, KL, CLIP, WARMUP = 2e-3, 1.0, 0.8, 0.1, 0.2, 0.0  # OpenRLHF's warmup: 0.03


# -- OpenRLHF's config writers (deepspeed_utils.py), as written --------------------------------
def train_ds_config(stage: int, optim: dict) -> dict:
    zero = {"stage": stage, "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none", "pin_memory": True}, "sub_group_size": "auto",
            "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto", "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
            "zero_quantized_gradients": False, "reduce_scatter": True}
    return {"steps_per_print": 100, "zero_optimization": zero, "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "gradient_clipping": MAX_NORM, "prescale_gradients": False, "wall_clock_breakdown": False,
            "data_types": {"grad_accum_dtype": None}, "checkpoint": {"load_universal": False},
            "compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1}, "optimizer": optim,
            "train_micro_batch_size_per_gpu": MICRO, "train_batch_size": GLOBAL_BATCH}


def eval_ds_config(stage: int, offload: bool) -> dict:
    zero = {"stage": stage, "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
            "offload_param": {"device": "cpu" if offload else "none", "pin_memory": True}}
    return {"steps_per_print": 100, "zero_optimization": zero, "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
            "compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1},
            "train_micro_batch_size_per_gpu": MICRO, "train_batch_size": GLOBAL_BATCH}


def tiny(config: dict) -> dict:
    """A model this small would be kept whole under DeepSpeed's default persistence threshold
    (1e5 elements): every parameter sharded, small buckets, so each gather is real."""
    zero = config["zero_optimization"]
    zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2048)
    if "reduce_bucket_size" in zero:
        zero["reduce_bucket_size"] = 2048
    return config


def grouped_parameters(model, weight_decay: float = 0.01,
                       no_decay=("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]


def scheduler_factory(steps: int):
    from transformers.trainer import get_scheduler

    return partial(get_scheduler, "cosine_with_min_lr", num_warmup_steps=math.ceil(steps * WARMUP),
                   num_training_steps=steps, scheduler_specific_kwargs={"min_lr_rate": 0.1})


# -- OpenRLHF's state offload, EMA and weight broadcast -----------------------------------------
def offload_deepspeed_states(model) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    if model.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu":
        return
    assert model.zero_optimization_stage() == 3
    types = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
             OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads]
    model.optimizer.offload_states(include=types, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
    model.empty_partition_cache()
    torch.distributed.barrier()


def reload_deepspeed_states(model) -> None:
    if model.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu":
        return
    model.reload_states(non_blocking=True)
    torch.distributed.barrier()


def moving_average(model, model_ema, beta: float, zero3: bool, modifier_rank: int | None) -> None:
    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), model_ema.parameters()):
            if not param.requires_grad:
                continue
            if not zero3:
                param_ema.data.copy_((1 - beta) * param.data + beta * param_ema.data)
                continue
            import deepspeed
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            fetch = [p for p in [param, param_ema]  # _z3_params_to_fetch
                     if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            with deepspeed.zero.GatheredParameters(fetch, enabled=len(fetch) > 0, modifier_rank=modifier_rank):
                param_ema.data.copy_((1 - beta) * param.data + beta * param_ema.data)


def broadcast_to_vllm(policy, vllm, zero3: bool) -> None:
    """ppo_actor.broadcast_to_vllm: per parameter, the receiver's buffer is made from the full
    shape (`ds_shape` at ZeRO-3, read before the gather) and rank 0 broadcasts the gathered values."""
    if not zero3:
        vllm.load_state_dict(policy.state_dict())
        return
    import deepspeed

    named = list(policy.module.named_parameters())
    shapes = [tuple(p.ds_shape) for _, p in named]
    targets = dict(vllm.named_parameters())
    for (name, param), shape in zip(named, shapes):
        buffer = torch.empty(shape, dtype=param.dtype)
        with deepspeed.zero.GatheredParameters([param], enabled=True):
            if torch.distributed.get_rank() == 0:
                buffer.copy_(param.data.view(shape))
            torch.distributed.broadcast(buffer, src=0)
        targets[name].data.copy_(buffer)


# -- the algorithm --------------------------------------------------------------------------
def sequences() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(4, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    seqs = 4 + (start + stride * torch.arange(SEQ) - 4) % (VOCAB - 4)
    rewards = (seqs[:, 1:] % 3 == 0).float().mean(1)
    return seqs, rewards - 0.2  # a fixed baseline: advantages of both signs, a loss away from 0


def token_logp(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1)


def policy_loss(logp, old_logp, ref_logp, adv) -> torch.Tensor:
    ratio = (logp - old_logp).exp()
    pg = -torch.min(ratio * adv[:, None], ratio.clamp(1 - CLIP, 1 + CLIP) * adv[:, None])
    log_ratio = ref_logp - logp
    return (pg + KL * (log_ratio.exp() - 1 - log_ratio)).mean()


def build(zero3: bool, steps: int):
    torch.manual_seed(0)
    policy = llama(0)
    ref, ema, released, vllm = (copy.deepcopy(policy) for _ in range(4))
    groups = grouped_parameters(policy)
    adam = {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    if not zero3:
        opt = torch.optim.AdamW(groups, **{**adam, "betas": tuple(adam["betas"])})
        return policy, opt, scheduler_factory(steps)(opt), ref.eval(), ema, None, vllm.eval()
    import deepspeed

    local = {"local_rank": int(os.environ.get("LOCAL_RANK", "-1"))}
    engine, opt, _, sched = deepspeed.initialize(
        model=policy, optimizer=None, model_parameters=groups, lr_scheduler=scheduler_factory(steps),
        config=tiny(train_ds_config(3, {"type": "AdamW", "params": adam})), args=local, dist_init_required=True)
    evals = [deepspeed.initialize(model=m, args=local, config=tiny(eval_ds_config(3, offload)),
                                  dist_init_required=True)[0]
             for m, offload in ((ref, False), (ema, True), (released, True))]
    for e in evals:
        e.eval()
    return engine, opt, sched, *evals, vllm.eval()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    zero3 = not args.plain
    if zero3:
        import deepspeed

        deepspeed.init_distributed()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if zero3 else (0, 1)
    accumulated = GLOBAL_BATCH // MICRO // world
    policy, opt, sched, ref, ema, released, vllm = build(zero3, args.steps)
    init = None if zero3 else {n: p.detach().clone() for n, p in ema.named_parameters()}
    if zero3:  # the initial offload of OpenRLHF's enable_sleep, before the optimizer has states
        offload_deepspeed_states(policy)
    seqs, adv = sequences()
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    seqs, adv = seqs[rows], adv[rows]
    ema_calls, losses, norms, lrs = 0, [], [], []
    for _ in range(args.steps):
        broadcast_to_vllm(policy, vllm, zero3)
        with torch.no_grad():  # the rollout: log-probs of the inference copy and of the reference
            old_logp, ref_logp = token_logp(vllm, seqs), token_logp(ref, seqs)
        if zero3:
            reload_deepspeed_states(policy)
        step_loss = torch.zeros(())
        for m in range(accumulated):
            mb = slice(m * MICRO, (m + 1) * MICRO)
            loss = policy_loss(token_logp(policy, seqs[mb]), old_logp[mb], ref_logp[mb], adv[mb])
            if zero3:
                policy.backward(loss)
                policy.step()
            else:
                (loss / accumulated).backward()
            step_loss += loss.detach() / accumulated
            ema_calls += 1
            if ema_calls % accumulated == 0:
                if not zero3:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_NORM)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                else:
                    norms.append(float(policy.get_global_grad_norm()))
                moving_average(policy, ema, BETA_EMA, zero3, 0)  # the engines, as OpenRLHF's Actor passes them
                if zero3:
                    moving_average(policy, released, BETA_EMA, zero3, None)
        if zero3:
            torch.distributed.all_reduce(step_loss)
            step_loss /= world
            offload_deepspeed_states(policy)
        losses.append(float(step_loss))
        lrs.append(sched.get_last_lr()[0])
    save(args.out, ema, released, init, rank)
    if rank == 0:
        report(losses=losses, grad_norms=norms, lrs=lrs, zero3=zero3)


def save(out: str, ema, released, init: dict | None, rank: int) -> None:
    """The final EMA's full parameters on rank 0, by name; with them, at ZeRO-3 the released-form
    EMA's, in one process the initial weights."""
    if init is not None:
        torch.save({"ema": {n: p.detach().clone() for n, p in ema.named_parameters()}, "init": init}, out)
        return
    import deepspeed

    saved = {}
    for key, engine in (("ema", ema), ("released", released)):
        named = list(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            saved[key] = {n: p.detach().clone() for n, p in named}
    if rank == 0:
        torch.save(saved, out)


if __name__ == "__main__":
    main()
