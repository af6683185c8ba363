"""Drop-in for DeepSpeed training scripts: change one line,

    import deepspeed                           # before
    import zeroshard.deepspeed as deepspeed    # after

and keep the config, the arguments (`add_config_arguments`) and the launch command
(`zeroshard launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json`).
A thin layer over zeroshard's own API: `initialize` returns DeepSpeed's 4-tuple around a
`zeroshard.Engine`. Scripts that import `deepspeed` themselves (or whose libraries do:
Hugging Face Trainer, Accelerate) run unchanged under `zeroshard launch`, which serves this
package as `deepspeed` (shadow.py; docs/huggingface.md). What differs on purpose, and what
is not supported (pipeline engine, MoE, model parallelism), is in docs/deepspeed-migration.md.
"""

from zeroshard.deepspeed import accelerator, checkpoint, checkpointing, comm, moe, ops, pipe, runtime, utils, zero
from zeroshard.deepspeed.args import add_config_arguments
from zeroshard.deepspeed.comm import init_distributed
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.initialize import initialize
from zeroshard.deepspeed.shadow import SERVED_VERSION, not_served

__version__ = SERVED_VERSION

__all__ = ["DeepSpeedEngine", "__version__", "accelerator", "add_config_arguments", "checkpoint", "checkpointing",
           "comm", "init_distributed", "initialize", "moe", "ops", "pipe", "runtime", "utils", "zero"]


def __getattr__(name: str):
    """A DeepSpeed name zeroshard does not serve: one error naming it (an AttributeError, so
    `hasattr(deepspeed, name)` stays False)."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(not_served(f"deepspeed.{name}"))
