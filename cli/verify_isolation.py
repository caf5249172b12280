"""`engram verify-isolation`: write through one namespace, probe from another on every tier and path, and
compare answer times (engram/isolation.py has the checks, engram/isolation_rig.py where they run).

Without --address it starts a throwaway deployment of its own (tenancy on, an HBM tier on the CPU, DRAM,
NVMe, and with redis-server a Redis and a second daemon), so every tier and the cluster paths are probed.
With --address it probes a running daemon with two tenants' tokens (--token, --other-token, or
ENGRAM_TOKEN / ENGRAM_OTHER_TOKEN); blocks then stay where that daemon puts them.

Exit status: 0 when every check is isolated (or not checked here, with the reason), 1 on any leak, 5 when
no leak was seen but some check had no positive control (the owner could not reach its own data, so the
denial proves nothing), 4 for bad input, which includes a live run's two tokens not resolving to two
namespaces (both act in one, or one acts in none: an admin token, or a daemon with tenancy off), checked
before anything is written (isolation_rig.check_two_tenants).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from engram import errors

if TYPE_CHECKING:
    from engram.isolation import Report

from .common import (
    EXIT_BAD_INPUT,
    EXIT_UNAVAILABLE,
    check_address,
    check_token,
    console,
    err_console,
    fail,
    read_root_cert,
)
from .options import AddressOpt, JsonOpt

EXIT_LEAK = 1
EXIT_INCONCLUSIVE = 5
_STYLE = {"isolated": "green", "leak": "bold red", "no control": "yellow"}  # engram.isolation's statuses


def verify_isolation(
    address: AddressOpt = None,
    token: Annotated[str | None, typer.Option(help="The owner's token (live run; or ENGRAM_TOKEN).")] = None,
    other_token: Annotated[str | None, typer.Option(
        help="The prober's token, another tenant (live run; or ENGRAM_OTHER_TOKEN).")] = None,
    namespace: Annotated[str, typer.Option(help="The owner's namespace (live run; default: its token's first).")] = "",
    other_namespace: Annotated[str, typer.Option(help="The prober's namespace (live run).")] = "",
    root_cert: Annotated[str | None, typer.Option(
        "--tls-ca", "--root-cert", envvar="ENGRAM_TLS_CA", help="PEM root certificate of a daemon serving TLS.")
    ] = None,
    samples: Annotated[int, typer.Option(help="Timed lookups per class (held, absent), per namespace.")] = 300,
    no_redis: Annotated[bool, typer.Option("--no-redis", help="Built-in run without Redis and a second daemon.")]
    = False,
    json_: JsonOpt = False,
) -> None:
    """Check that one namespace's blocks are out of another's reach on every tier and path. Exit 0: isolated;
    1: a leak; 5: no leak seen, but some check had no positive control; 4: bad input, and a live run whose two
    tokens do not act in two namespaces (both in one, or one in none: an admin token or a daemon with tenancy
    off), refused before anything is written."""
    from engram.isolation_rig import run_builtin, run_live  # the daemon and torch: not for `engram -h`
    if samples < 20:
        raise fail("--samples must be at least 20 (the timing comparison needs them)", EXIT_BAD_INPUT)
    say = (lambda _: None) if json_ else (lambda what: err_console.print(f"[dim]checking {what}...[/]"))
    try:
        if address:
            owner = token or os.environ.get("ENGRAM_TOKEN", "")
            other = other_token or os.environ.get("ENGRAM_OTHER_TOKEN", "")
            if not owner or not other:
                raise fail("a live run needs two tenants' tokens: --token and --other-token (or ENGRAM_TOKEN and "
                           "ENGRAM_OTHER_TOKEN)", EXIT_BAD_INPUT)
            check_address(address)
            check_token(owner)
            check_token(other)
            cert = read_root_cert(root_cert) if root_cert else None
            report = asyncio.run(run_live(address, owner, other, namespace, other_namespace, samples=samples,
                                          root_cert=cert, progress=say))
        else:
            report = asyncio.run(run_builtin(samples=samples, use_redis=not no_redis, progress=say))
    except errors.Unavailable as exc:
        raise fail(f"no Engram daemon answers at {address}: {exc}", EXIT_UNAVAILABLE) from None
    except errors.EngramError as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None
    show(report, json_)
    if report.leaks:
        raise typer.Exit(EXIT_LEAK)
    if report.inconclusive:
        raise typer.Exit(EXIT_INCONCLUSIVE)


def show(report: Report, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    table = Table("path", "tier", "status", "detail", title="isolation checks", title_justify="left")
    for c in report.checks:
        style = _STYLE.get(c.status, "dim")
        table.add_row(c.path, c.tier, f"[{style}]{c.status}[/]", c.detail)
    console.print(table)
    t = report.timing
    if t is not None:
        style = _STYLE.get(t.status, "dim")
        console.print(f"timing: lookups of prefixes the owner holds against absent ones, {t.samples} each"
                      f"{f' (median of {t.runs} runs)' if t.runs > 1 else ''}: ROC AUC {t.across_auc:.3f} from "
                      f"the other namespace (0.5 = no signal), {t.within_auc:.3f} inside the owner's "
                      f"(the probe's sensitivity) [{style}]{t.status}[/]")
    if report.leaks:
        console.print(f"[bold red]{len(report.leaks)} leak(s):[/] " + "; ".join(report.leaks))
    elif report.inconclusive:
        console.print("[yellow]no leak seen, but these checks had no positive control:[/] "
                      + ", ".join(report.inconclusive))
    else:
        console.print("[green]no leak: every path checked kept the namespaces apart[/]")
