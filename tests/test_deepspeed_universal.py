"""Resuming DeepSpeed universal checkpoints (ds_to_universal's output), without DeepSpeed.

The fixtures <case>_universal/ were made by DeepSpeed 0.18's own ds_to_universal from the
ZeRO fixtures <case>/ (tests/fixtures/deepspeed_ckpt/make_universal.py), and DeepSpeed then
resumed each on 2 ranks with `"checkpoint": {"load_universal": true}` and trained common.K
steps (<case>_universal.json). Here zeroshard loads the universal folder:

- the masters and Adam states it reads are bit-for-bit the ones it reads from the source
  ZeRO folder, and equal DeepSpeed's own view of them at the save;
- on 2 ranks at the saved stage (the drop-in engine, whose config says load_universal) and
  on 1 and 3 ranks at other stages (the native engine), training goes on like DeepSpeed's
  resumed runs: losses like both of DeepSpeed's records (from the ZeRO folder and from the
  universal one; they are equal), parameters like the ZeRO folder's record. (DeepSpeed
  0.18.9's `safe_get_full_fp32_param` reads wrong values after a universal load at stages
  1-2, though its losses are the same, so its universal record's parameters are not compared.)
- `zeroshard inspect`, `export` and `convert` read the folder;
- a missing state file, a missing optimizer_state.pt, a planted pickle: one clear error each.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from distributed import one_group, run_ranks
from test_deepspeed_migration import (
    BF16_LOSS,
    FIX,
    FP32_REL,
    _check_reshard,
    _masters,
    _Planted,
    _resume_native,
    _train,
    common,
    record,
)

pytestmark = pytest.mark.recorded  # compares with what DeepSpeed computed on another machine

UNIVERSAL = ("stage1_fp32", "stage2_bf16", "stage3_fp32", "stage3_bf16")


def universal(case: str) -> str:
    return os.path.join(FIX, case + "_universal")


def _check_against_universal_record(case: str, losses: list[float]) -> None:
    rec = json.load(open(universal(case) + ".json"))
    assert rec["losses_after_resume"] == record(case)["losses_after_resume"]  # DeepSpeed: the same either way
    want = torch.tensor(rec["losses_after_resume"])
    rel = ((torch.tensor(losses) - want).abs() / want.abs()).max().item()
    assert rel <= (FP32_REL if case.endswith("fp32") else BF16_LOSS), (case, losses, rec["losses_after_resume"])


def test_reads_what_the_source_folder_holds():
    from zeroshard.checkpoint.deepspeed_reader import open_checkpoint
    from zeroshard.checkpoint.deepspeed_reader.universal import UniversalCheckpoint

    for case in UNIVERSAL:
        rec = record(case)
        with open_checkpoint(universal(case)) as u, open_checkpoint(os.path.join(FIX, case)) as src:
            assert isinstance(u, UniversalCheckpoint) and u.stage == src.stage
            assert (u.meta["global_steps"], u.meta["client_state"]) == (src.meta["global_steps"], src.meta["client_state"])
            assert u.meta["optimizer"] == src.meta["optimizer"] and u.meta["lr_scheduler"] == src.meta["lr_scheduler"]
            for name, e in rec["saved"].items():
                assert torch.equal(u.read(name), torch.tensor(e["value"])), (case, name)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(u.read(name, f"optim.{key}"), src.read(name, f"optim.{key}")), (case, name, key)
                assert [float(s) for s in u.scalars(name, "optim.step")] == [float(common.K)]


def _dropin(rank: int, world: int, cases: tuple[str, ...]) -> dict:
    """The DeepSpeed drop-in, configured as DeepSpeed was to resume the universal folder."""
    import zeroshard.deepspeed as deepspeed

    with one_group():
        out = {}
        for case in cases:
            cfg = json.load(open(universal(case) + ".json"))["config"]
            assert cfg["checkpoint"] == {"load_universal": True}
            model = common.make_model(seed=common.SEED + 7)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=common.trainable(model), config=cfg)
            _, client = engine.load_checkpoint(universal(case))
            loaded = _masters(engine)
            losses = _train(engine, rank, world, range(common.K, 2 * common.K))
            out[case] = {"client": client, "loaded": loaded, "losses": losses, "final": _masters(engine),
                         "global_steps": engine.global_steps}
            engine.destroy()
    return out


def test_resumes_like_deepspeed_on_two_ranks():
    results = run_ranks(_dropin, 2, UNIVERSAL, timeout=600)
    report = {}
    for case in UNIVERSAL:
        got = results[0][case]
        for name, e in record(case)["saved"].items():
            assert torch.equal(got["loaded"][name].flatten(), torch.tensor(e["value"])), (case, name)
        assert got["client"] == record(case)["client_state"] and got["global_steps"] == 2 * common.K
        _check_against_universal_record(case, got["losses"])
        rec = record(case)
        report[case] = max((got["final"][n].flatten() - torch.tensor(v)).abs().max().item()
                           for n, v in rec["final"].items())
        assert report[case] <= (FP32_REL * 2 if case.endswith("fp32") else 5e-4), (case, report[case])
    print("\nuniversal, 2 ranks, worst parameter difference:", {c: f"{d:.2e}" for c, d in report.items()})


@pytest.mark.parametrize("world, plan", [
    (1, [("stage3_fp32", 1), ("stage2_bf16", 3)]),
    (3, [("stage1_fp32", 3), ("stage3_bf16", 2)]),
])
def test_loads_on_other_world_sizes_and_stages(world, plan, tmp_path):
    plan = [(case, stage, universal(case)) for case, stage in plan]
    results = run_ranks(_resume_native, world, plan, str(tmp_path), timeout=600)
    report = _check_reshard(results, plan)
    for case, stage, _ in plan:
        _check_against_universal_record(case, results[0][f"{case}>{stage}"]["losses"])
    print(f"\nuniversal, {world} rank(s):", {k: (f"{a:.2e}", f"{b:.2e}") for k, (a, b) in report.items()})


def test_cli_inspect_export_convert(tmp_path, capsys):
    from safetensors.torch import load_file

    from zeroshard.checkpoint import CheckpointReader
    from zeroshard.cli.main import main

    assert main(["inspect", universal("stage3_bf16"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["stage"], report["global_steps"]) == ("deepspeed", 3, 3) and report["ok"]
    assert any(f.endswith(os.path.join("fc1.weight", "exp_avg.pt")) for f in json.dumps(report).split('"'))

    assert main(["export", universal("stage2_bf16"), str(tmp_path / "hf")]) == 0
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, e in record("stage2_bf16")["saved"].items():
        assert torch.equal(weights[name].flatten(), torch.tensor(e["value"])), name  # fp32 masters (the default)

    dst = tmp_path / "zs"
    assert main(["convert", universal("stage1_fp32"), str(dst)]) == 0
    with CheckpointReader(str(dst)) as r:
        for name, e in record("stage1_fp32")["saved"].items():
            assert torch.equal(r.read(name), torch.tensor(e["value"])), name
            assert torch.equal(r.read(name, "optim.exp_avg"), torch.tensor(e["exp_avg"])), name


def test_one_clear_error_each(tmp_path):
    from zeroshard.checkpoint import export
    from zeroshard.checkpoint.deepspeed_reader import open_checkpoint
    from zeroshard.policies import CheckpointError

    def error(root: str, read: bool = False) -> str:
        with pytest.raises(CheckpointError) as err:
            with open_checkpoint(root) as r:
                if read:
                    for name in r.where:  # the trainable parameters
                        r.read(name)
                        r.read(name, "optim.exp_avg_sq")
        assert "\n" not in str(err.value)
        return str(err.value)

    root = str(tmp_path / "u")
    shutil.copytree(universal("stage3_fp32"), root)
    tag = os.path.join(root, "global_step3")
    gone = os.path.join(tag, "zero", "fc2.bias", "exp_avg_sq.pt")
    os.remove(gone)
    assert gone in error(root, read=True) and "missing" in error(root, read=True)

    os.remove(os.path.join(tag, "zero", "fc1.weight", "fp32.pt"))
    text = error(root)
    assert os.path.join("fc1.weight", "fp32.pt") in text and "incomplete" in text

    shutil.rmtree(root)
    shutil.copytree(universal("stage1_fp32"), root)
    os.remove(os.path.join(tag, "zero", "optimizer_state.pt"))
    text = error(root)
    assert "optimizer_state.pt" in text and "incomplete" in text

    shutil.rmtree(root)
    shutil.copytree(universal("stage1_fp32"), root)
    victim = os.path.join(tag, "zero", "norm.weight", "fp32.pt")
    marker = str(tmp_path / "PWNED")
    torch.save({"param": _Planted(marker), "cat_dim": 0}, victim)
    text = error(root, read=True)
    assert victim in text and "system" in text, text
    with pytest.raises(CheckpointError, match="system"):
        export(root, str(tmp_path / "out"))
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out" / "model.safetensors")


@pytest.mark.slow
def test_universal_fixtures_regenerate_with_deepspeed(tmp_path):
    """make_universal.py run again with the installed DeepSpeed (over copies of the ZeRO
    fixtures) writes the same files and DeepSpeed resumes them to the same losses."""
    import subprocess

    from test_deepspeed_migration import _deepspeed_python

    from zeroshard.checkpoint.deepspeed_reader import open_checkpoint

    python = _deepspeed_python()
    if python is None:
        pytest.skip("DeepSpeed is not installed (neither /work/dsvenv nor an importable deepspeed)")
    for name in os.listdir(FIX):
        if name.endswith(".py") or (name.split(".")[0] in UNIVERSAL and not name.endswith("_universal")):
            (shutil.copytree if os.path.isdir(os.path.join(FIX, name)) else shutil.copy)(
                os.path.join(FIX, name), str(tmp_path / name))
    done = subprocess.run([python, str(tmp_path / "make_universal.py"), str(tmp_path)],
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in UNIVERSAL:
        new = json.loads((tmp_path / f"{case}_universal.json").read_text())
        assert new["losses_after_resume"] == pytest.approx(json.load(open(universal(case) + ".json"))["losses_after_resume"],
                                                           rel=1e-6)
        with open_checkpoint(str(tmp_path / f"{case}_universal")) as fresh, open_checkpoint(universal(case)) as stored:
            assert sorted(fresh.files) == sorted(stored.files)
            for name in stored.where:
                for field in ("value", "optim.exp_avg", "optim.exp_avg_sq"):
                    assert torch.equal(fresh.read(name, field), stored.read(name, field)), (case, name, field)
