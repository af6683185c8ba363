"""`zeroshard bench`'s features the presets in bench/ rely on: interleaved rounds pooled into one
row, FSDP2's transient model states and collectives sampled in its untimed step, the `"{unit}"`
placeholder of `zs3_fsdp2`; and the two preset scripts' smoke runs end to end (issue 26: the
scripts are presets of the harness). No timings are asserted. The rounds are checked in-process
(each job replaced by its rank files) and FSDP2's sampling through the worker's own `run_job` on 2
forked ranks: the torchrun jobs themselves are test_bench_cmd.py's and the smoke run's here."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from zeroshard.bench.results import pool_rounds
from zeroshard.bench.systems import SYSTEMS

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(steps, rss, fwd):
    return {"step_time_s": {"median": statistics.median(steps), "min": min(steps), "max": max(steps), "steps": steps},
            "tokens_per_step": 100, "tokens_per_s": 100 / statistics.median(steps), "peak_rss_mib": rss,
            "phases_s": {"fwd": fwd, "bwd": fwd, "opt": fwd}, "losses": [1.0], "wall_s": 2.0}


def test_pool_rounds_pools_the_steps_and_keeps_the_largest_rss():
    a, b = _row([1.0, 3.0], [10, 20], [0.1, 0.2]), _row([2.0, 5.0], [15, 5], [0.3, 0.4])
    row = pool_rounds([a, b])
    assert row["step_time_s"]["steps"] == [1.0, 3.0, 2.0, 5.0]
    assert row["step_time_s"]["median"] == 2.5 and row["step_time_s"]["round_medians"] == [2.0, 3.5]
    assert row["tokens_per_s"] == pytest.approx(100 / 2.5)
    assert row["peak_rss_mib"] == [15, 20] and row["phases_s"]["fwd"] == [0.1, 0.2, 0.3, 0.4]
    assert row["rounds"] == 2 and row["wall_s"] == 4.0
    assert pool_rounds([a]) is a


def test_unit_placeholder_is_the_unit_size():
    zero = SYSTEMS["zs3_fsdp2"].zero_config("", unit=1234)
    assert zero["stage3_prefetch_bucket_size"] == 1234 and zero["stage3_max_reuse_distance"] == 1234
    assert SYSTEMS["zs2_ds"].zero_config("")["reduce_bucket_size"] == 500_000_000
    assert not SYSTEMS["zs3_fsdp2"].default and not SYSTEMS["zs2_ds"].default


def _rank_file(system: str, rank: int, base: float) -> dict:
    """One rank's figures as bench.worker writes them: 1 warm-up + 1 measured step."""
    return {"system": system, "rank": rank, "world_size": 2, "phi": 1000, "threads": 1, "init_s": 0.1,
            "warmup": 1, "step_times_s": [9.0, base + rank / 10], "phases_s": [(3.0, 3.0, 3.0), (base / 3,) * 3],
            "waits_s": [None, None], "losses": [2.0, 1.5], "peak_rss_kib": 1024 * (100 + rank),
            "peak_rss_reset": True, "model_states": {"params": 4000, "grads": 4000, "optimizer_states": 8000}}


def test_rounds_run_interleaved_and_pool(monkeypatch, capsys, tmp_path):
    """`zeroshard bench --rounds 2` in-process, each system's job replaced by its rank files (the jobs
    themselves run in test_bench_cmd.py): the order of the runs, and each system's rows pooled."""
    from zeroshard.bench import launch
    from zeroshard.cli.main import main

    calls = []

    def run_system(args, model, system, folder):
        calls.append((system.name, os.path.basename(folder)))
        row = launch.merge_ranks([_rank_file(system.name, r, len(calls)) for r in (0, 1)], args.micro_batch,
                                 args.seq_len)
        return row, "done"

    monkeypatch.setattr(launch, "run_system", run_system)
    assert main(["bench", "--model", "tiny", "--systems", "fsdp2,zs3_fsdp2", "--steps", "1", "--warmup", "1",
                 "--rounds", "2", "--micro-batch", "1", "--seq-len", "16", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    order = [line.split(": running")[0] for line in stdout.splitlines() if ": running" in line]
    assert order == ["[1/4] tiny fsdp2 round 1/2", "[2/4] tiny zs3_fsdp2 round 1/2",
                     "[3/4] tiny fsdp2 round 2/2", "[4/4] tiny zs3_fsdp2 round 2/2"]
    assert calls == [("fsdp2", "round1"), ("zs3_fsdp2", "round1"), ("fsdp2", "round2"), ("zs3_fsdp2", "round2")]
    with open(tmp_path / "bench.json") as fh:
        run = json.load(fh)["runs"]["tiny"]
    for k, (name, row) in enumerate(run["rows"].items(), 1):  # fsdp2 ran 1st and 3rd, zs3_fsdp2 2nd and 4th
        assert row["rounds"] == 2 and row["step_time_s"]["steps"] == pytest.approx([k + 0.1, k + 2.1])
        assert row["step_time_s"]["round_medians"] == pytest.approx([k + 0.1, k + 2.1])
        assert len(row["phases_s"]["fwd"]) == 2 and row["peak_rss_mib"] == [100, 101]
    assert "zs3_fsdp2/fsdp2" in run["ratios"]


def _fsdp2_job(rank: int, world: int):
    from distributed import one_group
    from zeroshard.bench.worker import run_job

    job = {"model": "tiny", "steps": 1, "warmup": 1, "micro_batch": 1, "seq_len": 16, "bf16": False, "seed": 0,
           "threads": 1, "scratch": ""}
    with one_group():
        return {name: run_job({**job, "system": name}) for name in ("fsdp2", "zs3_fsdp2")}


def test_fsdp2_transients_and_collectives_are_sampled():
    """The worker's own run_job on 2 ranks (what each torchrun rank of `zeroshard bench` runs)."""
    from distributed import run_ranks
    from zeroshard.bench.results import merge_ranks

    ranks = run_ranks(_fsdp2_job, 2, timeout=300)
    rows = {name: merge_ranks([r[name] for r in ranks], 1, 16) for name in ("fsdp2", "zs3_fsdp2")}
    fs = rows["fsdp2"]
    for states, peak in zip(fs["model_states"], fs["peer_peak"]):
        assert peak["unsharded_params"] > 0 and peak["unsharded_sum"] >= peak["unsharded_params"]
        assert peak["peak_model_states"] == sum(states.values()) + peak["unsharded_sum"]
    # FSDP2 gathers every parameter in forward and again in backward (not the root's), reduce-scatters once
    phi_per_step = fs["peer_peak"][0]["paper_elements"] / fs["phi"]
    assert 2.0 < phi_per_step <= 3.01
    zero = rows["zs3_fsdp2"]["config"]["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == zero["stage3_max_reuse_distance"] > 0


@pytest.mark.parametrize("script, args, expect", [
    # the default run keeps one preset end to end (both go through zeroshard.bench's run_preset)
    pytest.param("bench_stages.py", ["--only", "zs2", "--no-ds-row"], ["targets (issue 2)", "zs2 step time <= 1.10 x DDP"],
                 marks=pytest.mark.slow),
    ("bench_stage3.py", [], ["targets (issue 3)", "zs3 peak model-state memory <= FSDP2"]),
])
def test_preset_scripts_smoke_run(script, args, expect, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for text in expect:
        assert text in proc.stdout
    assert (tmp_path / "bench.json").exists()
