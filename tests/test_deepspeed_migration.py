"""Resuming checkpoints that real DeepSpeed wrote (tests/fixtures/deepspeed_ckpt, made by
make_fixtures.py with DeepSpeed 0.18 on its CPU accelerator, 2 gloo ranks), ZeRO stages 0-3
(stage 0: no ZeRO, everything in the model-states file).

Each fixture: DeepSpeed trained common.K steps and saved; then DeepSpeed itself resumed and
trained K more, recording its losses and final fp32 parameters (<case>.json). Here zeroshard
resumes the same folder and trains the same K steps on the same data:

- on 2 ranks at the saved stage, through the DeepSpeed drop-in (`zeroshard.deepspeed`)
  engine's `load_checkpoint`: losses and parameters equal DeepSpeed's (fp32: 1e-5 relative;
  bf16: see BF16_LOSS / BF16_PARAM);
- on 1 and 3 ranks and at another stage, through the native Engine's `load_checkpoint`: the
  loaded masters and Adam states equal DeepSpeed's own view of them exactly, and training
  goes on like DeepSpeed's (the global batch is the same, split over the new ranks);
- after `zeroshard convert`, the same; `zeroshard inspect` and `export` read the folder;
- a planted pickle is refused without running; a missing rank file, a truncated file,
  another model, a folder that is no checkpoint: one clear error each;
- peak memory of a load: one DeepSpeed rank's partition plus one tensor beyond the final state.

No DeepSpeed is needed: the files are read with torch.load(weights_only=True) and an
allow-list of inert records.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch

from distributed import one_group, run_ranks

pytestmark = pytest.mark.recorded  # compares with what DeepSpeed computed on another machine

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed_ckpt")


def _common():
    if "ds_fixture_common" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ds_fixture_common", os.path.join(FIX, "common.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["ds_fixture_common"] = module
        spec.loader.exec_module(module)
    return sys.modules["ds_fixture_common"]


common = _common()
CASES = [common.case_name(*c) for c in common.CASES]

FP32_REL = 1e-5
# bf16: both systems step the same fp32 masters from bf16 forward/backward passes, but round
# in different places (DeepSpeed reduces gradients in bf16, its default grad_accum_dtype), so
# a loss may differ by about one bf16 ulp (2^-8 = 3.9e-3 relative) and a parameter by a small
# fraction of one Adam step (~lr, at most 0.0046 here). Bounds: losses 5e-3 relative (1.3
# ulp), parameters 5e-4 absolute (1/9 of a step). A mapping bug moves a parameter by a whole
# element's difference (~0.1-1) or its Adam state by a factor. Measured on the fixtures:
# losses 3.9e-4, parameters 1.0e-4 (1 and 3 ranks: 4.3e-4, 8.4e-5).
BF16_LOSS = 5e-3
BF16_PARAM = 5e-4


def record(case: str) -> dict:
    with open(os.path.join(FIX, case + ".json")) as f:
        return json.load(f)


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        x, y = common.rank_batch(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _masters(engine) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in engine.full_state_dict().items()}


def _resume_dropin(rank: int, world: int, cases: list[str]) -> dict:
    """Every case through zeroshard.deepspeed.initialize + engine.load_checkpoint."""
    import zeroshard.deepspeed as deepspeed

    with one_group():
        out = {}
        for case in cases:
            rec = record(case)
            model = common.make_model(seed=common.SEED + 7, frozen=bool(rec.get("frozen")))  # the load must set them all
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=common.trainable(model),
                                                   config=json.loads(json.dumps(rec["config"])))
            path, client = engine.load_checkpoint(os.path.join(FIX, case))
            loaded = _masters(engine)
            steps = (engine.global_steps, engine.get_lr())
            losses = _train(engine, rank, world, range(common.K, 2 * common.K))
            out[case] = {"path": path, "client": client, "loaded": loaded, "steps": steps, "losses": losses,
                         "final": _masters(engine)}
            engine.destroy()
    return out


def _check_trajectory(case: str, got: dict) -> tuple[float, float]:
    """(worst relative loss difference, worst absolute parameter difference) against
    DeepSpeed's own resumed run; asserts the bound of the case's dtype."""
    rec = record(case)
    want = torch.tensor(rec["losses_after_resume"])
    loss_rel = ((torch.tensor(got["losses"]) - want).abs() / want.abs()).max().item()
    param = max((got["final"][n].flatten() - torch.tensor(v)).abs().max().item() for n, v in rec["final"].items())
    scale = max(torch.tensor(v).abs().max().item() for v in rec["final"].values())
    if rec["dtype"] == "fp32":
        assert loss_rel <= FP32_REL, (case, got["losses"], rec["losses_after_resume"])
        assert param <= FP32_REL * scale, (case, param)
    else:
        assert loss_rel <= BF16_LOSS, (case, got["losses"], rec["losses_after_resume"])
        assert param <= BF16_PARAM, (case, param)
    return loss_rel, param


def _frozen_saved(case: str, name: str) -> torch.Tensor:
    """Frozen parameter `name` as DeepSpeed's model-states files hold it, read here by hand:
    at stage 3 each rank's fragment (its 1/N partition, padded) in `frozen_param_fragments`,
    otherwise whole in `module`, in the compute dtype."""
    tag = os.path.join(FIX, case, "global_step3")
    rec = record(case)
    if rec["stage"] < 3:
        return torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=True)["module"][name]
    frags = [torch.load(os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), weights_only=True)
             ["frozen_param_fragments"][name].flatten() for r in range(rec["world_size"])]
    shape = dict(common.make_model(frozen=True).named_parameters())[name].shape
    return torch.cat(frags)[: shape.numel()].view(shape)


def _check_loaded(case: str, loaded: dict) -> None:
    """The masters right after the load are exactly the ones DeepSpeed saved, and frozen
    parameters exactly the bytes DeepSpeed saved for them (in the compute dtype). That they are
    the values they were frozen at is checked against this machine's initialization within two
    ulps of the init bound (not exactly: nn.Linear's uniform_ init differs in the last bit from one CPU kernel
    to another, e.g. under ATEN_CPU_CAPABILITY=default; issue 47)."""
    rec = record(case)
    for name, e in rec["saved"].items():
        assert torch.equal(loaded[name].flatten(), torch.tensor(e["value"])), (case, name)
    dtype = torch.bfloat16 if rec["dtype"] == "bf16" else torch.float32
    initial = dict(common.make_model(frozen=True).named_parameters())
    for name in rec.get("frozen", []):
        saved = _frozen_saved(case, name)
        assert saved.dtype == dtype and torch.equal(loaded[name], saved.float()), (case, name)
        init = initial[name].detach().to(dtype).float()  # uniform_(-b, b): off by at most an ulp of b
        ulp_of_bound = torch.finfo(dtype).eps * init.abs().max().item()
        assert (saved.float() - init).abs().max().item() <= 2 * ulp_of_bound, (case, name)


def test_resume_matches_deepspeed_on_two_ranks():
    results = run_ranks(_resume_dropin, 2, CASES, timeout=600)
    r0 = results[0]
    report = {}
    for case in CASES:
        got = r0[case]
        rec = record(case)
        _check_loaded(case, got["loaded"])
        assert got["client"] == rec["client_state"]
        assert got["path"].endswith("model_states.pt")
        assert got["steps"][0] == rec["global_steps_at_save"]
        assert got["steps"][1][0] == pytest.approx(rec["lrs_after_resume"][0], rel=1e-12)
        report[case] = _check_trajectory(case, got)
        for name in rec["final"]:  # every rank ends with the same parameters
            assert torch.equal(results[1][case]["final"][name], got["final"][name])
    print("\nresume vs DeepSpeed (worst loss rel. diff, worst param abs. diff):",
          {c: (f"{a:.2e}", f"{b:.2e}") for c, (a, b) in report.items()})


def _config(case: str, stage: int, world: int) -> dict:
    cfg = json.loads(json.dumps(record(case)["config"]))
    cfg["zero_optimization"]["stage"] = stage
    cfg["train_micro_batch_size_per_gpu"] = common.WORLD * common.MICRO // world
    return cfg


def _resume_native(rank: int, world: int, plan: list[tuple[str, int]], tmp: str) -> dict:
    """Each (case, stage) through zeroshard.initialize + Engine.load_checkpoint on `world`
    ranks; the loaded state is saved again as a zeroshard checkpoint so its Adam states can be
    read back by name."""
    import zeroshard

    with one_group():
        out = {}
        for case, stage, *src in plan:
            model = common.make_model(seed=common.SEED + 7, frozen=bool(record(case).get("frozen")))
            engine = zeroshard.initialize(model, _config(case, stage, world))
            client = engine.load_checkpoint(src[0] if src else os.path.join(FIX, case))
            loaded = _masters(engine)
            again = os.path.join(tmp, f"{case}-to-stage{stage}-on{world}")
            engine.save_checkpoint(again)
            losses = _train(engine, rank, world, range(common.K, 2 * common.K))
            out[f"{case}>{stage}"] = {"client": client, "loaded": loaded, "again": again, "losses": losses,
                                      "final": _masters(engine), "global_steps": engine.global_steps}
            engine.close()
    return out


def _check_reshard(results: list[dict], plan: list[tuple[str, int]]) -> dict:
    from zeroshard.checkpoint import CheckpointReader

    report = {}
    for case, stage, *_ in plan:
        got = results[0][f"{case}>{stage}"]
        rec = record(case)
        _check_loaded(case, got["loaded"])
        assert got["client"] == rec["client_state"]
        assert got["global_steps"] == rec["global_steps_at_save"] + common.K
        with CheckpointReader(got["again"]) as saved:  # Adam states as zeroshard holds them after the load
            for name, e in rec["saved"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(saved.read(name, f"optim.{key}"), torch.tensor(e[key])), (case, stage, name, key)
        report[f"{case}>{stage}"] = _check_trajectory(case, got)
    return report


RESHARD_1 = [("stage1_fp32", 0), ("stage3_fp32", 2), ("stage2_bf16", 3), ("stage3_fp32_frozen", 1), ("stage0_bf16", 2)]
RESHARD_3 = [("stage1_fp32", 3), ("stage3_fp32", 1), ("stage3_bf16", 2), ("stage2_bf16_frozen", 3), ("stage0_fp32", 3)]


@pytest.mark.parametrize("world, plan", [(1, RESHARD_1), (3, RESHARD_3)])
def test_loads_on_other_world_sizes_and_stages(world, plan, tmp_path):
    results = run_ranks(_resume_native, world, plan, str(tmp_path), timeout=600)
    print(f"\n{world} rank(s):", {k: (f"{a:.2e}", f"{b:.2e}") for k, (a, b) in _check_reshard(results, plan).items()})


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_every_fixture_loads_at_every_stage(world, tmp_path):
    plan = [(case, stage) for case in CASES for stage in (0, 1, 2, 3)]
    results = run_ranks(_resume_native, world, plan, str(tmp_path), timeout=1800)
    _check_reshard(results, plan)


# -- refused and damaged files: one clear error each --------------------------------------------------
def _copy(case: str, tmp_path) -> str:
    dst = os.path.join(str(tmp_path), case)
    shutil.copytree(os.path.join(FIX, case), dst)
    return dst


def _tag_file(root: str, pattern: str) -> str:
    d = os.path.join(root, "global_step3")
    return os.path.join(d, next(n for n in sorted(os.listdir(d)) if pattern in n))


class _Planted:
    """What an attacker puts in a pickle: unpickling calls os.system."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path: str, marker: str) -> None:
    """Replace the file by a torch.save whose optimizer state holds the planted object."""
    torch.save({"optimizer_state_dict": {"zero_stage": _Planted(marker), "loss_scaler": None}}, path)


def test_planted_pickle_is_refused_and_never_runs(tmp_path):
    from zeroshard.checkpoint import export, inspect
    from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint
    from zeroshard.policies import CheckpointError

    root = _copy("stage2_fp32", tmp_path)
    victim = _tag_file(root, "zero_pp_rank_1_mp_rank_00_optim")
    marker = os.path.join(str(tmp_path), "PWNED")
    _plant(victim, marker)
    for attempt in (lambda: DeepSpeedCheckpoint(root), lambda: export(root, str(tmp_path / "out")),
                    lambda: inspect(root)):
        with pytest.raises(CheckpointError) as err:
            attempt()
        text = str(err.value)
        assert victim in text and "system" in text and "nothing from the file was run" in text, text
        assert "\n" not in text
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")
    # the same object in the model-states file (rank 0's, read first)
    model_file = _tag_file(root, "mp_rank_00_model_states")
    torch.save({"module": {}, "evil": _Planted(marker)}, model_file)
    with pytest.raises(CheckpointError, match="refused: it holds an object of type posix.system|refused"):
        DeepSpeedCheckpoint(root)
    assert not os.path.exists(marker)


def _swap_out_like_deepspeed(rank: int, world: int, root: str) -> None:
    """What DeepSpeed 0.18 (stage 3, offload_optimizer nvme) saves for a sub-group of 1 MiB or
    more: its fp32 partition and Adam states emptied in the optim_states file (swap_tensor's
    release_memory sets them to torch.Tensor()), the values copied as raw swap files into
    offloaded_tensors/rankNN/ (engine.save_checkpoint). Done in a child process: the
    rewrite needs stand-ins for DeepSpeed's classes (_fake_deepspeed_classes)."""
    _fake_deepspeed_classes()
    tag = os.path.join(root, "global_step3")
    for r in range(2):
        path = os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        sd = torch.load(path, weights_only=False)
        opt = sd["optimizer_state_dict"]
        swap = os.path.join(tag, "offloaded_tensors", f"rank{r:02d}")
        os.makedirs(swap)
        for j, flat in enumerate(opt["fp32_flat_groups"]):
            flat.detach().numpy().tofile(os.path.join(swap, f"{j}_{j}.tensor.swp"))
            opt["fp32_flat_groups"][j] = torch.empty(0)
            for key in ("exp_avg", "exp_avg_sq"):
                opt["optimizer_state_dict"]["state"][j][key] = torch.empty(0)
        torch.save(sd, path)


def _engine_error(rank: int, world: int, root: str, stage: int, model_kind: str) -> str:
    import zeroshard

    model = common.make_model() if model_kind == "same" else torch.nn.Sequential(torch.nn.Linear(7, 14))
    engine = zeroshard.initialize(model, _config("stage2_fp32", stage, world))
    try:
        engine.load_checkpoint(root)
    except Exception as exc:  # noqa: BLE001 - the test looks at the type and the text
        return f"{type(exc).__name__}: {exc}"
    finally:
        engine.close()
    return "loaded"


def test_one_clear_error_each(tmp_path):
    from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint, open_checkpoint
    from zeroshard.policies import CheckpointError

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="nor is it a checkpoint DeepSpeed wrote"):
        open_checkpoint(str(empty))

    missing = _copy("stage1_fp32", tmp_path / "missing")
    os.remove(_tag_file(missing, "zero_pp_rank_1_mp_rank_00_optim"))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: missing rank file "
                                              r"\(written by rank 1 of 2\)"):
        DeepSpeedCheckpoint(missing)
    missing3 = _copy("stage3_bf16", tmp_path / "missing3")
    os.remove(_tag_file(missing3, "zero_pp_rank_1_mp_rank_00_model"))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt: missing rank file"):
        DeepSpeedCheckpoint(missing3)

    for case, pattern in (("stage2_bf16", "zero_pp_rank_1_mp_rank_00_optim"), ("stage3_fp32", "zero_pp_rank_0_mp_rank_00_model")):
        root = _copy(case, tmp_path / "truncated")
        victim = _tag_file(root, pattern)
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
        with pytest.raises(CheckpointError, match=r"truncated or damaged") as err:
            DeepSpeedCheckpoint(root).verify()
        assert victim in str(err.value)

    nvme = _copy("stage3_fp32", tmp_path / "nvme")
    run_ranks(_swap_out_like_deepspeed, 1, nvme, timeout=300)
    with DeepSpeedCheckpoint(nvme) as swapped, DeepSpeedCheckpoint(os.path.join(FIX, "stage3_fp32")) as whole:
        for name in whole.where:  # the masters come from the swap files (test_deepspeed_nvme.py: DeepSpeed's own)
            assert torch.equal(swapped.read(name), whole.read(name)), name
        with pytest.raises(CheckpointError, match=r"offloaded_tensors/rank00/exp_avg-0_0.tensor.swp: missing; the "
                                                  r"checkpoint's NVMe swap files are incomplete"):
            swapped.read("fc1.weight", "optim.exp_avg")
    stage0 = _copy("stage0_fp32", tmp_path / "stage0")  # the optimizer holds fewer parameters than the module
    model_file = _tag_file(stage0, "mp_rank_00_model_states")
    sd = torch.load(model_file, weights_only=True)
    sd["optimizer"]["param_groups"][0]["params"].pop()
    sd["optimizer"]["state"].pop(5)
    torch.save(sd, model_file)
    with pytest.raises(CheckpointError, match=r"stage-0 optimizer holds 5 parameters, the module 6: DeepSpeed does "
                                              r"not record which were frozen"):
        DeepSpeedCheckpoint(stage0)

    # ds_to_universal's output (deepspeed/checkpoint/ds_to_universal.py) without its zero/optimizer_state.pt
    # (test_deepspeed_universal.py loads whole ones), found through `latest_universal` or by its folder
    universal = tmp_path / "universal"
    folder = universal / "global_step3_universal"
    (folder / "zero" / "fc1.bias").mkdir(parents=True)
    shutil.copy(os.path.join(FIX, "stage2_fp32", "global_step3", "mp_rank_00_model_states.pt"), folder)
    torch.save({"cat_dim": 0, "param": torch.zeros(13)}, folder / "zero" / "fc1.bias" / "fp32.pt")
    (universal / "latest_universal").write_text("global_step3_universal")
    for where in (universal, folder):
        with pytest.raises(CheckpointError, match=r"global_step3_universal/zero/optimizer_state.pt: missing; this "
                                                  r"universal checkpoint \(ds_to_universal's output\) is incomplete"):
            open_checkpoint(str(where))

    other = _copy("stage1_bf16", tmp_path / "moe")
    open(os.path.join(other, "global_step3", "layer_0_expert_1_mp_rank_00_model_states.pt"), "wb").close()
    with pytest.raises(CheckpointError, match="mixture-of-experts and pipeline-parallel"):
        DeepSpeedCheckpoint(other)

    results = run_ranks(_engine_error, 1, os.path.join(FIX, "stage2_fp32"), 2, "other", timeout=300)
    assert results[0].startswith("CheckpointError: ") and "does not match the model" in results[0], results[0]
    assert "fc1.weight" in results[0] and "\n" not in results[0]


def test_cli_inspect_export_convert(tmp_path, capsys):
    """`zeroshard inspect|export|convert` take a DeepSpeed folder; the converted checkpoint
    (zeroshard's format) resumes like the DeepSpeed one."""
    from safetensors.torch import load_file

    from zeroshard.cli.main import main

    assert main(["inspect", os.path.join(FIX, "stage3_bf16"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["stage"], report["world_size"], report["global_steps"]) == ("deepspeed", 3, 2, 3)
    assert report["parameters"] == 214 + common.OUT and report["ok"]

    out = tmp_path / "hf"
    assert main(["export", os.path.join(FIX, "stage2_fp32"), str(out)]) == 0
    weights = load_file(str(out / "model.safetensors"))
    rec = record("stage2_fp32")
    assert set(weights) == set(rec["saved"]) | {"shift"}
    for name, e in rec["saved"].items():
        assert torch.equal(weights[name].flatten(), torch.tensor(e["value"]))

    plan = []
    for case, stage in (("stage1_fp32", 3), ("stage3_bf16", 1), ("stage3_fp32_frozen", 2), ("stage0_bf16", 3)):
        dst = tmp_path / "zs" / case
        assert main(["convert", os.path.join(FIX, case), str(dst)]) == 0
        assert (dst / "latest").read_text() == "global_step3" and (dst / "global_step3" / "meta.json").is_file()
        plan.append((case, stage, str(dst)))
    capsys.readouterr()
    assert main(["convert", os.path.join(FIX, "stage1_fp32"), str(tmp_path / "zs" / "stage1_fp32")]) == 2
    assert "already exists" in capsys.readouterr().err
    results = run_ranks(_resume_native, 1, plan, str(tmp_path), timeout=300)
    print("\nconverted, 1 rank:", {k: (f"{a:.2e}", f"{b:.2e}") for k, (a, b) in _check_reshard(results, plan).items()})


# -- memory: one DeepSpeed rank's partition plus one tensor beyond the final state -------------------
WIDE, DEPTH = 1024, 8  # 8 x 1024 x 1024 + 1024 x 3 + 3 = 8.4M parameters, 33.6 MB fp32


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDE, WIDE, bias=False) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDE, 3)  # 3075 elements: the flat group needs padding

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((self.head(x) - y) ** 2).mean()


def _fake_deepspeed_classes() -> None:
    """Stand-ins registered under DeepSpeed's module paths, so that torch.save writes the same
    globals DeepSpeed's checkpoints hold. Only ever done in the writer's own process."""
    import enum
    import types

    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.config",
                 "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler", "deepspeed.utils",
                 "deepspeed.utils.tensor_fragment"):
        sys.modules.setdefault(name, types.ModuleType(name))

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    class LossScaler:
        def __init__(self, scale):
            self.cur_scale, self.dynamic = scale, False

    class fragment_address:  # noqa: N801 - DeepSpeed's name
        def __init__(self, numel, start):
            self.numel, self.start = numel, start

    for cls, module in ((ZeroStageEnum, "deepspeed.runtime.zero.config"), (LossScaler, "deepspeed.runtime.fp16.loss_scaler"),
                        (fragment_address, "deepspeed.utils.tensor_fragment")):
        cls.__module__, cls.__qualname__ = module, cls.__name__
        setattr(sys.modules[module], cls.__name__, cls)


def _write_wide_checkpoint(rank: int, world: int, root: str) -> int:
    """A stage-2, 2-rank, fp32 DeepSpeed checkpoint of `Wide` in the exact structure of the
    real fixtures (stage2_fp32), with random masters and Adam states. Returns the elements
    of one partition."""
    from collections import OrderedDict

    _fake_deepspeed_classes()
    ds = sys.modules
    torch.manual_seed(0)
    model = Wide()
    shapes = OrderedDict((n, p.shape) for n, p in model.named_parameters())
    total = sum(p.numel() for p in model.parameters())
    ranks = 2
    aligned = -(-total // (2 * ranks)) * (2 * ranks)
    size = aligned // ranks
    flat = torch.randn(aligned)
    flat[total:] = 0
    tag = os.path.join(root, "global_step5")
    os.makedirs(tag)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    torch.save({"module": OrderedDict((n, flat[0:0].new_zeros(s)) for n, s in shapes.items()), "buffer_names": [],
                "optimizer": None, "param_shapes": [shapes], "frozen_param_shapes": {}, "shared_params": {},
                "frozen_param_fragments": {}, "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
                "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 5, "global_samples": 10,
                "dp_world_size": ranks, "mp_world_size": 1, "ds_config": cfg, "ds_version": "0.18.9"},
               os.path.join(tag, "mp_rank_00_model_states.pt"))
    for r in range(ranks):
        lo = r * size
        pad = max(0, lo + size - total)
        part = flat[lo : lo + size]
        state = {"step": torch.tensor(5.0), "exp_avg": part * 0.1, "exp_avg_sq": part.abs() * 0.01}
        opt = {"loss_scaler": ds["deepspeed.runtime.fp16.loss_scaler"].LossScaler(1.0), "dynamic_loss_scale": False,
               "overflow": False, "clip_grad": 0.0,
               "base_optimizer_state": {"state": {0: state}, "param_groups": [
                   {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                    "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                    "decoupled_weight_decay": True, "params": [0]}]},
               "single_partition_of_fp32_groups": [part[: size - pad].clone()],
               "zero_stage": ds["deepspeed.runtime.zero.config"].ZeroStageEnum.gradients, "group_paddings": [pad],
               "partition_count": [ranks], "ds_version": "0.18.9",
               "param_slice_mappings": [OrderedDict(
                   (n, ds["deepspeed.utils.tensor_fragment"].fragment_address(1, 0)) for n in shapes)]}
        torch.save({"optimizer_state_dict": opt, "ds_config": cfg, "ds_version": "0.18.9"},
                   os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step5")
    torch.save(flat[:total].clone(), os.path.join(root, "expected_flat.pt"))
    return size


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _measure_load(rank: int, world: int, root: str) -> dict:
    import gc

    import zeroshard

    torch.manual_seed(1)
    engine = zeroshard.initialize(Wide(), {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    gc.collect()
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    engine.load_checkpoint(root)
    peak, after = _kib("VmHWM"), _kib("VmRSS")
    expected = torch.load(os.path.join(root, "expected_flat.pt"), weights_only=True)
    got = torch.cat([v.flatten() for v in engine.full_state_dict().values()])
    engine.close()
    return {"before": before, "after": after, "peak": peak, "equal": bool(torch.equal(got, expected))}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs (VmHWM reset)")
def test_peak_memory_of_a_load(tmp_path):
    """Loading a 2-rank DeepSpeed checkpoint (8.4M parameters, 48 MiB per rank file) into one
    rank holds, beyond the state it ends with (the engine as built plus the Adam states the
    load creates), at most one DeepSpeed rank's partition (fp32 master + 2 Adam states) plus
    one tensor (the largest parameter, 4 MiB) and 8 MiB of slack. Measured as the peak RSS
    (VmHWM, reset just before the load) of a fresh process."""
    root = str(tmp_path / "wide")
    size = run_ranks(_write_wide_checkpoint, 1, root, timeout=300)[0]
    m = run_ranks(_measure_load, 1, root, timeout=300)[0]
    assert m["equal"]
    partition = 3 * 4 * size
    tensor = 4 * WIDE * WIDE
    states = 2 * 4 * (DEPTH * WIDE * WIDE + 3 * WIDE + 3)  # exp_avg + exp_avg_sq: the state the load adds
    beyond = m["peak"] - m["before"] - states
    print(f"\nload: RSS {m['before'] / 2**20:.1f} MiB before, {m['after'] / 2**20:.1f} after, peak {m['peak'] / 2**20:.1f}: "
          f"{beyond / 2**20:.1f} MiB beyond the final state (+{states / 2**20:.1f} MiB of Adam states); bound "
          f"{(partition + tensor) / 2**20:.1f} + 8 MiB (partition {partition / 2**20:.1f}, tensor {tensor / 2**20:.1f})")
    assert beyond <= partition + tensor + (8 << 20)


# -- the fixtures are still what DeepSpeed writes ----------------------------------------------------
def _deepspeed_python() -> str | None:
    """A Python that can import DeepSpeed: the separate venv /work/dsvenv (the test
    environment itself must not have it), or this one if it does."""
    venv = os.environ.get("ZEROSHARD_DEEPSPEED_PYTHON", "/work/dsvenv/bin/python")
    if os.path.isfile(venv):
        return venv
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    return None


@pytest.mark.slow
def test_fixtures_regenerate_with_deepspeed(tmp_path):
    """make_fixtures.py run again with the installed DeepSpeed (with the fp16 cases where it
    trains fp16) writes the same layout and DeepSpeed trains the same numbers: every tensor in
    the new folders reads back as the stored fixtures' do (1e-6 relative), and the recorded
    losses agree."""
    import subprocess

    from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint

    python = _deepspeed_python()
    if python is None:
        pytest.skip("DeepSpeed is not installed (neither /work/dsvenv nor an importable deepspeed)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    # the fp16 fixtures too where DeepSpeed's CPU accelerator trains fp16 (its own test, oneDNN's)
    fp16 = [f"stage{s}_fp16" for s in common.STAGES] if torch.ops.mkldnn._is_mkldnn_fp16_supported() else []
    done = subprocess.run([python, os.path.join(FIX, "make_fixtures.py"), str(tmp_path)] + (CASES + fp16 if fp16 else []),
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in CASES + fp16:
        new = json.loads((tmp_path / f"{case}.json").read_text())
        old = record(case)
        assert new["losses_before_save"] == pytest.approx(old["losses_before_save"], rel=1e-6)
        assert new["losses_after_resume"] == pytest.approx(old["losses_after_resume"], rel=1e-6)
        assert sorted(os.listdir(tmp_path / case / "global_step3")) == sorted(os.listdir(os.path.join(FIX, case, "global_step3")))
        fresh, stored = DeepSpeedCheckpoint(str(tmp_path / case)), DeepSpeedCheckpoint(os.path.join(FIX, case))
        assert fresh.meta["names"] == stored.meta["names"] and fresh.tensors == stored.tensors
        for name in stored.meta["names"]:
            fields = ["value", "optim.exp_avg", "optim.exp_avg_sq"] if stored.tensors[name]["trainable"] else ["value"]
            for field in fields:
                torch.testing.assert_close(fresh.read(name, field).float(), stored.read(name, field).float(),
                                           rtol=1e-6, atol=1e-9)
        for name, e in new["saved"].items():  # and DeepSpeed's own view of what it saved matches the files
            assert torch.equal(fresh.read(name), torch.tensor(e["value"]))


def test_fp16_loss_scale_carries_over():
    """Beside the fp16 fixtures (test_deepspeed_fp16.py): the translation of a DynamicLossScaler's
    attributes in another state (names from DeepSpeed 0.18's runtime/fp16/loss_scaler.py:
    cur_scale, cur_iter, last_overflow_iter, cur_hysteresis) into zeroshard's dynamic scaler, as
    the loader applies it."""
    from types import SimpleNamespace

    from zeroshard.checkpoint.deepspeed_reader import resume
    from zeroshard.checkpoint.deepspeed_reader.safe_load import ALLOWED, _RECORDS
    from zeroshard.checkpoint.deepspeed_reader.files import scaler_fields as _scaler_fields
    from zeroshard.optim.loss_scaler import DynamicLossScaler

    record_cls = _RECORDS["deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"]
    assert "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" in ALLOWED
    ds = record_cls.__new__(record_cls)
    ds.__setstate__({"cur_scale": 2048.0, "cur_iter": 17, "last_overflow_iter": 9, "scale_factor": 2.0,
                     "scale_window": 4, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 1,
                     "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dynamic": True,
                     "dtype": torch.float16})
    reader = SimpleNamespace(meta={"loss_scaler": _scaler_fields(ds), "skipped_steps": 3})
    ts = SimpleNamespace(loss_scaler=DynamicLossScaler(initial_scale=2.0**16, loss_scale_window=4, hysteresis=2))
    resume._load_scaler(reader, ts)
    state = ts.loss_scaler.state_dict()
    assert (state["scale"], state["iteration"], state["last_overflow_iteration"], state["hysteresis_left"],
            state["skipped_steps"]) == (2048.0, 17, 9, 1, 3)


def test_finding_the_tag():
    """A save_dir (through `latest`), a tag argument, or the tag folder itself; a zeroshard
    checkpoint or a plain folder is not taken for a DeepSpeed one."""
    from zeroshard.checkpoint.deepspeed_reader import find_deepspeed_tag

    root = os.path.join(FIX, "stage3_bf16")
    tag = os.path.join(root, "global_step3")
    assert find_deepspeed_tag(root) == tag
    assert find_deepspeed_tag(root, "global_step3") == tag
    assert find_deepspeed_tag(tag) == tag
    assert find_deepspeed_tag(root, "global_step9") is None
    assert find_deepspeed_tag(FIX) is None


def test_convert_carries_a_client_scheduler_when_named(tmp_path, capsys):
    """A client LR scheduler (a torch one passed to deepspeed.initialize) is saved by DeepSpeed as
    its state_dict() without its class: `zeroshard convert --lr-scheduler-class StepLR` carries
    that state (inert numbers) into meta.json under the named class, and the scheduler it
    restores gives the saved learning rate; without the flag it is left out, said so."""
    from zeroshard.checkpoint.reader import CheckpointReader
    from zeroshard.cli.main import main

    root = _copy("stage1_fp32", tmp_path / "client_sched")
    model_file = _tag_file(root, "mp_rank_00_model_states")
    sd = torch.load(model_file, weights_only=True)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        opt.step()
        sched.step()
    sd["lr_scheduler"] = sched.state_dict()
    del sd["ds_config"]["scheduler"]
    torch.save(sd, model_file)

    assert main(["convert", root, str(tmp_path / "plain")]) == 0
    assert "lr_scheduler (a client scheduler" in capsys.readouterr().out
    with CheckpointReader(str(tmp_path / "plain")) as r:
        assert r.meta["lr_scheduler"] is None

    assert main(["convert", root, str(tmp_path / "named"), "--lr-scheduler-class", "StepLR"]) == 0
    assert "left out" not in capsys.readouterr().out
    with CheckpointReader(str(tmp_path / "named")) as r:
        saved = r.meta["lr_scheduler"]
    assert saved["class"] == "StepLR" and saved["state"]["last_epoch"] == 5
    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    fresh = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    fresh.load_state_dict(saved["state"])
    assert fresh.get_last_lr() == sched.get_last_lr() == [0.0025]
