"""What a DeepSpeed checkpoint carries besides tensors, applied to a zeroshard run: the
optimizer's class and hyperparameters, LR scheduler and loss scaler (load_checkpoint sets the
step counters, as for a zeroshard checkpoint).

DeepSpeed does not save random number generator states in its checkpoints (its users do,
beside them), so the ranks keep theirs.
"""

from __future__ import annotations

import logging
import warnings

from zeroshard.checkpoint.deepspeed_reader.files import ADAM_FAMILY
from zeroshard.checkpoint.deepspeed_reader.reader import DeepSpeedCheckpoint
from zeroshard.policies import CheckpointError

log = logging.getLogger("zeroshard")

_DS_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def check_optimizer(reader: DeepSpeedCheckpoint, ts) -> None:
    saved = reader.meta["optimizer"]
    current = type(ts.optimizer.optimizer).__name__
    same = saved["class"] == current or (saved["class"] in ADAM_FAMILY and current in ADAM_FAMILY)
    if not same:
        raise CheckpointError(f"{reader.dir}: optimizer states are for {saved['class']}, the engine runs {current}; "
                              "pass load_optimizer_states=False to load only the weights")
    if saved["class"] != current and saved["class"] in ADAM_FAMILY and ts.rank == 0:
        log.info("loading %s states saved by DeepSpeed into %s (the same step, exp_avg and exp_avg_sq)",
                 saved["class"], current)
    groups = len(ts.optimizer.param_groups)
    if saved["param_groups"] and len(saved["param_groups"]) != groups:
        raise CheckpointError(f"{reader.dir}: {len(saved['param_groups'])} optimizer param groups saved by DeepSpeed, "
                              f"the engine has {groups}; pass load_optimizer_states=False to load only the weights")
    if not saved["param_groups"]:  # elastic checkpoints keep no hyperparameters: the engine's stay
        reader.meta["optimizer"]["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in ts.optimizer.param_groups]


def apply_training_state(reader: DeepSpeedCheckpoint, ts, optimizer_states: bool, scheduler_states: bool) -> None:
    meta = reader.meta
    if optimizer_states and meta.get("loss_scaler"):
        _load_scaler(reader, ts)
    sched, saved = ts.lr_scheduler, meta.get("lr_scheduler")
    if scheduler_states and sched is not None and saved is not None:
        _load_scheduler(reader, sched, saved, ts)
    if ts.rank == 0:
        log.info("DeepSpeed checkpoint %s (DeepSpeed %s, stage %d, %d rank(s)) loaded at step %d; DeepSpeed saves no "
                 "random number generator states: each rank keeps its own", reader.dir, meta["deepspeed_version"],
                 meta["stage"], meta.get("dp_world_size", meta["world_size"]), meta["global_steps"])


def _load_scaler(reader: DeepSpeedCheckpoint, ts) -> None:
    ds = reader.meta["loss_scaler"]
    scaler = ts.loss_scaler
    state = dict(scaler.state_dict())
    state["scale"] = float(ds.get("cur_scale", state.get("scale", 1.0)))
    state["skipped_steps"] = int(reader.meta["skipped_steps"])
    state["consecutive_skips"] = 0
    if "iteration" in state and "cur_iter" in ds:  # both dynamic
        state["iteration"] = int(ds["cur_iter"])
        state["last_overflow_iteration"] = int(ds.get("last_overflow_iter", -1))
        state["hysteresis_left"] = int(ds.get("cur_hysteresis", state["hysteresis_left"]))
    scaler.load_state_dict(state)


def _load_scheduler(reader: DeepSpeedCheckpoint, sched, saved: dict, ts) -> None:
    ds_class, state = saved.get("class"), saved.get("state")
    mine = type(sched).__name__
    if isinstance(state, dict) and set(state) == {"last_batch_iteration"} and mine in _DS_SCHEDULES:
        if ds_class is not None and ds_class != mine:
            raise CheckpointError(f"{reader.dir}: the LR scheduler state is for DeepSpeed's {ds_class}, the engine runs "
                                  f"{mine}; pass load_lr_scheduler_states=False")
        sched.last_epoch = int(state["last_batch_iteration"]) + 1  # zeroshard: last_batch_iteration = last_epoch - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched._last_lr = list(sched.get_lr())
    elif isinstance(state, dict) and set(state) <= set(sched.state_dict()) and ds_class in (None, mine):
        sched.load_state_dict(state)  # a client's torch scheduler, saved by DeepSpeed as its state dict
    else:
        raise CheckpointError(f"{reader.dir}: the LR scheduler state saved by DeepSpeed "
                              f"({ds_class or 'a client scheduler'}: "
                              f"{sorted(state) if isinstance(state, dict) else type(state).__name__}) does not fit the "
                              f"engine's {mine}; pass load_lr_scheduler_states=False")
    for group, lr in zip(ts.optimizer.param_groups, sched.get_last_lr()):
        group["lr"] = lr
