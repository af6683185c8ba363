"""`add_config_arguments`: the command-line flags DeepSpeed scripts parse."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags to `parser` and return it, as `deepspeed.add_config_arguments` does:
    `--deepspeed` (a flag scripts test), `--deepspeed_config PATH` (read by `initialize(args=...)`),
    `--deepspeed_mpi` (accepted; the process group comes from torchrun's environment), and the
    deprecated `--deepscale` / `--deepscale_config` spellings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by zeroshard)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; zeroshard runs it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    group.add_argument("--deepspeed_mpi", default=False, action="store_true",
                       help="accepted for compatibility: ranks are found from torchrun's environment")
    return parser
