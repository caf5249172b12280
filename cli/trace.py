"""`engram trace`: trace files for `engram bench trace` (no daemon needed)."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any

import typer

from .common import EXIT_BAD_INPUT, console, fail

trace_app = typer.Typer(help="Trace files for `engram bench trace`.", no_args_is_help=True)


def _value(name: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, tuple):
            lo, hi = (int(v) for v in text.split(","))
            if lo > hi:
                raise ValueError
            return (lo, hi)
        return type(default)(text)
    except ValueError:
        want = "LOW,HIGH" if isinstance(default, tuple) else type(default).__name__
        raise fail(f"--param {name} takes {want}, got {text!r}", EXIT_BAD_INPUT) from None


@trace_app.command("synth")
def synth(
    out: Annotated[str, typer.Argument(help="The trace file to write (JSON lines, Engram's session format).")],
    sessions: Annotated[int, typer.Option(help="Top-level agent sessions.")] = 64,
    seed: Annotated[int, typer.Option(help="Random seed: the same parameters and seed give the same trace.")] = 0,
    param: Annotated[list[str] | None, typer.Option(
        help="NAME=VALUE for any other parameter of engram.trace.synth.AgentWorkload (ranges as LOW,HIGH), e.g. "
             "system_blocks=128 or tool_ms=500,5000; repeatable. docs/ARCHITECTURE.md lists them.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Write a synthetic agent workload: shared system and tool prefixes, repository context shared per
    repository, think time for tool calls and users, nested sub-agents."""
    from engram.trace import write_trace
    from engram.trace.synth import AgentWorkload, agent_workload

    base = AgentWorkload(sessions=sessions, seed=seed)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(AgentWorkload)}
    changes: dict[str, Any] = {}
    for item in param or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields or name in ("sessions", "seed"):
            raise fail(f"--param takes NAME=VALUE with NAME one of {', '.join(sorted(set(fields) - {'sessions', 'seed'}))}"
                       f"; got {item!r}", EXIT_BAD_INPUT)
        changes[name] = _value(name, text.strip(), fields[name])
    params = dataclasses.replace(base, **changes)
    try:  # the sizes' bounds too (engram/trace/synth.py): the trace is built whole in memory
        requests = agent_workload(params)
    except ValueError as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None
    try:
        write_trace(out, requests)
    except OSError as exc:
        raise fail(f"cannot write {out}: {exc}", EXIT_BAD_INPUT) from None
    summary = {"file": out, "requests": len(requests), "sessions": len({r.session for r in requests}),
               "sub_agents": sum(1 for r in requests if r.parent), "block_accesses": sum(len(r.hash_ids) for r in requests),
               "distinct_blocks": len({h for r in requests for h in r.hash_ids}), "block_tokens": params.block_tokens,
               "minutes": round(requests[-1].timestamp / 60_000, 1) if requests else 0.0}
    if json_:
        typer.echo(json.dumps(summary | {"params": dataclasses.asdict(params)}, indent=2))
        return
    console.print(f"wrote {out}: {summary['requests']:,} requests of {summary['sessions']} sessions "
                  f"({summary['sub_agents']} sub-agents), {summary['block_accesses']:,} block accesses, "
                  f"{summary['distinct_blocks']:,} distinct blocks of {params.block_tokens} tokens, "
                  f"{summary['minutes']} minutes")
