"""No setting is accepted without effect.

Every field of zeroshard's policies (what the loader turns a config into) is read by code that
acts on it: an attribute read somewhere in src/zeroshard outside config/, not counting reads
inside f-strings (a start-up line that prints a value is not an effect). A DeepSpeed key that
zeroshard accepts but does not act on maps to no policy field and gets a note instead; the
cases below check a few of those notes (stage 0's bucket keys, the offload keys that switch
nothing) and that a policy field nothing reads fails the walk.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import zeroshard
import zeroshard.policies.settings as settings_module
from zeroshard.config import load_config

SRC = pathlib.Path(zeroshard.__file__).parent


def attribute_reads(root: pathlib.Path = SRC) -> dict[str, set[str]]:
    """Attribute name -> files reading it (outside config/ and f-strings)."""
    reads: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("config/"):
            continue
        tree = ast.parse(path.read_text())
        printed = {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in printed:
                reads.setdefault(node.attr, set()).add(rel)
    return reads


def unread_fields(module, reads: dict[str, set[str]]) -> list[str]:
    out = []
    for name in dir(module):
        cls = getattr(module, name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__:
            out += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if f.name not in reads]
    return sorted(out)


def test_every_policy_field_is_read_by_code_that_acts_on_it():
    assert unread_fields(settings_module, attribute_reads()) == []


def test_the_walk_finds_a_field_nothing_reads():
    @dataclasses.dataclass(frozen=True)
    class Planted:
        max_in_cpu: int = 1

    module = type(settings_module)("planted")
    Planted.__module__ = "planted"
    module.Planted = Planted
    assert unread_fields(module, attribute_reads()) == ["Planted.max_in_cpu"]
    assert unread_fields(module, {"max_in_cpu": {"x.py"}}) == []


@pytest.mark.parametrize("zero,words", [
    ({"stage": 0, "reduce_scatter": True, "allgather_bucket_size": 5e8, "contiguous_gradients": True},
     "ignored at stage 0: zero_optimization.reduce_scatter, zero_optimization.allgather_bucket_size, "
     "zero_optimization.contiguous_gradients"),
    ({"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 1e9}}, "offload_param.max_in_cpu: zeroshard keeps"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "fast_init": False}}, "offload_optimizer.fast_init: zeroshard"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "pipeline_read": True}}, "offload_optimizer.pipeline_read:"),
])
def test_accepted_keys_without_effect_are_noted(zero, words):
    notes = load_config({"zero_optimization": zero}, 2).notes
    assert any(words in n for n in notes), notes


def test_stage_0_keys_that_act_are_not_noted():
    """reduce_bucket_size sizes stage 0's all-reduce buckets and overlap_comm overlaps them."""
    notes = " ".join(load_config({"zero_optimization": {"stage": 0, "reduce_bucket_size": 1000,
                                                        "overlap_comm": True}}, 2).notes)
    assert "reduce_bucket_size" not in notes and "overlap_comm" not in notes
