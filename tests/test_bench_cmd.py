"""`zeroshard bench`: one real, short run on the 10M preset (DDP and zeroshard stages 0-3, 2 gloo
ranks, 1 warm-up + 2 measured steps), then its JSON checked against the ledgers and the ZeRO
table: communication per step 2/2/2/3 Phi as the comm ledger counts it, bytes sent by the ring
formula, memory categories and tiers summing, model states at rest = the formula, ratios =
the medians' ratios, losses agreeing with DDP. Bad input fails before any rank starts.
No timings are asserted.

The five-system run is marked `slow` (`python -m pytest -m slow`); the default run checks the
same things on a run of DDP, stage 1 and stage 3 (three torchrun jobs, the same 10M preset)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from zeroshard.bench import plot as bench_plot, systems as bench_systems
from zeroshard.bench.report import write_outputs
from zeroshard.bench.results import formula_bytes, stage_phi
from zeroshard.cli.main import main
from zeroshard.comm import PAPER_FACTOR, ring_sent_bytes

# five torchrun jobs: ~1 min on 2 idle cores, several on a shared machine (the fixture's setup counts)
pytestmark = pytest.mark.timeout(900)

SYSTEMS = ["ddp", "zs0", "zs1", "zs2", "zs3"]  # the long form
SHORT_SYSTEMS = ["ddp", "zs1", "zs3"]  # the default run's
STEPS, WARMUP, MICRO, SEQ = 2, 1, 1, 32


@pytest.fixture(scope="module", params=[SHORT_SYSTEMS, pytest.param(SYSTEMS, marks=pytest.mark.slow)],
                ids=["short", "long"])
def bench(request, tmp_path_factory):
    systems = request.param
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "bench", "--model", "10M", "--systems", ",".join(systems),
           "--steps", str(STEPS), "--warmup", str(WARMUP), "--micro-batch", str(MICRO), "--seq-len", str(SEQ),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "bench.json") as fh:
        result = json.load(fh)
    return proc.stdout, result, out, systems


def _run(bench):
    return bench[1]["runs"]["10m"]


def _stages(bench) -> list[int]:
    """The zeroshard stages in this form's run: [1, 3] (short) or [0, 1, 2, 3] (long)."""
    return [int(name[2:]) for name in bench[3] if name.startswith("zs")]


def test_runs_every_system_with_a_progress_line_and_a_table(bench):
    stdout, result, out, systems = bench
    run = _run(bench)
    assert list(run["rows"]) == systems and not run["failed"]
    for i, name in enumerate(systems, 1):
        assert f"[{i}/{len(systems)}] 10m {name}: running" in stdout
    assert "zeroshard bench: 10m (Phi = 10,795,008)" in stdout
    assert "where a step goes: 10m, the slowest rank of each step" in stdout  # the breakdown of each system's step
    assert (out / "bench.png").stat().st_size > 0
    assert run["phi"] == 10_795_008
    for row in run["rows"].values():
        assert len(row["step_time_s"]["steps"]) == STEPS
        assert len(row["peak_rss_mib"]) == 2 and all(m > 100 for m in row["peak_rss_mib"])
        assert row["tokens_per_step"] == 2 * MICRO * SEQ


def test_communication_per_step_is_2_2_2_3_phi_as_the_ledger_counts_it(bench):
    run = _run(bench)
    for k in _stages(bench):
        row = run["rows"][f"zs{k}"]
        led = row["ledger"]
        paper = sum(PAPER_FACTOR[op] * s["elements"] for op, s in led["comm_per_step"].items())
        assert led["paper_elements_per_step"] == pytest.approx(paper)
        assert led["phi_per_step"] == pytest.approx(paper / run["phi"])
        # the 1-element global-norm all-reduce and bucket padding are all that may differ
        assert led["phi_per_step"] == pytest.approx(stage_phi(k), abs=1e-3), (k, led["comm_per_step"])
        sent = sum(s["sent_bytes"] for s in led["comm_per_step"].values())
        assert led["sent_bytes_per_step"] == pytest.approx(sent)
        for op, s in led["comm_per_step"].items():  # fp32 on 2 ranks: the ring formula per call
            per_call = ring_sent_bytes(op, int(round(s["bytes"] / s["calls"])), 2)
            assert s["sent_bytes"] == pytest.approx(per_call * s["calls"], rel=1e-6)
    ops = {k: set(run["rows"][f"zs{k}"]["ledger"]["comm_per_step"]) for k in _stages(bench)}
    if 0 in ops:
        assert "reduce_scatter" not in ops[0]
    assert {"reduce_scatter", "all_gather"} <= ops[1]
    rep = {a["question"][:12]: a for a in _run(bench)["report"]}
    comm = next(a for a in rep.values() if "phi_per_step" in str(a["figures"]))
    assert comm["figures"]["zs1"]["phi_per_step"] == run["rows"]["zs1"]["ledger"]["phi_per_step"]


def test_memory_categories_sum_and_match_the_formula(bench):
    run = _run(bench)
    for k in _stages(bench):
        row = run["rows"][f"zs{k}"]
        for mem in row["ledger"]["memory"]:
            states = mem["params"] + mem["grads"] + mem["optimizer_states"]
            assert mem["model_states"] == states
            assert mem["tier_device"] + mem["tier_host"] + mem["tier_nvme"] == states + mem["comm_buffers"]
            assert mem["peak_model_states"] >= states
        formula = formula_bytes(k, run["phi"], row["ledger"]["trainable"], 2, bf16=False)
        at_rest = row["ledger"]["memory"][0]
        for cat in ("params", "grads", "optimizer_states"):
            assert at_rest[cat] == pytest.approx(formula[cat], rel=0.01), (k, cat)
        assert row["model_states"][0] == {c: at_rest[c] for c in ("params", "grads", "optimizer_states")}
    ddp = run["rows"]["ddp"]["model_states"][0]  # counted from DDP's real tensors: 4 + 4 + 8 bytes per parameter
    assert ddp["params"] == pytest.approx(4 * run["phi"], rel=0.01)
    assert ddp["optimizer_states"] == pytest.approx(8 * run["phi"], rel=0.01)
    report = next(a for a in run["report"] if "formula_bytes" in str(a["figures"]))
    for zs in (f"zs{k}" for k in _stages(bench)):  # every stage of the run has its figures
        assert report["figures"][zs]["ratio"] == pytest.approx(
            run["rows"][zs]["ledger"]["memory"][0]["model_states"] / report["figures"][zs]["formula_bytes"])


def test_ratios_are_the_medians_ratios_and_losses_agree_with_ddp(bench):
    run = _run(bench)
    med = {n: statistics.median(r["step_time_s"]["steps"]) for n, r in run["rows"].items()}
    for name, row in run["rows"].items():
        assert row["step_time_s"]["median"] == pytest.approx(med[name])
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / med[name])
    for k in _stages(bench):
        assert run["ratios"][f"zs{k}/ddp"] == pytest.approx(med[f"zs{k}"] / med["ddp"])
    ref = run["rows"]["ddp"]["losses"]
    for k in _stages(bench):
        losses = run["rows"][f"zs{k}"]["losses"]
        assert len(losses) == WARMUP + STEPS
        assert losses[0] == pytest.approx(ref[0], abs=1e-5)  # same weights, same batch
        assert run["loss_max_abs_diff_vs_ddp"][f"zs{k}"] == pytest.approx(max(abs(a - b) for a, b in zip(losses, ref)))
        assert run["loss_max_abs_diff_vs_ddp"][f"zs{k}"] < 1e-3


def test_phases_are_inside_each_measured_step(bench):
    """rank 0's forward + backward + optimizer step fit in the step's time (the slowest rank's, from the barrier)."""
    for row in _run(bench)["rows"].values():
        ph = row["phases_s"]
        assert all(len(ph[k]) == STEPS for k in ("fwd", "bwd", "opt"))
        for i, t in enumerate(row["step_time_s"]["steps"]):
            assert 0 < ph["fwd"][i] + ph["bwd"][i] + ph["opt"][i] <= ph["step"][i] <= t
        # zeroshard's rows: the seconds rank 0 was blocked on collectives, inside those phases
        waits = [k for k in ph if k.endswith("_wait")]
        assert len(waits) == (5 if row["system"].startswith("zs") else 0), (row["system"], waits)
        for k in waits:
            assert all(w >= 0 for w in ph[k])


def test_without_matplotlib_the_png_is_skipped_and_said(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_plot, "plot_available", lambda: False)
    lines = write_outputs(bench[1], str(tmp_path))
    assert (tmp_path / "bench.json").exists() and not (tmp_path / "bench.png").exists()
    assert any("matplotlib is not installed" in line for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["--systems", "ddp,zs9"], "unknown system 'zs9'"),
    (["--systems", "zs2,zs2"], "names 'zs2' twice"),
    (["--model", "nope"], "--model nope: unknown"),
    (["--sizes", "10M,bogus"], "--sizes bogus: unknown"),
    (["--model", "10M", "--sizes", "10M,50M"], "not both"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--seq-len", "4096"], "exceeds the model's context"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_input_fails_before_any_rank_starts(argv, message, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_deepspeed_named_but_not_importable_is_an_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_systems, "deepspeed_problem", lambda: "the 'deepspeed' package is not installed")
    assert main(["bench", "--systems", "ddp,ds2", "--out", str(tmp_path)]) == 2
    assert "DeepSpeed is not importable" in capsys.readouterr().err
    systems, notes, problem = bench_systems.resolve_systems(None)  # the defaults skip it, with a note
    assert problem is None and all(s.family != "deepspeed" for s in systems)
    assert any("DeepSpeed rows skipped" in n for n in notes)


def test_list_describes_every_system(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in bench_systems.SYSTEMS)


def test_bench_options_are_frozen():
    """The options users script against: adding is fine, renaming breaks them."""
    import argparse

    from zeroshard.bench.command import register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    options = {o for a in sub.choices["bench"]._actions for o in a.option_strings}
    assert options == {"-h", "--help", "--model", "--sizes", "--systems", "--list", "--steps", "--warmup", "--rounds", "--nproc",
                       "--threads", "--micro-batch", "--seq-len", "--bf16", "--seed", "--out", "--timeout"}
