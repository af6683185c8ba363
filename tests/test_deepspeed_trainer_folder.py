"""A Hugging Face Trainer's `checkpoint-N/` of a DeepSpeed run (issue 27) holds DeepSpeed's
folder (`latest`, `global_stepN/`) beside the Trainer's own files: trainer_state.json,
training_args.bin, rng_state_R.pth, model weights. zeroshard reads it as the DeepSpeed folder it
is and opens none of the Trainer's pickles: a planted `__reduce__` in training_args.bin never
runs."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from test_deepspeed_migration import FIX, _Planted, common, record

pytestmark = pytest.mark.recorded  # compares with what DeepSpeed computed on another machine

def _trainer_folder(tmp_path, case: str, marker: str) -> str:
    folder = tmp_path / f"checkpoint-{common.K}"
    shutil.copytree(os.path.join(FIX, case), folder)
    (folder / "trainer_state.json").write_text('{"global_step": %d}' % common.K)
    (folder / "config.json").write_text("{}")
    torch.save({"args": _Planted(marker)}, folder / "training_args.bin")  # the Trainer's pickle: never opened
    torch.save({"python": _Planted(marker)}, folder / "rng_state_0.pth")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return str(folder)


def test_a_trainer_checkpoint_folder_loads_and_runs_nothing(tmp_path):
    from zeroshard.checkpoint.deepspeed_reader import open_deepspeed
    from zeroshard.cli.main import main

    marker = str(tmp_path / "ran")
    folder = _trainer_folder(tmp_path, "stage2_bf16", marker)
    rec = record("stage2_bf16")
    with open_deepspeed(folder) as r:
        assert r.meta["global_steps"] == rec["global_steps_at_save"] and r.meta["stage"] == 2
        for name, e in rec["saved"].items():
            assert torch.equal(r.read(name).float().flatten(), torch.tensor(e["value"])), name
    assert main(["inspect", folder]) == 0
    assert main(["export", folder, str(tmp_path / "out.safetensors")]) == 0
    assert not os.path.exists(marker)
