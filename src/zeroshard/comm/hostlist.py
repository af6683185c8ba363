"""Slurm's compressed host lists, expanded as `scontrol show hostnames` does, without scontrol.

    node[03-04,07],gpu-a[1-2]  ->  node03 node04 node07 gpu-a1 gpu-a2
    rack[1-2]-n[01-02]         ->  rack1-n01 rack1-n02 rack2-n01 rack2-n02

A list is comma-separated at the top level (commas inside brackets separate ranges). A bracket
holds numbers and `lo-hi` ranges; a range keeps the zero padding of its lower bound (`[08-10]`
is 08 09 10). Several brackets in one name expand as a product, leftmost slowest, as Slurm's
hostlist does. Also `SLURM_TASKS_PER_NODE`'s `2(x3),1` form. Pure functions, no torch.
"""

from __future__ import annotations

import itertools
import re

from zeroshard.policies import ConfigError

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_MAX_HOSTS = 1 << 20  # a typo such as node[1-999999999] stops here, not after exhausting memory


def _split_top_level(text: str, where: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"{where}={text!r}: nested '[' at position {i}; a Slurm host list looks like "
                                  "node[01-04,07],gpu[1-2]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{where}={text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"{where}={text!r}: '[' without ']'")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_bracket(body: str, text: str, where: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ConfigError(f"{where}={text!r}: [{body}] holds {part!r}, which is not a number or a range lo-hi")
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ConfigError(f"{where}={text!r}: range {part} runs backwards")
        if hi - lo >= _MAX_HOSTS:
            raise ConfigError(f"{where}={text!r}: range {part} names more than {_MAX_HOSTS} hosts")
        width = len(lo_text) if lo_text.startswith("0") and len(lo_text) > 1 else 0
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def _expand_item(item: str, text: str, where: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", item)  # literal, bracket, literal, bracket, ..., literal
    choices = [[p] if i % 2 == 0 else _expand_bracket(p, text, where) for i, p in enumerate(pieces)]
    count = 1
    for c in choices:
        count *= len(c)
    if count > _MAX_HOSTS:
        raise ConfigError(f"{where}={text!r}: {item} names more than {_MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(text: str, where: str = "host list") -> list[str]:
    """The host names of a Slurm host list, in Slurm's order (`where` names the variable in errors)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip(), where):
        hosts += _expand_item(item, text, where)
    if not hosts:
        raise ConfigError(f"{where}={text!r} names no host")
    return hosts


def expand_tasks_per_node(text: str, where: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: the tasks on each node of the step, in node order."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"{where}={text!r}: {part!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
