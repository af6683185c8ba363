"""`import zeroshard.deepspeed as deepspeed` runs a DeepSpeed-tutorial-style script unchanged.

The script (tests/deepspeed_scripts/tutorial_train.py) is copied with only its
`import deepspeed` line replaced, and run on 2 ranks with `zeroshard launch` at stage 3 (and
at stages 1 and 2 in the slow run). Its final weights (written by
`save_16bit_model`) must equal the same training through zeroshard's own API in one
process with the whole batch (the oracle of DESIGN.md section 9: SGD, fp32, within 1e-5
of each tensor's largest entry). The stage-3 run's mid-way checkpoint (2 ranks) is then
loaded by the same script's main() in this process (one rank, no launcher) at stage 1 and trained on to the end, which
must match too. The rest are in-process checks of the API's DeepSpeed semantics.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DistributedSampler, TensorDataset

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard.policies import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "deepspeed_scripts", "tutorial_train.py")
ORIGINAL_IMPORT = "import deepspeed\n"
DROPIN_IMPORT = "import zeroshard.deepspeed as deepspeed\n"
STEPS, SAVE_AT, N, MICRO, LR = 6, 3, 2, 4, 0.1


def _dropin_copy(directory) -> str:
    with open(SCRIPT) as fh:
        lines = fh.readlines()
    assert lines.count(ORIGINAL_IMPORT) == 1
    path = os.path.join(directory, "train.py")
    with open(path, "w") as fh:
        fh.writelines(DROPIN_IMPORT if line == ORIGINAL_IMPORT else line for line in lines)
    return path


def _ds_config(stage: int, world_size: int = N) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 512}  # a few buckets: stage 2 reduces during backward
    if stage == 3:  # small enough to shard: every Linear its own unit, nothing kept whole
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True,
                    leaf_module={"classes": ["Linear"]})
    return {"train_batch_size": N * MICRO, "train_micro_batch_size_per_gpu": N * MICRO // world_size,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": zero}


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                              "MASTER_ADDR", "MASTER_PORT")}


def _results(stdout: str) -> list[dict]:
    """Every rank's `RESULT {json}`. Both ranks print at the same moment into one pipe, and
    print() writes the text and its newline separately, so two lines may come out run
    together ("RESULT {...}RESULT {...}"): decode each object where its marker starts."""
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part)[0] for part in stdout.split("RESULT ")[1:] if part.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def _script_module(directory):
    spec = importlib.util.spec_from_file_location("dropin_train", _dropin_copy(directory))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines Net and make_trainset; main() is not run
    return module


def _reference(module, steps: int) -> dict[str, torch.Tensor]:
    """The same training through zeroshard's own API: one process, batch N x MICRO, SGD.
    The order is DistributedSampler's, worked out here: randperm(seed 0), rank r takes every
    N-th index, so global step k trains on order[k*N*MICRO : (k+1)*N*MICRO]."""
    torch.manual_seed(0)
    net, data = module.Net(), module.make_trainset()
    engine = zeroshard.initialize(net, {"train_batch_size": N * MICRO}, optimizer=lambda p: torch.optim.SGD(p, lr=LR))
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    for k in range(steps):
        x, y = data[order[k * N * MICRO:(k + 1) * N * MICRO]]
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    worst = 0.0
    for name, ref in want.items():
        diff = (got[name].float() - ref).abs().max().item() / ref.abs().max().item()
        worst = max(worst, diff)
        assert diff <= 1e-5, f"{name}: differs by {diff:.3g} of its largest entry"
    return worst


def _run_main_here(module, argv: list[str], cwd) -> tuple[int, str, str]:
    """The script's main() in this process (one rank, no launcher): as `python train.py ...`."""
    stdout, here, old_argv = io.StringIO(), os.getcwd(), sys.argv
    try:
        os.chdir(cwd)
        sys.argv = argv
        with contextlib.redirect_stdout(stdout):
            module.main()
    finally:
        os.chdir(here)
        sys.argv = old_argv
    return 0, stdout.getvalue(), ""


class _Runs:
    """The drop-in script on 2 ranks at a stage, launched on first use, and the stage-3 run's
    step-3 checkpoint resumed by the same script in one process at stage 1 (`runs["resume"]`)."""

    def __init__(self, base):
        self.base, self.script, self.done = base, _dropin_copy(base), {}

    def __getitem__(self, key):
        if key == "base":
            return self.base
        if key not in self.done:
            self.done[key] = self._resume() if key == "resume" else self._launch(key)
        return self.done[key]

    def _launch(self, stage: int):
        work = self.base / f"stage{stage}"
        work.mkdir()
        (work / "ds_config.json").write_text(json.dumps(_ds_config(stage)))
        cmd = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--num_gpus", str(N), self.script,
               "--deepspeed", "--deepspeed_config", "ds_config.json", "--steps", str(STEPS),
               "--save_interval", str(SAVE_AT), "--save_dir", "ckpt", "--out", "out"]
        proc = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
        return work, proc.returncode, proc.stdout, proc.stderr

    def _resume(self):
        self[3]  # the stage-3 launch writes the checkpoint resumed here
        work = self.base / "resume"
        work.mkdir()
        (work / "ds_config.json").write_text(json.dumps(_ds_config(1, world_size=1)))
        saved = self.base / "stage3" / "ckpt"
        argv = ["train.py", "--deepspeed_config", "ds_config.json", "--load_dir", str(saved), "--ckpt_id",
                f"step{SAVE_AT}", "--steps", str(STEPS), "--save_interval", "100", "--save_dir", "ckpt", "--out", "out"]
        return (work, *_run_main_here(_script_module(self.base), argv, work))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory.mktemp("dropin"))


@pytest.fixture(scope="module")
def reference(runs):
    return _reference(_script_module(runs["base"]), STEPS)


def test_the_script_differs_from_a_deepspeed_script_only_in_its_import_line(tmp_path):
    with open(SCRIPT) as fh:
        original = fh.readlines()
    with open(_dropin_copy(tmp_path)) as fh:
        copy = fh.readlines()
    changed = [(a, b) for a, b in zip(original, copy) if a != b]
    assert len(original) == len(copy) and changed == [(ORIGINAL_IMPORT, DROPIN_IMPORT)]
    text = "".join(original)
    for call in ("deepspeed.add_config_arguments(parser)", "deepspeed.initialize(", "model_parameters=parameters",
                 "training_data=trainset", "model_engine.backward(loss)", "model_engine.step()",
                 "save_checkpoint(args.save_dir, ckpt_id, client_state=client_sd)", "load_checkpoint(args.save_dir"):
        assert call in text


# stage 3 in the default run (one launch, ~7 s); stages 1 and 2 slow (their arithmetic is the
# in-process oracle's, tests/test_stages_oracle.py; the drop-in surface is the same at every stage)
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_tutorial_script_on_two_ranks_trains_like_zeroshards_own_api(runs, reference, stage):
    work, rc, stdout, stderr = runs[stage]
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    assert f"ZeRO stage {stage} on 2 rank(s)" in stderr
    rows = _results(stdout)
    assert [r["rank"] for r in rows] == [0, 1] and [r["local_rank"] for r in rows] == [0, 1]
    for r in rows:
        assert (r["world_size"], r["stage"], r["micro"], r["batch"], r["gas"]) == (2, stage, MICRO, N * MICRO, 1)
        assert r["rank_world"] == [r["rank"], 2] and r["lr"] == [LR] and r["applied"] and r["steps"] == STEPS
        assert not r["fp16"] and not r["bf16"]
        assert r["loader_batches"] == 64 // (N * MICRO)  # the returned loader: 32 samples per rank, micro 4
        assert r["client_sd"] == {"step": STEPS, "note": "tutorial"}  # load_checkpoint read it back
        assert r["load_path"] == os.path.join("ckpt", f"step{STEPS}")
    assert sorted(os.listdir(work / "ckpt")) == ["latest", f"step{SAVE_AT}", f"step{STEPS}"]
    assert (work / "ckpt" / "latest").read_text() == f"step{STEPS}"
    assert os.listdir(work / "out") == ["model.safetensors"]  # asked for pytorch_model.bin: never a pickle
    assert "never a pickle" in stderr
    worst = _assert_close(load_file(str(work / "out" / "model.safetensors")), reference)
    print(f"stage {stage}, 2 ranks: largest difference {worst:.2e} of a tensor's largest entry")


def test_checkpoint_from_two_ranks_at_stage_3_resumes_in_one_process_at_stage_1(runs, reference):
    _, rc3, _, _ = runs[3]
    assert rc3 == 0
    work, rc, stdout, stderr = runs["resume"]
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    (row,) = _results(stdout)
    assert (row["world_size"], row["stage"], row["micro"], row["steps"]) == (1, 1, N * MICRO, STEPS)
    # trained steps 4..6 on top of the checkpoint: the same weights as 6 uninterrupted steps
    worst = _assert_close(load_file(str(work / "out" / "model.safetensors")), reference)
    print(f"stage 3 x 2 ranks -> stage 1 x 1 rank: largest difference {worst:.2e}")


# -- in-process (one rank) ------------------------------------------------------------------------------
class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _small(seed: int = 0) -> Small:
    torch.manual_seed(seed)
    return Small()


def _cfg(**extra) -> dict:
    return {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def _data(n: int = 12) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def _train(engine, loader, steps: int) -> None:
    for i, (x, y) in enumerate(loader):
        if i == steps:
            return
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def test_add_config_arguments():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--deepspeed_mpi"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and args.deepspeed_mpi
    args = parser.parse_args([])
    assert not args.deepspeed and args.deepspeed_config is None


def test_config_comes_from_args_or_config_but_not_both(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg()))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=-1)
    engine, *_ = deepspeed.initialize(args=args, model=_small(), model_parameters=_small().parameters())
    assert engine.train_batch_size() == 4
    with pytest.raises(ConfigError, match="both on the command line"):
        deepspeed.initialize(args=args, model=_small(), config=_cfg())
    with pytest.raises(ConfigError, match="needs a DeepSpeed config"):
        deepspeed.initialize(args=argparse.Namespace(deepspeed_config=None), model=_small())
    engine, *_ = deepspeed.initialize(model=_small(), config_params=_cfg(train_batch_size=2))
    assert engine.train_batch_size() == 2


def test_unsupported_features_are_one_clear_error():
    with pytest.raises(ConfigError, match="model parallelism"):
        deepspeed.initialize(model=_small(), config=_cfg(), mpu=object())
    with pytest.raises(ConfigError, match="pipeline"):
        deepspeed.pipe.PipelineModule(layers=[])
    with pytest.raises(ConfigError, match="mixture of experts"):
        deepspeed.moe.layer.MoE(hidden_size=8)
    with pytest.raises(ConfigError, match="pipeline"):
        deepspeed.initialize(model=_small(), config={**_cfg(), "pipeline": {"stages": 2}})
    engine, *_ = deepspeed.initialize(model=_small(), config=_cfg())
    with pytest.raises(ConfigError, match="pipeline engine"):
        engine.train_batch(iter([]))


def test_dataloader_is_deepspeeds(tmp_path):
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.utils.data.default_collate(items)

    data = _data(10)
    engine, _, loader, _ = deepspeed.initialize(model=_small(), config=_cfg(train_micro_batch_size_per_gpu=4),
                                                training_data=data, collate_fn=collate)
    assert isinstance(loader.sampler, DistributedSampler) and loader.batch_size == 4
    assert loader.sampler.shuffle and loader.sampler.seed == 0 and engine.training_dataloader is loader
    assert loader.data_sampler is loader.sampler  # DeepSpeedDataLoader's attribute
    first = next(iter(loader))[0]
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first, data.tensors[0][order[:4]]) and seen == [4]
    assert [len(b[0]) for b in loader] == [4, 4, 2]
    _, _, loader, _ = deepspeed.initialize(model=_small(), training_data=data,
                                           config=_cfg(train_micro_batch_size_per_gpu=4, dataloader_drop_last=True))
    assert [len(b[0]) for b in loader] == [4, 4]
    assert deepspeed.initialize(model=_small(), config=_cfg())[2] is None


def test_model_parameters_are_the_groups_to_optimize():
    model = _small()
    groups = [{"params": model.a.parameters(), "weight_decay": 0.0}, {"params": list(model.b.parameters())}]
    cfg = _cfg(optimizer={"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}})
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    assert [g["lr"] for g in optimizer.param_groups] == [0.01, 0.01] and engine.get_lr() == [0.01, 0.01]

    model = _small()  # a subset: the rest is never trained, as under DeepSpeed
    before = model.a.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(), model_parameters=model.b.parameters())
    _train(engine, torch.utils.data.DataLoader(_data(), batch_size=4), 2)
    assert torch.equal(model.a.weight.detach(), before) and not model.a.weight.requires_grad

    seen = []

    def make(params):
        seen.append(params)
        return torch.optim.SGD(params, lr=0.05)

    model = _small()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config={"train_batch_size": 4}, optimizer=make,
                                                   model_parameters=model.parameters())
    assert len(seen) == 1 and isinstance(seen[0], list) and len(seen[0]) == 4 and engine.get_lr() == [0.05]


def test_scheduler_from_the_config_is_returned():
    cfg = _cfg(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                         "warmup_num_steps": 4}})
    engine, _, loader, sched = deepspeed.initialize(model=_small(), config=cfg, training_data=_data())
    assert sched is engine.lr_scheduler and sched is not None
    _train(engine, loader, 2)
    assert 0.0 < engine.get_lr()[0] < 0.1
    engine, _, loader, sched = deepspeed.initialize(  # passed in, as a callable optimizer -> scheduler
        model=_small(), config=_cfg(), training_data=_data(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    _train(engine, loader, 2)
    assert sched is engine.lr_scheduler and engine.get_lr() == [0.025]


def test_engine_accessors_and_was_step_applied():
    engine, _, loader, _ = deepspeed.initialize(model=_small(), training_data=_data(),
                                                config=_cfg(train_micro_batch_size_per_gpu=2,
                                                            gradient_accumulation_steps=2))
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (4, 2, 2)
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 0, 1, 1)
    assert engine.device == torch.device("cpu") and engine.zero_optimization_stage() == 0
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled() and engine.gradient_clipping() == 0.0
    assert isinstance(engine.module, Small) and engine.zeroshard.module is engine.module
    assert engine.memory_stats() == engine.zeroshard.memory_stats()  # the rest is the Engine's
    x, y = next(iter(loader))
    engine.backward(F.mse_loss(engine(x), y))
    assert not engine.is_gradient_accumulation_boundary()
    engine.step()
    assert not engine.was_step_applied() and engine.global_steps == 0  # mid-accumulation
    engine.backward(F.mse_loss(engine(x), y))
    assert engine.is_gradient_accumulation_boundary()
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1 and engine.global_samples == 4
    assert engine.train() is engine and engine.eval() is engine and not engine.module.training
    bf16, *_ = deepspeed.initialize(model=_small(), config=_cfg(bf16={"enabled": True}))
    assert bf16.bfloat16_enabled() and not bf16.fp16_enabled()


def test_checkpoint_signatures(tmp_path, caplog):
    engine, _, loader, _ = deepspeed.initialize(model=_small(), config=_cfg(), training_data=_data())
    assert engine.load_checkpoint(tmp_path / "nothing") == (None, None)
    _train(engine, loader, 2)
    assert engine.save_checkpoint(tmp_path, client_state={"epoch": 3}) is True  # default tag global_step2
    assert (tmp_path / "latest").read_text() == "global_step2"
    _train(engine, loader, 1)
    assert engine.save_checkpoint(tmp_path, tag="side", save_latest=False) is True
    assert (tmp_path / "latest").read_text() == "global_step2" and (tmp_path / "side").is_dir()
    assert engine.load_checkpoint(tmp_path, tag="missing") == (None, None)
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}

    fresh, _, _, _ = deepspeed.initialize(model=_small(seed=1), config=_cfg())
    path, client = fresh.load_checkpoint(tmp_path)
    assert path == os.path.join(str(tmp_path), "global_step2") and client == {"epoch": 3}
    assert fresh.global_steps == 2
    path, client = fresh.load_checkpoint(tmp_path, "side", load_module_only=True)
    assert path.endswith("side") and client == {} and fresh.global_steps == 2  # counters kept
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(v, weights[k])

    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        assert engine.save_16bit_model(tmp_path / "hf") is True
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"] and "never a pickle" in caplog.text
    assert engine.save_16bit_model(tmp_path / "hf", "weights.safetensors") is True
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors", "weights.safetensors"]
    saved = load_file(str(tmp_path / "hf" / "weights.safetensors"))
    assert set(saved) == set(weights) and all(torch.equal(saved[k], weights[k]) for k in weights)


def test_zero_init_gathered_parameters_and_comm():
    cfg = _cfg(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Small()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    with deepspeed.zero.GatheredParameters(model.b.weight, modifier_rank=0):
        with torch.no_grad():
            model.b.weight.fill_(0.5)
    assert torch.all(engine.zeroshard.full_state_dict()["b.weight"] == 0.5)
    with pytest.raises(ConfigError, match="remote_device"):
        deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu")
    deepspeed.init_distributed()
    deepspeed.comm.barrier()
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), deepspeed.comm.get_local_rank()) == (0, 1, 0)
