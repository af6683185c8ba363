"""End to end: `zeroshard train` through the CLI, as a user runs it; and the errors a new user
hits, each one line on stderr with exit code 2 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroshard.cli.main import main


def _run(*args, cwd=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _losses(out: str) -> tuple[float, float]:
    line = next(line for line in out.splitlines() if "(first " in line)
    first, last = (float(part.split()[0]) for part in line.split("│")[2].split("->"))
    return first, last


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default job (embedded stage-3 config, 2 ranks, stdlib corpus) on the tiny preset."""
    from zeroshard.cli.train.config import default_config

    cwd = tmp_path_factory.mktemp("train")
    config = {**default_config(50, 8, ["Block"]), "steps_per_print": 25}
    (cwd / "ds.json").write_text(json.dumps(config))
    return cwd, _run("--model", "tiny", "--seq-len", "16", "--steps", "50", "--config", "ds.json", cwd=cwd)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The default stage 3 with a step line every 10 steps, a checkpoint every 10 steps, --verbose."""
    from zeroshard.cli.train.config import default_config

    cwd = tmp_path_factory.mktemp("save")
    (cwd / "ds.json").write_text(json.dumps({**default_config(20, 8, ["Block"]), "steps_per_print": 10}))
    return cwd, _run("--model", "tiny", "--seq-len", "16", "--steps", "20", "--save", "ckpt", "--config", "ds.json",
                     "--save-every", "10", "--report", "", "--verbose", cwd=cwd)


def test_default_job_trains_stage3_on_two_ranks_and_the_loss_falls(default_run):
    cwd, proc = default_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "zeroshard train: summary" in out
    assert "3 / 2 (gloo)" in out
    assert "3.000 x Phi (paper units) vs plain DP 2.000 x Phi" in out  # stage 3: 3 Phi, no reuse
    assert "(0.50x)" in out  # fp32 stage 3 on 2 ranks: half of every model state
    first, last = _losses(out)
    assert last < first - 0.2, (first, last)
    assert "Traceback" not in proc.stderr
    # rank 0's seconds blocked in collectives' waits, from the comm ledger: stage 3 on 2 ranks
    # waits for some of its gathers and reductions every step
    row = next(line for line in out.splitlines() if "exposed communication" in line)
    per_step = float(row.split("exposed communication")[1].split("ms/step")[0].strip(" │"))
    assert 0 < per_step < 1000, row


def test_the_summary_says_how_much_communication_was_exposed():
    from zeroshard.cli.train.report import RunRecord, _exposed

    rec = RunRecord(label="m", stage=2, world=2, backend="gloo", phi=1, trainable=1, itemsize=4, seconds=8.0,
                    steps_run=4, waited=0.5)
    assert _exposed(rec) == "125.0 ms/step, 6.2 % of the steps (rank 0's waits)"
    rec.host_waits = False
    assert _exposed(rec).startswith("not measured: NCCL")


def _startup_block(proc) -> list[str]:
    """The engine's start-up lines (stderr, rank 0) and the command's checkpoints line (stdout)."""
    err = proc.stderr.splitlines()
    start = next(i for i, line in enumerate(err) if line.startswith("zeroshard: ZeRO stage"))
    block = [err[start]]
    for line in err[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block + [line for line in proc.stdout.splitlines() if line.startswith("  checkpoints: ")]


def test_the_console_fits_a_terminal(default_run):
    """Issue 45: the start-up block is at most 6 lines, each line at most 100 columns, and says
    where checkpoints go; the step line every steps_per_print steps fits 100 columns too."""
    _, proc = default_run
    block = _startup_block(proc)
    assert len(block) <= 6 and all(len(line) <= 100 for line in block), block
    assert "ZeRO stage 3 on 2 rank(s)" in block[0] and any("batch 16 = micro 8" in line for line in block)
    assert any("memory per rank: params" in line and "KiB" in line for line in block), block  # not "0.0 MB"
    assert block[-1].startswith("  checkpoints: none (--save DIR")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ") and "x Phi" in line]
    assert [line.split()[1] for line in lines] == ["25/50", "50/50"]  # rank 0 only, every 25 steps
    for line in lines:
        assert len(line) <= 100 and "| 3.000 x Phi, " in line and " KiB/rank |" in line, line


def test_verbose_shows_every_setting_and_each_ranks_memory(saved_run):
    """--verbose: the whole start-up block (buckets, units, host memory) and, under each step
    line, every rank's memory and the step's collectives."""
    _, proc = saved_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    block = _startup_block(proc)
    assert len(block) > 6 and any(line.startswith("  stage 3 units:") for line in block)
    assert block[-1] == "  checkpoints: ckpt, every 10 steps and at the end"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("  per rank: ")]
    assert len(lines) == 2, proc.stdout[-2000:]
    for line in lines:
        assert " r0 params " in line and " r1 params " in line and "optim" in line
        assert "reduce_scatter" in line and "all_gather" in line


def test_report_png_is_written(default_run):
    cwd, proc = default_run
    report = cwd / "zeroshard_train_report.png"
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.stat().st_size > 10_000


def test_save_writes_periodic_checkpoints_and_resume_continues(saved_run):
    cwd, proc = saved_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (cwd / "ckpt" / "latest").read_text().strip() == "global_step20"
    assert (cwd / "ckpt" / "global_step10").is_dir()
    assert not (cwd / "zeroshard_train_report.png").exists()  # --report '': none
    proc = _run("--model", "tiny", "--seq-len", "16", "--steps", "25", "--save", "ckpt",
                "--resume", "--report", "", cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed at step 20" in proc.stdout
    assert "s for 5 steps" in proc.stdout  # only the remaining steps ran
    assert (cwd / "ckpt" / "latest").read_text().strip() == "global_step25"
    first, last = _losses(proc.stdout)  # the summary covers the saved steps' losses too
    assert last < first


# -- errors a new user hits: one line, exit code 2, no traceback ------------------------------

def _error(capsys, *argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("zeroshard train: "), err
    return err


def test_too_many_ranks(capsys):
    assert "--nproc 10000" in _error(capsys, "--nproc", "10000")


def test_config_that_does_not_parse_names_line_and_column(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 2,}\n}')
    proc = _run("--config", str(bad), "--nproc", "1")  # through the real entry point: no traceback
    assert proc.returncode == 2
    assert "line 2, column 36" in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_data_with_no_text(capsys, tmp_path):
    (tmp_path / "img.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.txt").write_text("")
    err = _error(capsys, "--data", str(tmp_path))
    assert "--data" in err and "0 bytes of UTF-8 text" in err
    assert "no such file" in _error(capsys, "--data", str(tmp_path / "missing"))


def test_model_config_that_is_not_a_causal_lm(capsys, tmp_path):
    pytest.importorskip("transformers")
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64}))
    assert "not a causal LM" in _error(capsys, "--model", f"hf:{bert}")
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps({"model_type": "t5"}))
    assert "not a causal LM" in _error(capsys, "--model", f"hf:{t5}")
    assert "no such config" in _error(capsys, "--model", f"hf:{tmp_path / 'nope.json'}")
    assert "unknown" in _error(capsys, "--model", "gpt-huge")


def test_other_argument_errors(capsys, tmp_path):
    assert "context" in _error(capsys, "--model", "tiny", "--seq-len", "64")
    assert "--save" in _error(capsys, "--resume")
    assert "no checkpoint" in _error(capsys, "--resume", "--save", str(tmp_path))


def test_cli_help_lists_every_command():
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "--help"], capture_output=True, text=True)
    for cmd in ("train", "launch", "estimate", "plan"):
        assert cmd in proc.stdout


def test_train_options_are_frozen():
    """The CLI surface users script against: adding is fine, renaming breaks them."""
    import argparse

    from zeroshard.cli.train.command import register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    options = {o for a in sub.choices["train"]._actions for o in a.option_strings}
    assert options == {"-h", "--help", "--config", "--model", "--data", "--stage", "--steps", "--seq-len",
                       "--micro-batch", "--lora", "--bf16", "--save", "--save-every", "--resume", "--report",
                       "--seed", "--offload", "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                       "--max-restarts", "--reload-checkpoints", "--resource-log", "--nvme-path", "--keep-last",
                       "--verbose", "--tensorboard", "--csv", "--wandb", "--rdzv-id", "--rdzv-conf", "--compile"}
