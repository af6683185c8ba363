"""A Trainer script with a frozen reference model driven as TRL's DPOTrainer drives it
(tests/hf_scripts/trainer_ref_model.py): ZeRO-3 under `zeroshard launch --nproc 2` (reference
engine without optimizer, ref-model sync through GatheredParameters over both engines,
generation with the stage-3 hooks removed and added back) equals the same script under plain
DDP, loss for loss and token for token. The DDP figures were recorded once with
`zeroshard launch --nproc 2 trainer_ref_model.py --out DIR` (no DeepSpeed config: Trainer runs
DDP); the slow test runs DDP again and checks the record.
"""

from __future__ import annotations

import pytest

from hf_launch import launch

pytestmark = [pytest.mark.timeout(600), pytest.mark.recorded]  # DDP figures recorded on another machine
SCRIPT = "trainer_ref_model.py"
# plain DDP, 2 ranks x 4 sequences, 6 steps; syncs after steps 3 and 6, generations after 2, 4, 6
DDP = {"losses": [0.6931471824645996, 0.6632634997367859, 0.6591520309448242, 0.6325629949569702,
                  0.618130087852478, 0.5933661460876465],
       "tokens": [[3, 7, 11, 15, 15, 15, 15, 15, 28], [3, 7, 11, 15, 15, 15, 15, 30, 30],
                  [3, 7, 11, 15, 15, 15, 15, 81, 35]]}
REL = 1e-4


def _same(got: dict, want: dict) -> None:
    assert len(got["losses"]) == len(want["losses"]), got
    assert all(abs(a - b) <= REL * abs(b) for a, b in zip(got["losses"], want["losses"])), (got, want)
    assert got["tokens"] == want["tokens"], (got, want)


def test_reference_model_script_at_zero3_equals_ddp(tmp_path):
    result, output = launch(SCRIPT, ["--zero3", "--out", str(tmp_path / "out")], cwd=tmp_path, timeout=500)
    assert "zeroshard serves `import deepspeed` in this run" in output
    _same(result, DDP)


@pytest.mark.slow  # a second launch (~40 s): the recorded DDP figures still hold
def test_recorded_ddp_figures(tmp_path):
    result, _ = launch(SCRIPT, ["--out", str(tmp_path / "out")], cwd=tmp_path, timeout=500)
    _same(result, DDP)
