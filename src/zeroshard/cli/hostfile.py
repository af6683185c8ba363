"""DeepSpeed's hostfile and its --include/--exclude/--num_nodes/--num_gpus, with DeepSpeed's meanings.

    worker-0 slots=4        # a host and its slots (devices, or ranks on CPU)
    worker-1 slots=4

--include worker-0@worker-1:0,2  every slot of worker-0, slots 0 and 2 of worker-1
--exclude worker-1:0             every slot but slot 0 of worker-1; `--exclude worker-1`: not that host
--num_nodes N                    the first N hosts of the file
--num_gpus G                     slots 0..G-1 of every host

Hosts keep the file's order (rank order). Pure functions: the problems are returned as
HostfileError, with the line or name at fault and what to write instead.
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["HostfileError", "active_resources", "parse_hostfile", "parse_node_spec"]

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


class HostfileError(ValueError):
    """A hostfile or --include/--exclude that cannot be used, said in one line."""


def parse_hostfile(text: str, where: str = "hostfile") -> "OrderedDict[str, int]":
    """`host slots=N` per line; `#` comments and blank lines skipped."""
    pool: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise HostfileError(f"{where}, line {number}: {raw.strip()!r} is not `HOST slots=N` "
                                "(DeepSpeed's hostfile format, e.g. `worker-0 slots=8`)")
        host, slots = m.group(1), int(m.group(2))
        if host in pool:
            raise HostfileError(f"{where}, line {number}: {host} is listed twice; give each host one line")
        if slots < 1:
            raise HostfileError(f"{where}, line {number}: {host} has slots={slots}; a host needs at least one slot")
        pool[host] = slots
    if not pool:
        raise HostfileError(f"{where} lists no host; write one `HOST slots=N` line per node")
    return pool


def parse_node_spec(spec: str, flag: str) -> "OrderedDict[str, list[int]]":
    """`worker-0@worker-1:0,2` -> {worker-0: [], worker-1: [0, 2]} ([]: every slot)."""
    out: OrderedDict[str, list[int]] = OrderedDict()
    for part in spec.split("@"):
        if not part.strip():
            continue
        host, _, slots = part.strip().partition(":")
        try:
            chosen = sorted({int(s) for s in slots.split(",") if s.strip()}) if slots else []
        except ValueError:
            raise HostfileError(f"{flag} {spec}: slots of {host} must be integers, e.g. {host}:0,2") from None
        out[host] = sorted(set(out.get(host, [])) | set(chosen))
    if not out:
        raise HostfileError(f"{flag} {spec!r} names no host; write HOST[:SLOT,...][@HOST...]")
    return out


def active_resources(pool: "OrderedDict[str, int]", include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> "OrderedDict[str, list[int]]":
    """The slots the job runs on, per host, in the hostfile's order."""
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise HostfileError("--include/--exclude cannot be combined with --num_nodes/--num_gpus (as with deepspeed)")
    active: OrderedDict[str, list[int]] = OrderedDict((h, list(range(n))) for h, n in pool.items())
    spec, flag = (include, "--include") if include else (exclude, "--exclude")
    if spec:
        chosen = parse_node_spec(spec, flag)
        for host, slots in chosen.items():
            if host not in pool:
                raise HostfileError(f"{flag} {spec}: {host} is not in the hostfile (hosts: {', '.join(pool)})")
            missing = [s for s in slots if s >= pool[host]]
            if missing:
                raise HostfileError(f"{flag} {spec}: {host} has slots 0..{pool[host] - 1}, no slot {missing[0]}")
        if include:
            active = OrderedDict((h, chosen[h] or list(range(pool[h]))) for h in pool if h in chosen)
        else:
            for host, slots in chosen.items():
                active[host] = [s for s in active[host] if slots and s not in slots]
            active = OrderedDict((h, s) for h, s in active.items() if s)
    if num_nodes > 0:
        if num_nodes > len(active):
            raise HostfileError(f"--num_nodes {num_nodes} but the hostfile lists {len(active)} host(s)")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        short = [h for h in active if pool[h] < num_gpus]
        if short:
            raise HostfileError(f"--num_gpus {num_gpus} but {short[0]} has slots={pool[short[0]]} in the hostfile")
        active = OrderedDict((h, list(range(num_gpus))) for h in active)
    if not active:
        raise HostfileError(f"{flag} {spec} leaves no slot to run on")
    return active
