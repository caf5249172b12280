"""The `engram` command: serve, stats, check, demo, config, layouts, verify-isolation, the inspection
commands (ls, show, evict, pin, unpin, top) and `models forget`."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated, Any

import typer
from typer._click.core import Context  # typer (0.29) vendors click: its usage errors are these classes
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from engram import __version__
from engram.config import config_keys

from .bench import bench_app
from .check import offline as check_offline
from .check import show as show_check
from .common import (
    EXIT_BAD_INPUT,
    EXIT_NOT_FOUND,
    STORE_WIDE,
    call,
    closed_stdout_exits,
    console,
    err_console,
    fail,
    load,
    nothing_in,
    start_failures,
    target,
)
from .evict import evict
from .format import dumps
from .layouts import layouts
from .ls import ls
from .models import models_app
from .options import AddressOpt, ConfigOpt, JsonOpt, NamespaceOpt, TlsCaOpt, TokenOpt
from .pin import pin, unpin
from .show import show
from .stats import stats_json, stats_renderable
from .top import top
from .trace import trace_app
from .verify_isolation import verify_isolation


class _Group(TyperGroup):
    """Usage errors (an unknown option, a missing argument, a bad value) exit EXIT_BAD_INPUT, not click's 2,
    which is the CLI's code for "no daemon answers"; a closed stdout (--help, a command's output) exits
    EXIT_CLOSED_STDOUT, not click's 1."""

    def make_context(self, *args: Any, **kwargs: Any) -> Context:
        try:
            with closed_stdout_exits():  # --help, --version
                return super().make_context(*args, **kwargs)
        except UsageError as exc:
            exc.exit_code = EXIT_BAD_INPUT  # type: ignore[misc]  # this instance's code, not the class's
            raise

    def invoke(self, ctx: Context) -> Any:
        try:
            with closed_stdout_exits():  # a command's output, its --help
                return super().invoke(ctx)
        except UsageError as exc:
            exc.exit_code = EXIT_BAD_INPUT  # type: ignore[misc]
            raise


app = typer.Typer(name="engram", help="Engram: a tiered KV-cache daemon for LLM inference.", cls=_Group,
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"engram {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool | None, typer.Option(
        "--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit.")] = None
          ) -> None:
    """Engram: a tiered KV-cache daemon for LLM inference."""

app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")
app.add_typer(models_app, name="models")


def _parse_sets(sets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--set takes key=value (e.g. tiers.dram.capacity=8GiB), got {item!r}", EXIT_BAD_INPUT)
        out[key.strip()] = value.strip()
    return out


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="TCP address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (0: any free port).")] = None,
    unix_socket: Annotated[str | None, typer.Option(help="Listen on this unix socket instead of TCP.")] = None,
    dram_capacity: Annotated[str | None, typer.Option(help="DRAM tier budget, e.g. 8GiB.")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Any config key: --set server.chunk_bytes=4MiB.")] = None,
) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    overrides = _parse_sets(set_ or [])
    for key, value in (("server.host", host), ("server.port", port), ("server.unix_socket", unix_socket),
                       ("tiers.dram.capacity", dram_capacity), ("logging.level", log_level)):
        if value is not None:
            overrides[key] = value
    from engram.logs import setup_logging  # the daemon (and torch) only for serve: inspection starts fast
    from engram.server import serve as serve_daemon

    cfg = load(config, overrides)
    setup_logging(cfg.logging)
    with start_failures():
        asyncio.run(serve_daemon(cfg))


@app.command()
def ping(config: ConfigOpt = None, address: AddressOpt = None, json_: JsonOpt = False, token: TokenOpt = None,
         tls_ca: TlsCaOpt = None) -> None:
    """Whether a daemon answers (the standard health check: no token needed) and its round trip; exit 2 if not."""
    where = target(config, address, token, tls_ca)
    seconds = call(where, lambda c: c.ping())
    if json_:
        typer.echo(dumps({"address": where.address, "serving": True, "round_trip_ms": seconds * 1e3}))
    else:
        console.print(f"engram daemon at {where.address}: serving ({seconds * 1e3:.1f} ms round trip)")


@app.command()
def stats(config: ConfigOpt = None, address: AddressOpt = None, namespace: NamespaceOpt = None,
          json_: JsonOpt = False, token: TokenOpt = None, tls_ca: TlsCaOpt = None) -> None:
    """Tier occupancy, models, namespaces and hit counters of a running daemon (-n: one namespace's line)."""
    resp = call(target(config, address, token, tls_ca), lambda c: c.stats())
    if namespace is not None:
        mine = tuple(n for n in resp.namespaces if n.namespace == namespace)
        if not mine:
            raise fail(str(nothing_in(namespace)), EXIT_NOT_FOUND)
        resp = dataclasses.replace(resp, namespaces=mine)
    if json_:
        typer.echo(stats_json(resp))
    else:
        console.print(stats_renderable(resp))


@app.command()
def check(
    config: ConfigOpt = None,
    address: AddressOpt = None,
    fix: Annotated[bool, typer.Option("--fix", help="Remove broken copies and files.")] = False,
    directory: Annotated[str | None, typer.Option("--dir", help="Check an NVMe tier directory offline.")] = None,
    json_: JsonOpt = False,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
) -> None:
    """Verify every stored copy (the whole daemon: an admin call); exit 1 if any problem was found."""
    # On stderr (a terminal only: piped output stays clean for --json): a bar with counts over the files of
    # a directory checked here; a spinner while a daemon checks (one Check RPC, no progress to report).
    if directory is not None:  # "" too: refused by the offline check, not taken for "no --dir"
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("checking block files"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task("check", total=None)
            resp = check_offline(directory, fix, lambda done, total: bar.update(task, completed=done, total=total))
    else:
        with err_console.status("checking every stored copy (payload checksums, block files)..."):
            resp = call(target(config, address, token, tls_ca), lambda c: c.check(fix=fix), timeout_s=STORE_WIDE)
    show_check(resp, json_)


@app.command()
def demo() -> None:
    """Start an embedded daemon and run two agent sessions that share a long prefix; exit 1 if the second did
    not get it back intact, and a daemon that cannot start exits as `engram serve` does (4: configuration)."""
    from .demo import demo as run_demo
    reports = run_demo(console)
    if not all(r.verified for r in reports) or reports[-1].cached_tokens == 0:
        raise fail("the demo's second session did not get the shared prefix back intact", 1)


@app.command("config")
def show_config(config: ConfigOpt = None, keys: Annotated[bool, typer.Option(help="List every key.")] = False,
                json_: JsonOpt = False,
                show_secrets: Annotated[bool, typer.Option(help="Print literal secrets (tokens, salts, passwords) "
                                                                "instead of 'redacted:'.")] = False) -> None:
    """Print the effective configuration (defaults < file < ENGRAM_* environment) as TOML that --config loads
    back (--json: as JSON). Literal secrets print as 'redacted:' (which a config may not hold) unless
    --show-secrets; env:VAR and file:PATH references print as they are."""
    import json

    from engram.config import as_dict, to_toml

    if keys:
        for key in config_keys():
            typer.echo(key)
        return
    cfg = load(config)
    typer.echo(json.dumps(as_dict(cfg, secrets=show_secrets), indent=2) if json_ else to_toml(cfg, secrets=show_secrets),
               nl=json_)


for _command in (ls, show, evict, pin, unpin, top, layouts):  # one module each
    app.command()(_command)
app.command("verify-isolation", short_help="Check that one namespace's blocks are out of another's reach on every "
            "tier and path; exit 1 on a leak.")(verify_isolation)


def main() -> None:
    app()
