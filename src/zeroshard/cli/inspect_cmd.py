"""`zeroshard inspect CKPT`: what a checkpoint holds, with every file's sha256 verified.

CKPT may also be a checkpoint DeepSpeed wrote (its files checked by their CRC-32).

Prints the step, world size, stage and optimizer it was saved with, the bucket
layout, and each rank file's size and checksum status. Exits 1 when a file fails
its check, 2 when CKPT is not a readable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

MAX_ROWS = 24  # bucket rows shown; the rest are summed in one row


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="show a checkpoint's layout, step and sizes; verify checksums",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="the checkpoint directory (uses `latest`) or one tag directory")
    p.add_argument("--tag", help="tag to inspect (default: the one `latest` names)")
    p.add_argument("--no-verify", action="store_true", help="skip reading the files to check sha256")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def run(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import inspect
    from zeroshard.policies import ZeroShardError

    try:
        r = inspect(args.ckpt, tag=args.tag, verify=not args.no_verify)
    except ZeroShardError as exc:
        print(f"zeroshard inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=1))
        return 0 if r["ok"] else 1
    console = Console(width=max(100, Console().width))
    console.print(f"[bold]{r['dir']}[/bold]  tag {r['tag']}: step {r['global_steps']} "
                  f"({r['skipped_steps']} skipped), {r['world_size']} rank(s), stage {r['stage']}, "
                  f"compute {r['compute_dtype']}, {r['optimizer']} ({', '.join(r['optimizer_states']) or 'no state'})"
                  f"{', scheduler ' + r['lr_scheduler'] if r['lr_scheduler'] else ''}")
    if r.get("format") == "deepspeed":
        console.print(f"written by DeepSpeed {r['deepspeed_version']}: loads as it is (engine.load_checkpoint) or "
                      "after `zeroshard convert`; files checked by their zip records' CRC-32 (DeepSpeed records no "
                      "sha256); buckets are DeepSpeed's flat groups (stage 3: sub-groups)")
    tied = ", ".join(f"{a} = {c}" for a, c in r["tied"].items()) or "none"
    console.print(f"parameters {r['parameters']:,} ({r['trainable_parameters']:,} trainable); tied: {tied}")
    layout = Table(title="layout", title_justify="left")
    for col in ("bucket", "dtype", "group", "params", "elements", "padded", "shards", "values"):
        layout.add_column(col, justify="left" if col in ("dtype", "values") else "right")
    for b in r["buckets"][:MAX_ROWS]:
        layout.add_row(str(b["bucket"]), b["dtype"], str(b["group"]), str(b["params"]), f"{b['numel']:,}",
                       f"{b['padded_numel']:,}", str(b["shards"]), b["fields"][0])
    if len(r["buckets"]) > MAX_ROWS:
        rest = r["buckets"][MAX_ROWS:]
        layout.add_row(f"+{len(rest)}", "", "", str(sum(b["params"] for b in rest)),
                       f"{sum(b['numel'] for b in rest):,}", f"{sum(b['padded_numel'] for b in rest):,}", "", "")
    console.print(layout)
    files = Table(title=f"files ({_size(r['bytes'])})", title_justify="left")
    for col in ("file", "rank", "size", "sha256", "check"):
        files.add_column(col, justify="right" if col in ("rank", "size") else "left")
    for f in r["files"]:
        check = "[green]ok[/green]" if f["check"] == "ok" else f["check"] if f["check"] == "not checked" \
            else f"[red]{f['check']}[/red]"
        files.add_row(f["file"], str(f["rank"]), _size(f["bytes"]), f["sha256"][:16] + "…" if f["sha256"] else "-", check)
    console.print(files)
    return 0 if r["ok"] else 1
