"""`DeepSpeedEngine`: zeroshard's Engine with the signatures DeepSpeed scripts call.

A proxy, not a second engine: training, sharding, checkpoints and ledgers are the wrapped
`zeroshard.Engine`'s; anything not defined here is looked up on it. Like DeepSpeed's it is
an `nn.Module` whose `module` is the user's model. What is defined here only translates
DeepSpeed's arguments and return values; each method says how.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import weakref
from typing import Any

from torch import nn

from zeroshard.checkpoint.deepspeed_reader import find_deepspeed_tag
from zeroshard.checkpoint.files import write_small
from zeroshard.checkpoint.format import LATEST, META, OLD_PREFIX
from zeroshard.checkpoint.reader import resolve
from zeroshard.deepspeed import comm
from zeroshard.deepspeed.config import unsupported
from zeroshard.deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from zeroshard.policies import ConfigError, Precision, Stage

log = logging.getLogger("zeroshard")

__all__ = ["DeepSpeedEngine", "live_engines"]

_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def live_engines() -> list["DeepSpeedEngine"]:
    """The engines built by `deepspeed.initialize` in this process and not yet collected."""
    return list(_LIVE)

_ONE_FILE = 2**62  # DeepSpeed writes one file: no shard size limit
_TMP_16BIT = ".zeroshard-16bit-tmp"


class DeepSpeedEngine(nn.Module):
    """What `deepspeed.initialize` returns first: an `nn.Module` whose `module` is the user's
    model (as DeepSpeed's, so `accelerate.unwrap_model` and `engine.parameters()` work).
    `engine.zeroshard` is the wrapped Engine; names not defined here are looked up on it."""

    def __init__(self, engine, training_dataloader=None, config: dict | None = None) -> None:
        super().__init__()
        self.module = engine.module  # registered: parameters(), state_dict() and unwrap see the model
        object.__setattr__(self, "zeroshard", engine)
        object.__setattr__(self, "training_dataloader", training_dataloader)
        object.__setattr__(self, "_step_applied", False)
        object.__setattr__(self, "_config", dict(config or {}))
        engine.optimizer.overflow = False  # DeepSpeed's optimizers say whether the last step was skipped
        # DeepSpeed's optimizers move their states too (OpenRLHF calls engine.optimizer.offload_states)
        engine.optimizer.offload_states, engine.optimizer.reload_states = engine.offload_states, engine.reload_states
        if engine.stage3 is not None:  # stage 3's hooks, as RLHF libraries reach them
            engine.optimizer.parameter_offload = DeepSpeedZeRoOffload(engine)
        _LIVE.add(self)

    def __getattr__(self, name: str) -> Any:  # only for names not found the normal way
        if name in ("_parameters", "_buffers", "_modules") or name.startswith("__"):
            return super().__getattr__(name)
        with contextlib.suppress(AttributeError):
            return super().__getattr__(name)  # a submodule, parameter or buffer
        engine = self.__dict__.get("zeroshard")
        if engine is None or not hasattr(engine, name):
            raise AttributeError(f"DeepSpeedEngine.{name} is not served by zeroshard.deepspeed (see "
                                 "docs/huggingface.md for what is; `zeroshard launch --real-deepspeed` runs the "
                                 "installed DeepSpeed)")
        return getattr(engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        engine = self.__dict__.get("zeroshard")
        if (engine is not None and name not in self.__dict__ and not hasattr(type(self), name)
                and not isinstance(value, (nn.Module, nn.Parameter)) and hasattr(engine, name)):
            setattr(engine, name, value)  # e.g. engine.global_steps = ...
        else:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"DeepSpeedEngine(zeroshard stage {self.zero_optimization_stage()}, {self.world_size} rank(s))"

    # -- the training loop ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.zeroshard(*args, **kwargs)

    def backward(self, loss, allreduce_gradients: bool = True, release_loss: bool = False,
                 retain_graph: bool = False, scale_wrt_gas: bool = True):
        """`scale_wrt_gas=False` (Trainer's and Accelerate's way: they divide the loss themselves)
        leaves the loss undivided by the accumulation steps."""
        if not allreduce_gradients:
            raise ConfigError("backward(allreduce_gradients=False) is not supported: zeroshard reduces "
                              "gradients at the accumulation boundary (gradient_accumulation_steps)")
        return self.zeroshard.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs: dict | None = None) -> None:
        if lr_kwargs:
            raise ConfigError("step(lr_kwargs=...) is not supported: zeroshard steps the LR scheduler "
                              "without arguments")
        engine = self.zeroshard
        boundary = engine.is_gradient_accumulation_boundary()
        skipped = engine.skipped_steps
        engine.step()
        applied = boundary and engine.skipped_steps == skipped
        object.__setattr__(self, "_step_applied", applied)
        if boundary:
            engine.optimizer.overflow = not applied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last optimizer step (the engine zeroes them
        itself after each step, as DeepSpeed's does)."""
        self.zeroshard.zero_grad()

    def was_step_applied(self) -> bool:
        """True when the last `step()` stepped the optimizer (an accumulation boundary
        without fp16 overflow), as DeepSpeed's."""
        return self._step_applied

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.zeroshard.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    def generate(self, *args, **kwargs):
        """DeepSpeed-Chat's hybrid engine: the model's `generate` with each stage-3 unit gathered once
        for all the tokens (zeroshard's `engine.generation()`), everything released after it."""
        if not (self._config.get("hybrid_engine") or {}).get("enabled"):
            raise ConfigError('engine.generate() is DeepSpeed-Chat\'s hybrid engine: add "hybrid_engine": '
                              '{"enabled": true} to the config, or call engine.module.generate(...)')
        with self.zeroshard.generation():
            return self.module.generate(*args, **kwargs)

    def train_batch(self, *args, **kwargs):
        raise ConfigError(unsupported("the pipeline engine (engine.train_batch)"))

    def eval_batch(self, *args, **kwargs):
        raise ConfigError(unsupported("the pipeline engine (engine.eval_batch)"))

    def compile(self, backend=None, compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed 0.19.8's signature: each unit / repeated block compiled in place, zeroshard's
        hooks eager around it (api/compiled.py). DeepCompile's schedules and compiled autograd
        (which would trace the gradient hooks) are refused."""
        if schedule is not None:
            raise ConfigError("engine.compile(schedule=...) is DeepCompile's pass schedule, not served by "
                              "zeroshard (it compiles each unit in place); call engine.compile() without schedule")
        if compiled_autograd_enabled:
            raise ConfigError("engine.compile(compiled_autograd_enabled=True) would trace zeroshard's gradient "
                              "hooks into the backward graph; leave it False (each unit's backward is compiled)")
        self.zeroshard.compile(backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        return self.zeroshard.is_compiled

    # -- accessors ----------------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return self.zeroshard.topology.local_rank

    @property
    def global_rank(self) -> int:
        return self.zeroshard.rank

    @property
    def dp_world_size(self) -> int:
        return self.zeroshard.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def global_samples(self) -> int:
        return self.zeroshard.global_steps * self.zeroshard.train_batch_size()

    def fp16_enabled(self) -> bool:
        return self.zeroshard.settings.precision.compute == Precision.FP16

    def bfloat16_enabled(self) -> bool:
        return self.zeroshard.settings.precision.compute == Precision.BF16

    def zero_optimization(self) -> bool:
        return self.zeroshard.settings.zero.stage != Stage.DATA_PARALLEL

    def zero_optimization_stage(self) -> int:
        return int(self.zeroshard.settings.zero.stage)

    def gradient_clipping(self) -> float:
        return self.zeroshard.settings.gradient_clipping

    def destroy(self) -> None:
        self.zeroshard.close()

    @property
    def config(self) -> dict:
        """The DeepSpeed config dict this engine was built from (Trainer reads it)."""
        return self._config

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.zeroshard.settings.zero.stage3.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The model's state dict with whole tensors in the compute dtype, on rank 0 ({} on the
        others), as DeepSpeed's. A collective: every rank calls it."""
        engine = self.zeroshard
        full = engine.full_state_dict()
        if engine.rank != 0:
            return {}
        frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
        return {name: t.to(engine.compute_dtype) if t.is_floating_point() else t for name, t in full.items()
                if not (exclude_frozen_parameters and name in frozen)}

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Every rank writes its shards under `save_dir/<tag>` (default `global_step<N>`); with
        `save_latest`, `latest` names the tag afterwards. `client_state` is stored as JSON (zeroshard
        never pickles), so it must be JSON-like. Returns True."""
        engine = self.zeroshard
        save_dir = os.fspath(save_dir)
        if exclude_frozen_parameters and engine.rank == 0:
            log.info("save_checkpoint: exclude_frozen_parameters is not supported; frozen parameters are saved too")
        latest = os.path.join(save_dir, LATEST)
        previous = None
        if not save_latest and engine.rank == 0 and os.path.isfile(latest):
            with open(latest, "rb") as f:
                previous = f.read()
        engine.save_checkpoint(save_dir, None if tag is None else str(tag), client_state or {})
        if not save_latest:
            if engine.rank == 0:  # zeroshard always moves `latest`: put it back as it was
                if previous is not None:
                    write_small(latest, previous)
                elif os.path.isfile(latest):
                    os.remove(latest)
            comm.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Load a checkpoint saved at any world size and stage, zeroshard's own or a folder DeepSpeed
        wrote; returns `(path, client_state)`, or `(None, None)` with a warning when `load_dir` has
        no such checkpoint (as DeepSpeed)."""
        engine = self.zeroshard
        if custom_load_fn is not None:
            raise ConfigError("load_checkpoint(custom_load_fn=...) is not supported: zeroshard reads its own "
                              "safetensors checkpoints")
        load_dir = os.fspath(load_dir)
        tag = None if tag is None else str(tag)
        ds_tag = find_deepspeed_tag(load_dir, tag)
        if ds_tag is None and _nothing_to_load(load_dir, tag):
            if engine.rank == 0:
                where = os.path.join(load_dir, tag) if tag is not None else os.path.join(load_dir, LATEST)
                log.warning("load_checkpoint: %s does not exist; no checkpoint loaded", where)
            return None, None
        if not load_module_strict and engine.rank == 0:
            log.info("load_checkpoint: load_module_strict=False is accepted, but zeroshard still requires the "
                     "checkpoint's parameter names and shapes to match the model")
        path = resolve(load_dir, tag) if ds_tag is None else _deepspeed_model_file(ds_tag)
        counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps)
        if load_module_only:
            load_optimizer_states = load_lr_scheduler_states = False
        client = engine.load_checkpoint(load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
        if load_module_only:  # DeepSpeed keeps the engine's step counters too
            engine.global_steps, engine.micro_steps, engine.skipped_steps = counters
        return path, client

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The weights in the compute dtype (fp32 training: fp32) as one safetensors file in
        `save_dir`, written by rank 0; call on every rank. Returns True.

        zeroshard never writes pickles: a `save_filename` not ending in `.safetensors` (DeepSpeed's
        default `pytorch_model.bin`) is written as `model.safetensors`, which `transformers`'
        `from_pretrained` and `safetensors.torch.load_file` read."""
        engine = self.zeroshard
        if exclude_frozen_parameters:
            raise ConfigError("save_16bit_model(exclude_frozen_parameters=True) is not supported: zeroshard "
                              "writes every weight of the model")
        save_dir = os.fspath(save_dir)
        target = save_filename if save_filename.endswith(".safetensors") else "model.safetensors"
        if target != save_filename and engine.rank == 0:
            log.warning("save_16bit_model: zeroshard writes safetensors, never a pickle: %s instead of %s "
                        "(load it with safetensors.torch.load_file or transformers' from_pretrained)",
                        os.path.join(save_dir, target), save_filename)
        tmp = os.path.join(save_dir, _TMP_16BIT)
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        written = engine.save_16bit_model(tmp, max_shard_size=_ONE_FILE)
        if engine.rank == 0:
            for name in written:
                os.replace(os.path.join(tmp, name), os.path.join(save_dir, target if name == "model.safetensors"
                                                                  else name))
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        return True

    # DeepSpeed's older name
    save_fp16_model = save_16bit_model


def _deepspeed_model_file(tag_dir: str) -> str:
    """What DeepSpeed's load_checkpoint returns as its path: the rank-0 model-states file."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(tag_dir, name)):
            return os.path.join(tag_dir, name)
    return tag_dir


def _nothing_to_load(load_dir: str, tag: str | None) -> bool:
    """No zeroshard checkpoint at `load_dir` (a DeepSpeed one is looked for first)."""
    if not os.path.isdir(load_dir):
        return True
    if tag is None:
        return not (os.path.isfile(os.path.join(load_dir, LATEST)) or os.path.isfile(os.path.join(load_dir, META)))
    return not (os.path.isdir(os.path.join(load_dir, tag)) or os.path.isdir(os.path.join(load_dir, OLD_PREFIX + tag)))
