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
    # and schedule, a checkpoint at step 2, save_model at the end ...
    "trainer_stage3": ("trainer_gpt2.py", ["--stage", "3", "--zero3-load", "--save-steps", "2", "--save-model",
                                           "--steps", "4"], {}),
    # ... and a second launch resuming from that checkpoint ({trainer_stage3}: the first one's folder)
    "trainer_stage3_resume": ("trainer_gpt2.py", ["--stage", "3", "--zero3-load", "--steps", "4", "--resume",
                                                  "{trainer_stage3}/checkpoint-2"], {}),
    # Accelerate loop, stage 3 with zero3_init_flag, accumulation 2, AdamW + LambdaLR,
    # save_state / load_state, get_state_dict + unwrap_model
    "accelerate_stage3": ("accelerate_loop.py", ["--stage", "3", "--gas", "2", "--zero3-init"],
                          {"ACCELERATE_USE_DEEPSPEED": "true"}),
    # DeepSpeedExamples-style (cifar10_deepspeed.py): get_accelerator, moe.utils, stage 2
    "dse_stage2": ("dse_cifar_style.py", ["--stage", "2", "--epochs", "2"], {}),
}

# The TRL scripts at ZeRO-3 (`--zero3` is added to each): what `record_deepspeed.py --trl` runs
# under the real DeepSpeed (through ds_comm_first.py, with its flags: the third entry) and
# tests/test_trl_deepspeed.py compares with; the figures are in TRL_FIGURES.
TRL = {
    "sft": ("trl_sft.py", ["--steps", "3"], []),
    "dpo": ("trl_dpo.py", ["--steps", "4"], []),
    "dpo_sync": ("trl_dpo.py", ["--steps", "4", "--sync"], []),
    "grpo": ("trl_grpo.py", ["--steps", "2"], []),
    "grpo_per_forward": ("trl_grpo.py", ["--steps", "2", "--per-forward"], ["--no-prefetch"]),
    "grpo_beta": ("trl_grpo.py", ["--steps", "2", "--beta", "0.1"], []),
}
TRL_FIGURES = "tests/fixtures/trl_deepspeed/figures.json"  # relative to the repository

# Filled in from `python tests/hf_scripts/record_deepspeed.py` (DeepSpeed 0.19.8, CPU accelerator).
DEEPSPEED: dict = {'trainer_stage2': {'losses': [4.284703731536865, 4.288776397705078, 4.2880635261535645, 4.170248985290527],
                    'train_loss': 4.257948160171509,
                    'probe_loss': 4.278458595275879},
 'trainer_stage3': {'held_fraction': 0.5,
                    'loaded_probe_loss': 4.52341890335083,
                    'losses': [4.273123264312744, 4.2962846755981445, 4.258896827697754, 4.190123558044434],
                    'first_step': 1,
                    'train_loss': 4.254607081413269,
                    'probe_loss': 4.462550640106201},
 'trainer_stage3_resume': {'held_fraction': 0.5,
                           'loaded_probe_loss': 4.52341890335083,
                           'losses': [4.258896827697754, 4.190123558044434],
                           'first_step': 3,
                           'train_loss': 4.224510192871094,
                           'probe_loss': 4.462550640106201},
 'accelerate_stage3': {'held_fraction': 0.5,
                       'losses': [4.561191082000732,
                                  4.5884857177734375,
                                  4.5237627029418945,
                                  4.505003929138184,
                                  4.368874549865723,
                                  4.415909767150879],
                       'lrs': [0.001, 0.0006666666666666666, 0.0005],
                       'saved_probe': 4.3494553565979,
                       'moved_probe': 4.301072120666504,
                       'loaded_probe': 4.3494553565979},
 'dse_stage2': {'losses': [2.3393497467041016,
                           2.351255416870117,
                           2.326819896697998,
                           2.3407411575317383,
                           2.3094286918640137,
                           2.316941499710083,
                           2.32820725440979,
                           2.3256397247314453,
                           2.307297468185425,
                           2.307499408721924,
                           2.2773704528808594,
                           2.3012583255767822]}}
