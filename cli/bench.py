"""`engram bench`: offline benchmarks of the cache policy (no daemon needed)."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.table import Table

from engram.errors import InvalidArgument

from .common import EXIT_BAD_INPUT, console, fail

bench_app = typer.Typer(help="Benchmarks of the cache policy.", no_args_is_help=True)


@bench_app.command("trace")
def trace(
    file: Annotated[str, typer.Argument(help="Mooncake JSONL trace, or Engram's session format.")],
    capacity: Annotated[str, typer.Option(help="Capacities in blocks, comma-separated.")] = "256,1024,4096",
    block_bytes: Annotated[int, typer.Option(help="Bytes of one block, for bytes moved.")] = 512 * 890,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Replay a trace: prefix-contiguous hit ratio and bytes moved, Engram's policy against LRU and Belady."""
    from rich.progress import Progress

    from engram.trace import read_trace, replay_all  # numpy and the policies: loaded only when run
    try:
        caps = [int(c) for c in capacity.split(",") if c.strip()]
    except ValueError:
        raise fail(f"--capacity takes block counts like 256,1024, got {capacity!r}", EXIT_BAD_INPUT) from None
    if not caps or min(caps) <= 0:
        raise fail("--capacity needs at least one positive block count", EXIT_BAD_INPUT)
    try:
        requests = read_trace(file)
    except (OSError, InvalidArgument) as exc:
        raise fail(f"cannot read the trace: {exc}", EXIT_BAD_INPUT) from None
    with Progress(console=console, transient=True, disable=json_) as bar:
        task = bar.add_task("replaying", total=len(requests) * len(caps) * 3)
        results = replay_all(requests, caps, block_bytes, progress=lambda n: bar.advance(task, n))
    if json_:
        typer.echo(json.dumps([dataclasses.asdict(r) | {"hit_ratio": r.hit_ratio} for r in results], indent=2))
        return
    table = Table(title=f"{file}: {len(requests)} requests", title_justify="left")
    for col in ("capacity (blocks)", "policy", "hit ratio", "GB moved"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.capacity_blocks), r.policy, f"{r.hit_ratio:.3f}", f"{r.bytes_moved / 1e9:.2f}")
    console.print(table)
