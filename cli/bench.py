"""`engram bench`: offline benchmarks, no daemon needed: the cache policy over a trace, and bounded replay
against loading the SWA window from a tier."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.table import Table

from engram.config import parse_bytes
from engram.errors import ConfigError, InvalidArgument

from .common import EXIT_BAD_INPUT, console, err_console, fail

# engram.trace.POLICIES, named here so that the CLI starts without importing numpy (a test keeps them equal)
POLICIES = ("engram", "lru", "belady")

bench_app = typer.Typer(help="Benchmarks: the cache policy (trace), bounded replay against loading (replay).", no_args_is_help=True)

FP4_GLOBAL_BYTES_PER_TOKEN = 890  # an FP4 global KV's bytes per token: what a missed block would weigh
MAX_PREFETCH_LEAD_MS = 3_600_000.0  # the daemon's bound on tiers.prefetch_lead_ms (engram/config.py): an hour


def _tier_size(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(parse_bytes(value))
    except ConfigError:
        raise fail(f"{flag} takes a size like 2GiB, 512MB or 1073741824, got {value!r}", EXIT_BAD_INPUT) from None
    if n <= 0:
        raise fail(f"{flag} must be positive, got {value!r}", EXIT_BAD_INPUT)
    return n


def _block_size_source(block_bytes: int | None, block_tokens: int | None, bt: int | None, bytes_per_token: int
                       ) -> str:
    """Where a block's weight came from, named as the user gave it: an option, or the trace's own fields."""
    if block_bytes is not None:
        return "--block-bytes"
    if block_tokens is not None:
        return f"--block-tokens {block_tokens:,} x --bytes-per-token {bytes_per_token:,}"
    return (f"the trace's blocks of {bt or 0:,} tokens, from its input_length over its hash_ids, x --bytes-per-token "
            f"{bytes_per_token:,}; a mistaken input_length? --block-tokens or --block-bytes overrides it")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def _capacity(r: Any) -> str:
    return f"{r.config} ({r.capacity_blocks:,})" if r.config else str(r.capacity_blocks)


@bench_app.command("trace")
def trace(
    file: Annotated[str, typer.Argument(help="Mooncake JSONL trace, or Engram's session format "
                                             "(engram/trace/formats.py; `engram trace synth` writes one).")],
    capacity: Annotated[str | None, typer.Option(help="Capacities in blocks, comma-separated: one DRAM tier of "
                                                      "that many blocks each (default 256,1024,4096 unless "
                                                      "--hbm/--dram/--nvme are given).")] = None,
    hbm: Annotated[str | None, typer.Option(help="HBM tier capacity in bytes (2GiB, 512MB): a run with the "
                                                 "tiers given (the HBM pool over a CPU tensor).")] = None,
    dram: Annotated[str | None, typer.Option(help="DRAM tier capacity in bytes, e.g. 16GiB.")] = None,
    nvme: Annotated[str | None, typer.Option(help="NVMe tier capacity in bytes, e.g. 200GiB (a DRAM-like "
                                                  "stand-in unless --nvme-files).")] = None,
    nvme_files: Annotated[bool, typer.Option(help="The NVMe tier as real block files in a temporary directory "
                                                  "(no fsync; a file write per demotion: slow).")] = False,
    policy: Annotated[str, typer.Option(help=f"Policies to replay, comma-separated, of {', '.join(POLICIES)}: "
                                             "the store's own, plain LRU, the offline optimum.")] = ",".join(POLICIES),
    block_tokens: Annotated[int | None, typer.Option(help="Tokens per block of the trace (default: from its "
                                                          "input lengths and block counts).")] = None,
    bytes_per_token: Annotated[int, typer.Option(help="KV bytes per token, for the block size.")]
    = FP4_GLOBAL_BYTES_PER_TOKEN,
    block_bytes: Annotated[int | None, typer.Option(help="Bytes of one block (default: block tokens x bytes per "
                                                         "token; at most 256 MiB): what the store's blocks weigh, "
                                                         "and a miss.")]
    = None,
    hints: Annotated[bool, typer.Option(help="Pass the trace's back_ms hints to the store's sessions (as a "
                                             "client's AppendSession expect_back_ms); --no-hints ignores them.")]
    = True,
    prefetch_lead_ms: Annotated[float, typer.Option(help="With tiers: a hinted session's blocks below the top tier "
                                                         "are copied up this long (trace time) before it is due, "
                                                         "as the daemon's tiers.prefetch_lead_ms (0: never).")]
    = 1000.0,
    jobs: Annotated[int, typer.Option(help="Runs (policy x capacity) at once, each in a process of its own: 0 = "
                                           "one per core. Same figures; a run's seconds are its own.")] = 0,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Replay a trace in time order: prefix-contiguous hits per policy and capacity, and for the store's policy
    hits and bytes moved per tier, from the store's counters."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # numpy and the policies: loaded only when run
    from engram.trace import TierSpec, block_tokens_of, in_time_order, read_trace, replay_all
    from engram.trace.replay import MAX_BLOCK_BYTES
    tiers = [TierSpec(name, n) for name, n in (("hbm", _tier_size("--hbm", hbm)), ("dram", _tier_size("--dram", dram)),
                                                ("nvme", _tier_size("--nvme", nvme))) if n is not None]
    if capacity is None:
        capacity = "" if tiers else "256,1024,4096"
    try:
        caps = list(dict.fromkeys(int(c) for c in capacity.split(",") if c.strip()))  # each capacity once
    except ValueError:
        raise fail(f"--capacity takes block counts like 256,1024, got {capacity!r}", EXIT_BAD_INPUT) from None
    if (not caps and not tiers) or (caps and min(caps) <= 0):
        raise fail("--capacity needs at least one positive block count (or give --hbm/--dram/--nvme)",
                   EXIT_BAD_INPUT)
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    if not policies or set(policies) - set(POLICIES):
        raise fail(f"--policy takes some of {', '.join(POLICIES)}, got {policy!r}", EXIT_BAD_INPUT)
    if not 0 <= prefetch_lead_ms <= MAX_PREFETCH_LEAD_MS:  # NaN too
        raise fail(f"--prefetch-lead-ms must be between 0 and an hour ({MAX_PREFETCH_LEAD_MS:,.0f}), as the daemon's "
                   f"tiers.prefetch_lead_ms, got {prefetch_lead_ms}", EXIT_BAD_INPUT)
    if jobs < 0:
        raise fail(f"--jobs takes 0 (one per core) or a positive count, got {jobs}", EXIT_BAD_INPUT)
    if (block_tokens is not None and block_tokens <= 0) or (block_bytes is not None and block_bytes <= 0):
        raise fail("--block-tokens and --block-bytes must be positive", EXIT_BAD_INPUT)
    if bytes_per_token <= 0:
        raise fail(f"--bytes-per-token must be positive, got {bytes_per_token}", EXIT_BAD_INPUT)
    try:
        requests = read_trace(file)
    except (OSError, InvalidArgument) as exc:
        raise fail(f"cannot read the trace: {exc}", EXIT_BAD_INPUT) from None
    if not requests:
        raise fail(f"{file} holds no requests: nothing to replay", EXIT_BAD_INPUT)
    requests, late = in_time_order(requests)
    if late:
        err_console.print(f"[yellow]warning:[/] {late} of {len(requests)} requests come before the one above "
                          "them in the file: replaying in timestamp order")
    bt = block_tokens or block_tokens_of(requests)
    if block_bytes is None and bt is None:
        raise fail("cannot tell the block size from the trace (no input lengths over several blocks): pass "
                   "--block-tokens or --block-bytes", EXIT_BAD_INPUT)
    nbytes = block_bytes if block_bytes is not None else (bt or 0) * bytes_per_token
    if nbytes > MAX_BLOCK_BYTES:
        raise fail(f"blocks of {nbytes:,} bytes: the replay's blocks weigh at most {MAX_BLOCK_BYTES:,} (256 MiB) "
                   f"({_block_size_source(block_bytes, block_tokens, bt, bytes_per_token)})", EXIT_BAD_INPUT)
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True, disable=json_) as bar:
        task = bar.add_task("replaying", total=len(requests) * (len(caps) + bool(tiers)) * len(policies))
        try:
            results = replay_all(requests, caps, nbytes, progress=lambda n: bar.advance(task, n), policies=policies,
                                 on_run=lambda p, c: bar.update(task, description=f"{p} ({c})"), tiers=tiers,
                                 nvme_files=nvme_files, hints=hints, jobs=jobs or os.cpu_count() or 1,
                                 prefetch_lead_ms=prefetch_lead_ms)
        except InvalidArgument as exc:
            raise fail(str(exc), EXIT_BAD_INPUT) from None
    total = time.perf_counter() - start
    if json_:
        typer.echo(json.dumps([dataclasses.asdict(r) | {"hit_ratio": r.hit_ratio, "block_tokens": bt,
                                                        "block_bytes": nbytes} for r in results], indent=2))
        return
    size = f"{bt} tokens" if bt else "? tokens"
    n = len(requests)
    table = Table(title=f"{file}: {n:,} request{'' if n == 1 else 's'}, {results[0].requested_blocks:,} blocks requested, "
                        f"blocks of {size} = {nbytes:,} bytes", title_justify="left")
    for col in ("capacity (blocks)", "policy", "hit blocks", "hit %", "GB missed", "seconds", "accesses/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(_capacity(r), r.policy, f"{r.hit_blocks:,} / {r.requested_blocks:,}",
                      f"{100 * r.hit_ratio:.2f}", _gb(r.bytes_moved), f"{r.seconds:.3f}", f"{r.accesses_per_s:,.0f}")
    console.print(table)
    detail = [r for r in results if r.tiers]
    if detail:
        per = Table(title="engram per tier (the store's counters): hits are blocks served from the tier; GB "
                          "written = puts + copies moved in", title_justify="left")
        for col in ("capacity (blocks)", "tier", "capacity GB", "hits", "GB served", "GB written", "GB promoted in",
                    "GB demoted out", "evictions", "blocks held"):
            per.add_column(col, justify="right")
        for r in detail:
            for t in r.tiers:
                per.add_row(_capacity(r), t.name, _gb(t.capacity_bytes), f"{t.hits:,}", _gb(t.served_bytes),
                            _gb(t.written_bytes), _gb(t.promoted_bytes), _gb(t.demoted_bytes), f"{t.evictions:,}",
                            f"{t.blocks:,}")
        console.print(per)
    for r in results:
        e = r.eviction
        if e is not None:
            order = e.orders() if e.learned else "least recently used (not enough comebacks to learn from)"
            console.print(f"engram eviction at {_capacity(r)}: {order}; {e.comebacks:,} comebacks counted, "
                          f"{e.ghosts:,} deleted blocks remembered")
    from engram import compiled

    console.print(f"replayed in {total:.2f} s; the store's modules {compiled.summary()}")


def _parse_contexts(text: str) -> tuple[int, ...]:
    """"4K,16K,64K" or "4096,16384": K = 1024 tokens."""
    out = []
    for item in (c.strip().upper() for c in text.split(",") if c.strip()):
        scale = 1024 if item.endswith("K") else 1
        try:
            out.append(int(item.removesuffix("K")) * scale)
        except ValueError:
            raise fail(f"--contexts takes token counts like 4K,16K,64K or 4096, got {text!r}", EXIT_BAD_INPUT) from None
    if not out or min(out) <= 0:
        raise fail("--contexts needs at least one positive token count", EXIT_BAD_INPUT)
    return tuple(out)


@bench_app.command("replay")
def replay(
    model: Annotated[str | None, typer.Option(
        help="A named random-weight model of real shape (tiny, gpt-oss-20b, gpt-oss-120b, gemma3-4b) or a Hugging "
             "Face checkpoint directory. Default: gpt-oss-20b (tiny with --smoke).")] = None,
    contexts: Annotated[str | None, typer.Option(
        help="Context lengths N, comma-separated, K = 1024 (default 4K,16K,64K; 64,128,256 with --smoke).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (auto: cuda if there is one; cpu with --smoke).")]
    = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on the CPU), bfloat16, float16, "
                                            "float32 or float64.")] = "auto",
    out: Annotated[str, typer.Option(help="Directory for replay_cost.json, .md and .png.")] = "replay-cost",
    smoke: Annotated[bool, typer.Option(help="The tiny model, small contexts and few repeats: end to end on a "
                                             "CPU in seconds.")] = False,
    repeats: Annotated[int, typer.Option(help="Timed runs per figure, the fastest kept (0: 20, or 3 with --smoke).")] = 0,
    prompts: Annotated[int, typer.Option(help="Seeded prompts for the fidelity figures (0: 8, or 4 with "
                                              "--smoke).")] = 0,
    fidelity_context: Annotated[int, typer.Option(help="Tokens per fidelity prompt (0: the smallest context "
                                                       ">= exact bound + W).")] = 0,
    nvme_dir: Annotated[str | None, typer.Option(help="Directory for the NVMe read test's file (default: a "
                                                      "temporary directory; put it on the NVMe drive).")] = None,
    calibrate: Annotated[str | None, typer.Option(help="Also save this run as the model's calibration on this "
                                                       "machine in DIR (the daemon's replay.calibrations).")] = None,
    check: Annotated[str | None, typer.Option(help="A calibration file (an earlier run's replay_cost.json): "
                                                   "report how well it predicts this run, and its choices.")] = None,
    min_top1: Annotated[float, typer.Option(help="Fidelity floor of --check's policy table.")] = 0.99,
    max_kl: Annotated[float, typer.Option(help="Fidelity floor of --check's policy table.")] = 0.01,
) -> None:
    """Replay time against R and context, next to loading the same SWA window from HBM, DRAM and NVMe; the
    replay's fidelity against R; the bytes persisted with and without replay. Writes JSON, Markdown and a PNG."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from engram.replay.bench import BenchOptions, check_markdown, markdown, write_outputs
    from engram.replay.bench import calibrate as save_calibration
    from engram.replay.bench import run as run_bench
    from engram.replay.costmodel import FidelityFloor
    from engram.replay.model import ReplayError

    opts = BenchOptions(model=model, contexts=_parse_contexts(contexts) if contexts else (), device=device,
                        dtype=dtype, out=Path(out), smoke=smoke, repeats=repeats, prompts=prompts,
                        fidelity_context=fidelity_context, nvme_dir=nvme_dir)
    if min(repeats, prompts, fidelity_context) < 0:
        raise fail("--repeats, --prompts and --fidelity-context must not be negative", EXIT_BAD_INPUT)
    start = time.perf_counter()
    with Progress(TextColumn("[bold]replay cost[/]"), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("loading the model", total=None)

        def steps(total: int) -> Callable[[str], None]:
            bar.update(task, total=total, description="started")
            return lambda label: bar.update(task, advance=1, description=label)

        try:
            result = run_bench(opts, steps)
        except (ReplayError, OSError) as exc:
            raise fail(str(exc), EXIT_BAD_INPUT) from None
    files, missing = write_outputs(result, opts.out)
    typer.echo(markdown(result))
    if calibrate:
        saved = save_calibration(result, Path(calibrate))
        err_console.print(f"calibration saved: {saved}")
    if check:
        try:
            text = check_markdown(Path(check), result, FidelityFloor(min_top1=min_top1, max_kl=max_kl),
                                  budgets=(0, 1 << 40))
        except (OSError, ValueError) as exc:
            raise fail(f"--check {check}: {exc}", EXIT_BAD_INPUT) from None
        (opts.out / "replay_cost_check.md").write_text(text)
        typer.echo(text)
    if missing:
        err_console.print(f"[yellow]warning:[/] {missing}")
    err_console.print(f"wrote {', '.join(str(f) for f in files)} in {time.perf_counter() - start:.1f} s")
