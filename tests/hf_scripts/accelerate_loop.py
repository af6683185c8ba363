"""An Accelerate training loop with a DeepSpeedPlugin, a torch AdamW and a LambdaLR.

An ordinary Accelerate script: it imports nothing of zeroshard. Run it on DeepSpeed or on
zeroshard (`zeroshard launch --nproc 2 accelerate_loop.py --out DIR`); the test compares.
It trains with gradient accumulation (Accelerate announces the boundary and calls
`engine.step()` only there), and with `zero3_init_flag` builds the model with
`from_pretrained` under ZeRO-3 (zero.Init). Then: `save_state`, one more step,
`load_state` (the probe loss must come back to the saved one), and `get_state_dict` +
`unwrap_model(...).save_pretrained` (OUT/final). Rank 0 prints one `RESULT {json}` line.
Launch it as `accelerate launch --use_deepspeed` would: with ACCELERATE_USE_DEEPSPEED=true.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TokenDataset, gpt2_config, probe_batch, report  # noqa: E402


MICRO = 4


def probe(model) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(model(**probe_batch()).loss)
    model.train()
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=6)
    p.add_argument("--zero3-init", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--compile-regions", metavar="BACKEND", help="Accelerate's regional compilation "
                   "(TorchDynamoPlugin(use_regional_compilation=True)) with this backend")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, set_seed
    from transformers import GPT2LMHeadModel

    # Accelerate counts one process per rank without CUDA (its num_processes is 1 on CPU), so
    # the script states the batch sizes and shards the data itself, as a torchrun script does
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_batch_size": MICRO * args.gas * world, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": args.gas, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True}}
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=args.zero3_init)
    dynamo = {}
    if args.compile_regions:
        from accelerate.utils import TorchDynamoPlugin

        dynamo["dynamo_plugin"] = TorchDynamoPlugin(backend=args.compile_regions, use_regional_compilation=True)
    accelerator = Accelerator(deepspeed_plugin=plugin, **dynamo)
    set_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    extra: dict = {}
    if args.zero3_init:  # save the seeded model, then load it back the ZeRO-3 way
        init_dir = os.path.join(args.out, "init")
        if rank == 0:
            model.save_pretrained(init_dir)
        accelerator.wait_for_everyone()
        model = GPT2LMHeadModel.from_pretrained(init_dir)
        held = sum(q.ds_tensor.numel() if hasattr(q, "ds_tensor") else q.numel() for q in model.parameters())
        extra["held_fraction"] = held / sum(q.numel() for q in GPT2LMHeadModel(gpt2_config()).parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    data = TokenDataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, lrs = [], []
    batches = iter(loader)
    for _ in range(args.micro_batches):
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        if accelerator.sync_gradients:
            lrs.append(scheduler.get_last_lr()[0])
    extra["losses"], extra["lrs"] = losses, lrs

    state_dir = os.path.join(args.out, "state")
    accelerator.save_state(state_dir)
    extra["saved_probe"] = probe(model)
    for _ in range(args.gas):  # one more optimizer step moves the weights
        batch = next(batches)
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
    extra["moved_probe"] = probe(model)
    accelerator.load_state(state_dir)
    extra["loaded_probe"] = probe(model)

    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    extra["unwrapped"] = type(unwrapped).__name__
    extra["compiled_blocks"] = sum(m._compiled_call_impl is not None for m in unwrapped.modules())
    if rank == 0:
        unwrapped.save_pretrained(os.path.join(args.out, "final"), state_dict=state_dict)
    accelerator.wait_for_everyone()
    if rank == 0:
        report(**extra)


if __name__ == "__main__":
    main()
