"""`engram bench`: offline benchmarks of the cache policy (no daemon needed)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated

import typer
from rich.table import Table

from engram.errors import InvalidArgument

from .common import EXIT_BAD_INPUT, console, err_console, fail

# engram.trace.POLICIES, named here so that the CLI starts without importing numpy (a test keeps them equal)
POLICIES = ("engram", "lru", "belady")

bench_app = typer.Typer(help="Benchmarks of the cache policy.", no_args_is_help=True)

FP4_GLOBAL_BYTES_PER_TOKEN = 890  # an FP4 global KV's bytes per token: what a missed block would weigh


@bench_app.command("trace")
def trace(
    file: Annotated[str, typer.Argument(help="Mooncake JSONL trace, or Engram's session format.")],
    capacity: Annotated[str, typer.Option(help="Capacities in blocks, comma-separated.")] = "256,1024,4096",
    policy: Annotated[str, typer.Option(help=f"Policies to replay, comma-separated, of {', '.join(POLICIES)}: "
                                             "the store's own, plain LRU, the offline optimum.")] = ",".join(POLICIES),
    block_tokens: Annotated[int | None, typer.Option(help="Tokens per block of the trace (default: from its "
                                                          "input lengths and block counts).")] = None,
    bytes_per_token: Annotated[int, typer.Option(help="KV bytes per token, for bytes moved.")]
    = FP4_GLOBAL_BYTES_PER_TOKEN,
    block_bytes: Annotated[int | None, typer.Option(help="Bytes of one block, for bytes moved (default: "
                                                         "block tokens x bytes per token).")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Replay a trace in time order: prefix-contiguous hits and bytes moved, per policy and capacity."""
    from rich.progress import Progress

    # numpy and the policies: loaded only when run
    from engram.trace import block_tokens_of, in_time_order, read_trace, replay_all
    try:
        caps = [int(c) for c in capacity.split(",") if c.strip()]
    except ValueError:
        raise fail(f"--capacity takes block counts like 256,1024, got {capacity!r}", EXIT_BAD_INPUT) from None
    if not caps or min(caps) <= 0:
        raise fail("--capacity needs at least one positive block count", EXIT_BAD_INPUT)
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    if not policies or set(policies) - set(POLICIES):
        raise fail(f"--policy takes some of {', '.join(POLICIES)}, got {policy!r}", EXIT_BAD_INPUT)
    if (block_tokens is not None and block_tokens <= 0) or (block_bytes is not None and block_bytes < 0):
        raise fail("--block-tokens must be positive and --block-bytes not negative", EXIT_BAD_INPUT)
    try:
        requests = read_trace(file)
    except (OSError, InvalidArgument) as exc:
        raise fail(f"cannot read the trace: {exc}", EXIT_BAD_INPUT) from None
    requests, late = in_time_order(requests)
    if late:
        err_console.print(f"[yellow]warning:[/] {late} of {len(requests)} requests come before the one above "
                          "them in the file: replaying in timestamp order")
    bt = block_tokens or block_tokens_of(requests)
    if block_bytes is None and bt is None:
        raise fail("cannot tell the block size from the trace (no input lengths over several blocks): pass "
                   "--block-tokens or --block-bytes", EXIT_BAD_INPUT)
    nbytes = block_bytes if block_bytes is not None else (bt or 0) * bytes_per_token
    start = time.perf_counter()
    with Progress(console=err_console, transient=True, disable=json_) as bar:
        task = bar.add_task("replaying", total=len(requests) * len(caps) * len(policies))
        results = replay_all(requests, caps, nbytes, progress=lambda n: bar.advance(task, n), policies=policies,
                             on_run=lambda p, c: bar.update(task, description=f"{p} at {c}"))
    total = time.perf_counter() - start
    if json_:
        typer.echo(json.dumps([dataclasses.asdict(r) | {"hit_ratio": r.hit_ratio, "block_tokens": bt,
                                                        "block_bytes": nbytes} for r in results], indent=2))
        return
    size = f"{bt} tokens" if bt else "? tokens"
    table = Table(title=f"{file}: {len(requests)} requests, {results[0].requested_blocks} blocks requested, "
                        f"blocks of {size} = {nbytes:,} bytes", title_justify="left")
    for col in ("capacity (blocks)", "policy", "hit blocks", "hit %", "GB moved", "seconds"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.capacity_blocks), r.policy, f"{r.hit_blocks:,} / {r.requested_blocks:,}",
                      f"{100 * r.hit_ratio:.2f}", f"{r.bytes_moved / 1e9:.2f}", f"{r.seconds:.3f}")
    console.print(table)
    console.print(f"replayed in {total:.2f} s")
