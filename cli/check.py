"""`engram check [--fix]`: verify every stored copy, on a running daemon (Check RPC) or, with --dir, on an
NVMe tier directory whose daemon is stopped. Exit code 0 when clean, 1 when problems were found."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import typer
from rich.table import Table

from engram.api import CheckFinding, CheckReport
from engram.errors import AlreadyRunning, ConfigError, NewerFormat

from .common import EXIT_BAD_INPUT, console, fail

EXIT_PROBLEMS = 1


def offline(directory: str, fix: bool, progress: Callable[[int, int], None] | None = None) -> CheckReport:
    from engram.tiers.nvme import NvmeTier  # the tier's code only for an offline check
    from engram.tiers.nvmedir import claim

    if not directory.strip():
        raise fail("--dir needs the NVMe tier's directory (tiers.nvme.path)", EXIT_BAD_INPUT)
    root = Path(directory)
    try:  # only a directory Engram wrote: a check (--fix above all) of another program's would delete its files
        claim(root, create=False, mark=False, setting="--dir")
    except (ConfigError, NewerFormat) as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None
    except OSError as exc:  # it (or its index/, blocks/, models/) cannot be listed: another user's, a permission
        raise fail(f"--dir {directory}: {exc.filename or directory} cannot be read ({exc.strerror or exc}); run the "
                   "check as the user the daemon runs as, or one who may read the directory", EXIT_BAD_INPUT) from None

    async def run() -> CheckReport:
        try:  # without --fix, nothing in the directory is made, tightened or written
            tier = NvmeTier(root, 1 << 62, fsync=False, create=False, read_only=not fix)
        except AlreadyRunning as exc:  # a daemon serves this directory: check it through the daemon instead
            raise fail(f"{exc}; or run `engram check` against the running daemon", EXIT_BAD_INPUT) from None
        except OSError as exc:  # its lock cannot be taken: a read-only remount after errors, permissions
            raise fail(f"{directory}: cannot open the tier ({exc.strerror or exc}: {exc.filename or directory}); "
                       "check it where it can be written, or through the daemon serving it", EXIT_BAD_INPUT) from None
        try:
            report = await tier.check(fix=fix, progress=progress)
        finally:
            await tier.close()
        return CheckReport(report.scanned, report.valid,
                           tuple(CheckFinding(f.path, f.problem, f.fixed) for f in report.findings))

    return asyncio.run(run())


def show(resp: CheckReport, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"scanned": resp.scanned, "valid": resp.valid, "findings": [
            {"path": f.path, "problem": f.problem, "fixed": f.fixed} for f in resp.findings]}, indent=2))
    else:
        console.print(f"scanned {resp.scanned} stored copies: {resp.valid} valid, {len(resp.findings)} problems")
        if resp.findings:
            table = Table("path", "problem", "fixed")
            for f in resp.findings:
                table.add_row(f.path, f.problem, "yes" if f.fixed else "no")
            console.print(table)
    if resp.findings:
        raise typer.Exit(EXIT_PROBLEMS)
