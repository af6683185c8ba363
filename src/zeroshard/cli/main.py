"""`zeroshard` command line: one sub-command per module `zeroshard.cli.<name>_cmd` (train and
bench: their packages' `command` modules, `PACKAGED`).

Each such module defines `register(subparsers)`, which adds its parser and sets
`func(args) -> int` as the parser default. Modules are imported only when listed
here, so a broken sub-command cannot break the others' help.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("train", "launch", "estimate", "plan", "bench", "export", "inspect", "convert")
PACKAGED = {"train": "zeroshard.cli.train.command", "bench": "zeroshard.bench.command"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="ZeRO training for PyTorch: train, launch your script, estimate memory/communication, plan a config.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(PACKAGED.get(name, f"zeroshard.cli.{name}_cmd")).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
