"""`zeroshard estimate` / `plan`: the workload flags left out give the estimator's own
`Workload` defaults (declared once, in estimate/), for both commands."""

from __future__ import annotations

import argparse

import pytest

from zeroshard.cli import estimate_cmd, plan_cmd
from zeroshard.estimate import Workload


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_flags_left_out_are_workloads_defaults(command):
    parser = argparse.ArgumentParser(prog="zeroshard")
    sub = parser.add_subparsers(dest="command")
    estimate_cmd.register(sub)
    plan_cmd.register(sub)
    args = parser.parse_args([command, "--params", "7B"])
    assert estimate_cmd.read_workload(args) == Workload()
