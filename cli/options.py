"""Typer option types shared by every command (serve, stats, check, ls, show, evict, pin, top, ...)."""

from __future__ import annotations

from typing import Annotated

import typer

ConfigOpt = Annotated[str | None, typer.Option(
    "--config", "-c", metavar="FILE", help="TOML config file (or ENGRAM_CONFIG).")]
AddressOpt = Annotated[str | None, typer.Option(
    "--address", "-a", metavar="ADDR", help="Daemon address, host:port or unix:/path (default: from the config).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
NamespaceOpt = Annotated[str | None, typer.Option(
    "--namespace", "-n", metavar="NS",
    help="Namespace (tenant). Default: every namespace where that makes sense (admin).")]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", envvar="ENGRAM_TOKEN", show_envvar=True, metavar="TOKEN",
    help="Bearer token of a daemon with tenants (prefer the variable: a flag shows in `ps`).")]
TlsCaOpt = Annotated[str | None, typer.Option(
    "--tls-ca", envvar="ENGRAM_TLS_CA", show_envvar=True, metavar="PEM",
    help="Root certificate of a daemon that serves TLS (its own certificate when self-signed).")]
