"""engine.compile() (issue 44): each stage-3 unit / repeated block compiled in place, zeroshard's
hooks eager around it. On 2 gloo ranks, a compiled run equals the eager run of the same config
(fp32, SGD, 5 steps: parameters within 1e-5 of their largest entry, losses within 1e-5 relative),
with 0 graph breaks inside the compiled regions and 0 graphs compiled after the first step.
The default run (stage 3 with mode switches, the graph-break note, the drop-in engine) uses
backend "aot_eager" (dynamo + AOT autograd, no codegen: fast on 2 shared cores); the slow forms
use inductor at every stage and combination, plus aot_eager for stage 0 and for blocks compiled
whole after initialize (Accelerate's regional compilation)."""

from __future__ import annotations

import pytest
import torch

from distributed import one_group, run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model, run_steps, sgd_close

WORLD = 2


def _train(case: Case, rank: int, cfg: dict, compile_with: str | None, probe: bool = False):
    import zeroshard
    from torch._dynamo.utils import counters

    model = make_model(case)
    if case.model == "gpt" and dict(case.zero).get("ckpt"):
        model.checkpoint_blocks = True
    engine = zeroshard.initialize(model, cfg)
    if compile_with:
        torch._dynamo.reset()
        counters.clear()
        if compile_with.startswith("regional:"):  # Accelerate's regional compilation, after initialize
            for block in model.h:
                block.compile(backend=compile_with.split(":")[1])
        else:
            engine.compile(backend=compile_with)
    first: list[int] = []  # unique graphs after the first step
    losses = run_steps(engine, case, rank, WORLD,
                       lambda step: first.append(counters["stats"]["unique_graphs"]) if step == 0 else None)
    graphs_after_first = first[0] if first else None
    out = {"losses": losses, "state": engine.full_state_dict()}
    if compile_with:
        report = engine.compiled
        out.update(graphs_first=graphs_after_first, graphs_end=counters["stats"]["unique_graphs"],
                   breaks=sum(counters["graph_break"].values()),
                   regions=list(report.names) if report else [i for i, m in enumerate(model.h) if "forward" in m.__dict__ or m._compiled_call_impl is not None],
                   noted=dict(report.breaks) if report else {}, first_s=report.first_step_s if report else 1.0)
        if probe:  # eval and no_grad, then training again: each mode compiles once, then hits its cache
            engine.eval()
            x, y = batch(case, 99, WORLD)
            for _ in range(2):
                with torch.no_grad():
                    loss_of(engine, x[:MICRO], y[:MICRO])
                graphs_eval = counters["stats"]["unique_graphs"]
            engine.train()
            for _ in range(2):
                engine.backward(loss_of(engine, x[:MICRO], y[:MICRO]))
                engine.step()
            out.update(graphs_eval=graphs_eval, graphs_switch=counters["stats"]["unique_graphs"])
    engine.close()
    return out


def _worker(rank, world_size, case, backend, probe):
    cfg = config_for(case, world_size)
    if dict(case.zero).get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if case.stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"] = {k: v for k, v in cfg["zero_optimization"].items() if k not in ("ckpt", "offload")}
    with one_group():
        eager = _train(case, rank, cfg, None)
        compiled = _train(case, rank, cfg, backend, probe)
    return eager, compiled


def _check(case: Case, backend: str, probe: bool = False) -> None:
    for eager, compiled in run_ranks(_worker, WORLD, case, backend, probe, timeout=600):
        assert compiled["regions"], "nothing was compiled"
        assert compiled["breaks"] == 0 and not compiled["noted"], compiled["noted"]
        assert compiled["graphs_first"] > 0, "no graph was compiled in the first step"
        assert compiled["graphs_end"] == compiled["graphs_first"], \
            f"recompiled after step 1: {compiled['graphs_first']} -> {compiled['graphs_end']} graphs"
        assert compiled["first_s"] is not None and compiled["first_s"] > 0
        for a, b in zip(eager["losses"], compiled["losses"]):
            assert abs(a - b) <= 1e-5 * abs(a), (eager["losses"], compiled["losses"])
        bad = sgd_close(compiled["state"], eager["state"])
        assert not bad, bad
        if probe:
            assert compiled["graphs_switch"] == compiled["graphs_eval"], "training again after eval recompiled"


# small parameters kept whole, the rest in per-block units (the tiny GPT's are all under DeepSpeed's
# default persistence threshold)
Z3 = (("stage3_param_persistence_threshold", 64),)


def test_compiled_stage3_equals_eager_with_mode_switches():
    _check(Case(stage=3, zero=Z3), "aot_eager", probe=True)


@pytest.mark.slow
def test_blocks_compiled_whole_after_initialize_keep_the_hooks_out():
    """Accelerate's regional compilation (`block.compile()` on each block after initialize): stage 3
    takes each unit's compile context over to its forward, so the hooks stay out: 0 breaks."""
    _check(Case(stage=3, zero=Z3, steps=3), "regional:aot_eager")


@pytest.mark.slow
def test_compiled_stage0_equals_eager():
    _check(Case(stage=0), "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    Case(stage=0), Case(stage=1), Case(stage=2), Case(stage=3),
    Case(stage=2, zero=(("offload", True),)), Case(stage=3, zero=(("offload", True),)),
    Case(stage=3, zero=(("ckpt", True),)), Case(stage=1, zero=(("ckpt", True),)),
    Case(stage=3, gas=2), Case(stage=2, gas=2),
], ids=["z0", "z1", "z2", "z3", "z2-offload", "z3-offload", "z3-ckpt", "z1-ckpt", "z3-gas2", "z2-gas2"])
def test_compiled_equals_eager_inductor(case):
    _check(case, "inductor")


class _Breaking(torch.nn.Module):
    """A block whose forward reads a value on the host (`.item()`): dynamo breaks its graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * 2 if h.sum().item() > 0 else h


class _BreakingNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Breaking() for _ in range(2))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return x, torch.nn.functional.mse_loss(x, y)


def _breaking_worker(rank, world_size):
    import zeroshard

    with one_group():
        torch.manual_seed(0)
        engine = zeroshard.initialize(_BreakingNet(), {
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 1}})
        engine.compile(backend="aot_eager")
        x = torch.randn(2, 8)
        engine.backward(engine(x, x)[1])
        engine.step()
        noted = dict(engine.compiled.breaks)
        engine.close()
    return noted


def test_a_graph_break_inside_a_block_is_noted_with_its_module():
    for noted in run_ranks(_breaking_worker, WORLD, timeout=300):
        assert set(noted) == {"blocks.0", "blocks.1"}, noted  # each region's first call is examined
        assert all(any("item()" in r for r in reasons) for reasons in noted.values()), noted


def _dropin_worker(rank, world_size):
    import zeroshard.deepspeed as deepspeed
    from zeroshard.policies import ConfigError

    case = Case(stage=2, steps=2)
    out = {}
    with one_group():
        for how in ("eager", "config", "call"):
            cfg = config_for(case, world_size)
            if how == "config":  # the compile section compiles at initialize
                cfg["compile"] = {"enabled": True, "backend": "aot_eager", "deepcompile": False}
            engine, *_ = deepspeed.initialize(model=make_model(case), config=cfg)
            if how == "call":
                try:
                    engine.compile(backend="aot_eager", schedule=[(0, ["prefetch"])])
                except ConfigError as e:
                    out["refused"] = str(e)
                engine.compile(backend="aot_eager", compile_kwargs={"fullgraph": True})
            losses = []
            for step in range(case.steps):
                x, y = batch(case, step, WORLD)
                loss = loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[how] = (engine.is_compiled, losses)
            engine.destroy()
    return out


def test_dropin_engine_compiles_from_the_call_and_from_the_config():
    for out in run_ranks(_dropin_worker, WORLD, timeout=300):
        assert out["eager"][0] is False and out["config"][0] is True and out["call"][0] is True
        assert out["config"][1] == pytest.approx(out["eager"][1], rel=1e-5)
        assert out["call"][1] == pytest.approx(out["eager"][1], rel=1e-5)
        assert "schedule" in out["refused"] and "DeepCompile" in out["refused"]
