"""Helpers shared by CLI commands: resolving the daemon's address, running a client call, and failing
with a message and exit code instead of a traceback."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import typer
from rich.console import Console

from engram import errors
from engram.client import EngramClient
from engram.config import EngramConfig, load_config

console = Console(width=None if sys.stdout.isatty() else 140)  # piped: wide enough for the tables
err_console = Console(stderr=True, soft_wrap=True)  # messages stay on one line for grep

EXIT_UNAVAILABLE = 2
EXIT_NOT_FOUND = 3
EXIT_BAD_INPUT = 4

T = TypeVar("T")


def fail(message: str, code: int) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def load(config_path: str | None, overrides: dict[str, Any] | None = None) -> EngramConfig:
    try:
        return load_config(config_path, overrides=overrides)
    except errors.ConfigError as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None


def address_of(config: EngramConfig, address: str | None) -> str:
    if address:
        return address
    if config.server.unix_socket:
        return f"unix:{config.server.unix_socket}"
    return f"{config.server.host}:{config.server.port}"


def call(address: str, fn: Callable[[EngramClient], Coroutine[Any, Any, T]], timeout_s: float = 10.0) -> T:
    """Run one client coroutine against the daemon (as ENGRAM_TOKEN, when tenancy is on); map failures to CLI
    exit codes."""

    async def run() -> T:
        async with EngramClient(address, token=os.environ.get("ENGRAM_TOKEN", "")) as client:
            return await asyncio.wait_for(fn(client), timeout_s)

    try:
        return asyncio.run(run())
    except (errors.Unavailable, TimeoutError):
        raise fail(f"no Engram daemon answers at {address}; start one with `engram serve`", EXIT_UNAVAILABLE) from None
    except errors.NotFound as exc:
        raise fail(str(exc), EXIT_NOT_FOUND) from None
    except errors.EngramError as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None
