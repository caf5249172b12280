"""`engram top`: a live view of a daemon: tiers, rates per second (from two Stats snapshots `--interval`
apart) and sessions. `--once` prints one frame and exits (scripts, tests)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Annotated

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from engram.api import SessionSummary, Stats
from engram.control import ControlClient

from .common import EXIT_BAD_INPUT, call, console, fail, target
from .format import dumps, to_dict
from .ls import sessions_table
from .options import AddressOpt, ConfigOpt, NamespaceOpt, TlsCaOpt, TokenOpt
from .show import visible_sessions
from .stats import admin, human_bytes

# A day: 1e308 s was taken and waited for ever (--once's call timeout is 4 intervals), where inf was refused.
MAX_INTERVAL_S = 86_400.0


@dataclass(frozen=True)
class Snapshot:
    at: float
    stats: Stats
    sessions: tuple[SessionSummary, ...]


async def snapshot(client: ControlClient, namespace: str | None) -> Snapshot:
    stats = await client.stats()
    if namespace is None:
        sessions = await visible_sessions(client)
    else:
        sessions = await client.list_sessions(namespace=namespace)
    return Snapshot(time.monotonic(), stats, sessions)


def frame(prev: Snapshot, cur: Snapshot, address: str) -> Group:
    dt = max(cur.at - prev.at, 1e-9)
    tiers = Table(title=f"engram top: {address}, up {cur.stats.uptime_s:.0f} s, rates over {dt:.1f} s",
                  title_justify="left")
    mine = cur.stats.scoped  # a tenant: its own copies and counts; the tiers' activity is the admin's
    if mine:
        tiers.title = (f"{tiers.title}; your namespaces' copies, a shared one's at their homes (tier hits and moves: "
                       "admin only)")
    columns = ["tier", "state", "used", "capacity", "blocks"]
    if not mine:
        columns += ["hits/s", "misses/s", "evictions/s", "demoted/s", "promoted/s"]
    for col in columns:
        tiers.add_column(col, justify="left" if col in ("tier", "state") else "right")
    before = {t.name: t for t in prev.stats.tiers}
    for t in cur.stats.tiers:
        p = before.get(t.name, t)
        row = [t.name, t.state, human_bytes(t.used_bytes), human_bytes(t.capacity_bytes), str(t.blocks)]
        if not mine:
            row += [f"{(t.hits - p.hits) / dt:.1f}", f"{(t.misses - p.misses) / dt:.1f}",
                    f"{(t.evictions - p.evictions) / dt:.1f}",
                    f"{human_bytes((t.demoted_bytes - p.demoted_bytes) / dt)}/s",
                    f"{human_bytes((t.promoted_bytes - p.promoted_bytes) / dt)}/s"]
        tiers.add_row(*row)
    a, b = prev.stats, cur.stats
    rates = Table(title="rates", title_justify="left", show_header=False)
    rates.add_column("name")
    rates.add_column("per second", justify="right")
    hit, miss = b.lookup_hit_tokens - a.lookup_hit_tokens, b.lookup_miss_tokens - a.lookup_miss_tokens
    for name, value in (
        ("lookups/s", admin(b, f"{(b.lookups - a.lookups) / dt:.1f}")),
        ("token hit ratio (interval)", admin(b, f"{100.0 * hit / (hit + miss):.1f}%" if hit + miss else "-")),
        ("blocks put/s", f"{(b.blocks_put - a.blocks_put) / dt:.1f}"),
        ("blocks served/s", f"{(b.blocks_served - a.blocks_served) / dt:.1f}"),
        ("bytes served/s", f"{human_bytes((b.bytes_served - a.bytes_served) / dt)}/s"),
        ("replays/s", admin(b, f"{(b.replay.replays - a.replay.replays) / dt:.2f}")),
    ):
        rates.add_row(name, value)
    return Group(tiers, rates, sessions_table(cur.sessions))


def frame_dict(prev: Snapshot, cur: Snapshot, address: str) -> dict[str, object]:
    """One frame for scripts: per-second rates over the interval (floats), the current stats and sessions."""
    dt = max(cur.at - prev.at, 1e-9)
    a, b = prev.stats, cur.stats
    before = {t.name: t for t in a.tiers}

    def rate(now: float, then: float) -> float:
        return (now - then) / dt

    def daemon_rate(now: float, then: float) -> float | None:  # None in a tenant's frame: the admin's figure
        return None if b.scoped else rate(now, then)

    tiers = {t.name: {"hits": daemon_rate(t.hits, before.get(t.name, t).hits),
                      "misses": daemon_rate(t.misses, before.get(t.name, t).misses),
                      "evictions": daemon_rate(t.evictions, before.get(t.name, t).evictions),
                      "demoted_bytes": daemon_rate(t.demoted_bytes, before.get(t.name, t).demoted_bytes),
                      "promoted_bytes": daemon_rate(t.promoted_bytes, before.get(t.name, t).promoted_bytes)}
             for t in b.tiers}
    return {"address": address, "interval_s": dt, "stats": to_dict(b), "sessions": to_dict(cur.sessions),
            "rates_per_s": {"lookups": daemon_rate(b.lookups, a.lookups),
                            "blocks_put": rate(b.blocks_put, a.blocks_put),
                            "blocks_served": rate(b.blocks_served, a.blocks_served),
                            "bytes_served": rate(b.bytes_served, a.bytes_served),
                            "replays": daemon_rate(b.replay.replays, a.replay.replays), "tiers": tiers}}


async def watch(client: ControlClient, out: Console, address: str, namespace: str | None, interval: float,
                once: bool, as_json: bool = False) -> None:
    prev = await snapshot(client, namespace)
    await asyncio.sleep(interval)
    cur = await snapshot(client, namespace)
    if as_json:
        typer.echo(dumps(frame_dict(prev, cur, address)))
        return
    if once:
        out.print(frame(prev, cur, address))
        return
    with Live(frame(prev, cur, address), console=out, refresh_per_second=4, screen=False) as live:
        while True:
            prev = cur
            await asyncio.sleep(interval)
            cur = await snapshot(client, namespace)
            live.update(frame(prev, cur, address))


def top(config: ConfigOpt = None, address: AddressOpt = None, namespace: NamespaceOpt = None,
        interval: Annotated[float, typer.Option("--interval", "-i", min=0.05,
                                                help="Seconds between refreshes (at most a day).")] = 1.0,
        once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
        json_: Annotated[bool, typer.Option("--json", help="Print one frame as JSON (rates per second) and exit.")
                         ] = False,
        token: TokenOpt = None, tls_ca: TlsCaOpt = None) -> None:
    """A live view of tiers, rates per second and sessions; Ctrl-C quits."""
    if not interval <= MAX_INTERVAL_S:  # inf and NaN too
        raise fail(f"--interval must be a finite number of seconds, at most a day ({MAX_INTERVAL_S:.0f}), got "
                   f"{interval}", EXIT_BAD_INPUT)
    where = target(config, address, token, tls_ca)
    once = once or json_
    limit = interval * 4 + 10 if once else 10.0**9
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a live view ends
        call(where, lambda c: watch(c, console, where.address, namespace, interval, once, json_), timeout_s=limit,
             call_timeout_s=10.0)
