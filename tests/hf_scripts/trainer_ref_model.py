"""transformers.Trainer with a frozen reference model, the way TRL's DPOTrainer drives one.

An ordinary Hugging Face script: it imports nothing of zeroshard. With `--zero3` the Trainer
runs under a ZeRO-3 DeepSpeed config and the reference model is prepared as TRL's
`prepare_deepspeed` does (`deepspeed.initialize(model=ref, config=<the trainer's config>)`,
no optimizer; TRL's extra dotted `zero_optimization.*` keys are left out: this config names
every size itself). Without it, plain DDP (the reference model whole on each rank). Each step:
a DPO loss (chosen = the sequence, rejected = it reversed, beta 0.1) against the reference;
every 2 steps greedy generation as TRL's `unwrap_model_for_generation` does at ZeRO-3
(GatheredParameters over the policy, its hooks removed through
`engine.optimizer.parameter_offload` and added back); every 3 steps TRL's ref-model sync
(GatheredParameters over policy + reference, modifier_rank=0, alpha 0.5). Rank 0 prints one
`RESULT {json}` line: the logged losses and the generated tokens.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TokenDataset, gpt2_config, report  # noqa: E402

PROMPT = [[3, 7, 11, 15]]


def ds_config() -> dict:
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 4096,
                                  "stage3_param_persistence_threshold": 0}}


def seq_logp(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1).sum(-1)


def zero3(accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero3", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

    targs = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, max_steps=args.steps, learning_rate=1e-3,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
        deepspeed=ds_config() if args.zero3 else None, use_cpu=not torch.cuda.is_available())
    set_seed(0)
    policy = GPT2LMHeadModel(gpt2_config())
    ref = GPT2LMHeadModel(gpt2_config())
    ref.load_state_dict(policy.state_dict())
    tokens: list[list[int]] = []

    class RefTrainer(Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.ref = self._prepare_ref(ref)

        def _prepare_ref(self, model):
            if not zero3(self.accelerator):
                return model.to(self.args.device).eval()
            import copy

            import deepspeed

            config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.eval()
            return engine

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            chosen = inputs["input_ids"]
            rejected = chosen.flip(1)
            both = torch.cat([chosen, rejected])
            logp = seq_logp(model, both)
            with torch.no_grad():
                ref_logp = seq_logp(self.ref, both)
            n = len(chosen)
            margin = (logp[:n] - ref_logp[:n]) - (logp[n:] - ref_logp[n:])
            return -F.logsigmoid(0.1 * margin).mean()

    class Hooks(TrainerCallback):
        def on_step_end(self, targs_, state, control, **kw):
            step = state.global_step
            if step % 2 == 0:
                tokens.append(generate(trainer))
            if step % 3 == 0:
                sync_ref(trainer)

    trainer = RefTrainer(model=policy, args=targs, train_dataset=TokenDataset(), callbacks=[Hooks()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        report(losses=losses, tokens=tokens)


def generate(trainer) -> list[int]:
    model = trainer.model_wrapped
    unwrapped = trainer.accelerator.unwrap_model(model)
    prompt = torch.tensor(PROMPT, device=trainer.args.device)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    if not zero3(trainer.accelerator):
        return unwrapped.generate(prompt, **kwargs)[0].tolist()
    import deepspeed

    with deepspeed.zero.GatheredParameters(model.parameters()):
        offload = model.optimizer.parameter_offload
        for _, param in itertools.chain(offload.module.named_parameters(), offload.module.ds_external_parameters()):
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        out = unwrapped.generate(prompt, **kwargs)[0].tolist()
        if not offload.param_coordinator.is_invalid_trace():
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    return out


def sync_ref(trainer, alpha: float = 0.5) -> None:
    policy, ref = trainer.accelerator.unwrap_model(trainer.model_wrapped), trainer.accelerator.unwrap_model(trainer.ref)

    def mix():
        with torch.no_grad():
            for t, s in zip(ref.parameters(), policy.parameters()):
                t.data.mul_(1.0 - alpha).add_(s.data, alpha=alpha)

    if not zero3(trainer.accelerator):
        mix()
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(policy.parameters()) + list(ref.parameters()), modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            mix()


if __name__ == "__main__":
    main()
