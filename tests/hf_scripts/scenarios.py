"""The runs tests/test_hf_*.py make, and the figures DeepSpeed 0.19.8 gave for the same runs.

`record_deepspeed.py` runs each scenario with the real DeepSpeed (CPU accelerator) and
prints the `DEEPSPEED` table below; the tests run the same scenarios on zeroshard and
compare. Each entry: script, its arguments, extra environment.
"""

SCENARIOS = {
    # Trainer, stage 2, optimizer offloaded to the host, accumulation 2, the config's own
    # optimizer and scheduler sections ("auto" values), save_model at the end
    "trainer_stage2": ("trainer_gpt2.py", ["--stage", "2", "--offload", "--gas", "2", "--ds-optimizer",
                                           "--save-model", "--steps", "4"], {}),
    # Trainer, stage 3: model loaded with from_pretrained under zero.Init, Trainer's own AdamW
    # and schedule, a checkpoint at step 2 resumed by a second Trainer, save_model at the end
    "trainer_stage3": ("trainer_gpt2.py", ["--stage", "3", "--zero3-load", "--resume-at", "2", "--save-model",
                                           "--steps", "4"], {}),
    # Accelerate loop, stage 3 with zero3_init_flag, accumulation 2, AdamW + LambdaLR,
    # save_state / load_state, get_state_dict + unwrap_model
    "accelerate_stage3": ("accelerate_loop.py", ["--stage", "3", "--gas", "2", "--zero3-init"],
                          {"ACCELERATE_USE_DEEPSPEED": "true"}),
    # DeepSpeedExamples-style (cifar10_deepspeed.py): get_accelerator, moe.utils, stage 2
    "dse_stage2": ("dse_cifar_style.py", ["--stage", "2", "--epochs", "2"], {}),
}

# Filled in from `python tests/hf_scripts/record_deepspeed.py` (DeepSpeed 0.19.8, CPU accelerator).
DEEPSPEED: dict = {}
