"""`zeroshard launch` reads the script's DeepSpeed config before any rank starts (issue 45):
a bad `--deepspeed_config` / `--deepspeed_config_file` / Trainer `--deepspeed x.json` is one
line on stderr, exit 2, in under 2 s, and the script never runs; a config whose only problem
is its batch arithmetic (scripts set batch sizes in code) is left to the ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from zeroshard.cli.launch_config import config_path, config_problem

SCRIPT = "import pathlib; pathlib.Path('ran').write_text('yes')\n"


@pytest.mark.parametrize("args, want", [
    (["--deepspeed", "--deepspeed_config", "a.json"], "a.json"),
    (["--deepspeed_config=b.json", "--lr", "1"], "b.json"),
    (["--deepspeed_config_file", "c.json"], "c.json"),
    (["--deepspeed", "ds.json", "--output_dir", "o"], "ds.json"),  # Trainer's
    (["--deepspeed", "--local_rank", "0"], None),  # DeepSpeed's bare on/off flag
    (["--lr", "1"], None),
])
def test_the_config_is_found_where_scripts_take_it(args, want):
    assert config_path(args) == want


def test_batch_arithmetic_is_left_to_the_script(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 7, "zero_optimization": {"stage": 2}}))
    assert config_problem(["--deepspeed_config", str(path)], 2) is None  # 7 on 2 ranks: the script may fix it
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2, "bogus": 1}}))
    assert "unknown key 'bogus' in zero_optimization" in config_problem(["--deepspeed_config", str(path)], 2)


@pytest.mark.parametrize("text, words", [
    ('{"train_micro_batch_size_per_gpu": 2,\n "zero_optimization": {"stage": 3, "bogus_key": 1}}',
     "unknown key 'bogus_key' in zero_optimization"),
    ('{"train_batch_size": 8,\n "zero_optimization": {"stage": 2},}', "invalid JSON at line 2"),
    (None, "no such config file"),
])
def test_a_bad_config_is_one_line_before_any_rank(tmp_path, text, words):
    (tmp_path / "train.py").write_text(SCRIPT)
    if text is not None:
        (tmp_path / "ds.json").write_text(text)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc", "2", "train.py",
                           "--deepspeed", "--deepspeed_config", "ds.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    seconds = time.monotonic() - started
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("zeroshard launch: ds.json: ") and words in proc.stderr
    assert not (tmp_path / "ran").exists()  # no rank started
    assert seconds < 2.0, seconds
