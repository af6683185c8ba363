"""`zeroshard train --keep-last N` keeps only the newest N checkpoints (issue 29, item 4: a
300-step run with --save-every 1 wrote 300 of them, 37 GB), `latest` among them, and a bad
N is one line before launch."""

from __future__ import annotations

import os
import subprocess
import sys

from zeroshard.checkpoint.reader import CheckpointReader, resolve


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def test_keep_last_prunes_older_checkpoints(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "train", "--model", "tiny", "--steps", "5",
                           "--save", "ckpt", "--save-every", "1", "--keep-last", "2", "--report", ""],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tags = sorted(n for n in os.listdir(tmp_path / "ckpt") if not n.startswith(".") and n != "latest")
    assert tags == ["global_step4", "global_step5"], tags
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step5"
    CheckpointReader(resolve(str(tmp_path / "ckpt"))).verify()


def test_keep_last_needs_a_positive_count_and_a_save_dir(capsys, tmp_path, monkeypatch):
    from zeroshard.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "tiny", "--keep-last", "0", "--save", "c"]) == 2
    assert capsys.readouterr().err.strip() == "zeroshard train: --keep-last must be at least 1, got 0"
    assert main(["train", "--model", "tiny", "--keep-last", "3"]) == 2
    assert "give --save" in capsys.readouterr().err
