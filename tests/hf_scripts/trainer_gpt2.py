"""transformers.Trainer with a DeepSpeed config of "auto" values, on a tiny GPT-2.

An ordinary Hugging Face script: it imports nothing of zeroshard. Run it with DeepSpeed
(`deepspeed --num_gpus 2 trainer_gpt2.py ...`) or on zeroshard
(`zeroshard launch --nproc 2 trainer_gpt2.py ...`); tests/test_hf_trainer.py compares the
two. Rank 0 prints one `RESULT {json}` line: the logged losses, and the loss of the
trained model on a fixed batch.

  --stage 2|3, --offload (offload_optimizer: cpu), --gas N, --ds-optimizer (the config's
  own optimizer and scheduler sections instead of Trainer's), --save-model (save_model to
  OUT/final), --zero3-load (save the seeded model to OUT/init, then build it with
  from_pretrained after TrainingArguments: under ZeRO-3 the zero.Init loading path, each
  rank holding only its shards), --save-steps N (a checkpoint every N steps),
  --resume DIR (resume_from_checkpoint=DIR; the losses reported are those after it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TokenDataset, gpt2_config, probe_batch, report  # noqa: E402


def ds_config(args) -> dict:
    zero = {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": True}
    if args.stage != 3:
        zero = {k: v for k, v in zero.items() if not k.startswith("stage3")}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
              "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    if args.ds_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                    "warmup_num_steps": "auto",
                                                                    "total_num_steps": "auto"}}
    return config


def held_fraction(model) -> float:
    """Elements of the model's parameters this rank holds, over the model's size."""
    import torch.distributed as dist

    from transformers import GPT2LMHeadModel

    full = sum(p.numel() for p in GPT2LMHeadModel(gpt2_config()).parameters())
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    t = torch.tensor([float(held)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) / full


def probe_loss(model) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(**probe_batch()).loss)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-model", action="store_true")
    p.add_argument("--ds-optimizer", action="store_true")
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--zero3-load", action="store_true")
    p.add_argument("--time-steps", action="store_true", help="report each optimizer step's wall time (bench/)")
    p.add_argument("--width", type=int, default=64, help="n_embd of the GPT-2 (bench/ uses larger)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--compile", metavar="BACKEND", help="torch_compile=True with this torch_compile_backend")
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = p.parse_args()

    from transformers import Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=args.gas,
        max_steps=args.steps, learning_rate=2e-3, warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, deepspeed=ds_config(args),
        use_cpu=not torch.cuda.is_available(),
        **({"torch_compile": True, "torch_compile_backend": args.compile} if args.compile else {}))
    extra: dict = {}
    model = build_model(args, extra)
    timer = step_timer(args.time_steps)  # counts the steps this run takes (a resumed run logs earlier ones too)
    trainer = Trainer(model=model, args=targs, train_dataset=TokenDataset(), callbacks=[timer])
    result = trainer.train(resume_from_checkpoint=args.resume)
    if args.time_steps:
        extra["step_seconds"], extra["other_cores"] = timer.seconds, timer.other_cores
    extra["losses"] = logged_losses(trainer)[-len(timer.seconds):] if timer.seconds else []
    extra["first_step"] = trainer.state.global_step - len(timer.seconds) + 1
    extra["train_loss"] = result.training_loss
    extra["probe_loss"] = probe_loss(trainer.model_wrapped)
    extra["compiled"] = bool(getattr(trainer.model_wrapped, "is_compiled", False))
    if args.save_model:
        trainer.save_model(os.path.join(args.out, "final"))
    if trainer.is_world_process_zero():
        report(**extra)


def build_model(args, extra: dict):
    from transformers import GPT2LMHeadModel, set_seed

    import deepspeed
    import torch.distributed as dist

    set_seed(0)
    model = GPT2LMHeadModel(gpt2_config(args.width, args.layers))  # whole: a constructor call is not under zero.Init
    if not args.zero3_load:
        return model
    deepspeed.init_distributed()  # before zero.Init, as DeepSpeed needs on a machine without CUDA
    init_dir = os.path.join(args.out, "init")
    if dist.get_rank() == 0 and not os.path.isdir(init_dir):
        model.save_pretrained(init_dir)
    dist.barrier()
    model = GPT2LMHeadModel.from_pretrained(init_dir)  # under ZeRO-3: zero.Init, shards only
    extra["held_fraction"] = held_fraction(model)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        extra["loaded_probe_loss"] = probe_loss(model)
    model.train()
    return model


def step_timer(measure_load: bool):
    """A callback keeping each optimizer step's wall time (first micro-batch to the step's end)
    and how many CPU cores other programs used meanwhile: the machine's busy time (/proc/stat)
    less both ranks' own CPU time, summed over the ranks after the step's clock stopped."""
    import time

    import torch.distributed as dist
    from transformers import TrainerCallback

    def busy_seconds() -> float:
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.other_cores: list[float] = []
            self._start = self._cpu = self._busy = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._busy, self._cpu, self._start = busy_seconds(), time.process_time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - self._start
            cpu, busy = time.process_time() - self._cpu, busy_seconds() - self._busy
            self.seconds.append(wall)
            if not measure_load:
                return
            mine = torch.tensor([cpu])
            if dist.is_initialized():
                dist.all_reduce(mine)
            self.other_cores.append(max(0.0, busy - float(mine)) / wall)

    return StepTimer()


def logged_losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


if __name__ == "__main__":
    main()
