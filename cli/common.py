"""Helpers shared by CLI commands: resolving the daemon's address, running a client call, and failing
with a message and exit code instead of a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from engram import errors
from engram.config import EngramConfig, load_config
from engram.control import ControlClient
from engram.wire import tlshint
from engram.wire.channel import check_socket_path, header_safe

# Piped: as wide as the tables need, so no column is cut with "…" (grep sees whole keys and paths).
console = Console(width=None if sys.stdout.isatty() else 4096, emoji=False)  # ":x:" in a name stays as typed
err_console = Console(stderr=True, soft_wrap=True, emoji=False)  # one line for grep; no ":x:" emoji

# Exit codes, the same for every command (README). 1 is a command's own "problems found" (check, demo) and 5
# verify-isolation's "no positive control".
EXIT_UNAVAILABLE = 2  # no daemon answers at the address
EXIT_NOT_FOUND = 3  # a session, block or namespace is unknown
EXIT_BAD_INPUT = 4  # bad input or configuration, and every usage error (an unknown option): see main.py
EXIT_DENIED = 6  # the daemon refused the caller's token (none, unknown, or not allowed there)
EXIT_NO_RESOURCES = 7  # serve: the host has too little memory, /dev/shm or disk for the configuration
EXIT_IN_USE = 8  # serve: another process holds the address, the unix socket or the NVMe directory
EXIT_START_FAILED = 9  # serve: a file or directory it needs cannot be used (permissions, a read-only disk, newer)
EXIT_DAEMON_ERROR = 10  # the daemon answered and failed the call itself (INTERNAL: its log says more)
EXIT_PARTLY_DONE = 11  # evict/pin over several namespaces failed after changing some: the output says what

EXIT_CLOSED_STDOUT = 141  # stdout closed before the output was written (`| head`): 128 + SIGPIPE, as a shell
# reports a command that signal ended (cat, grep); click and rich exited 1, check's and demo's "problems found"

T = TypeVar("T")


@contextlib.contextmanager
def closed_stdout_exits() -> Iterator[None]:
    """A write to a closed stdout exits EXIT_CLOSED_STDOUT: click's echo raises BrokenPipeError (click's main then
    exits 1), and rich's consoles (the commands' and typer's help) raise SystemExit(1) while handling one. Stdout
    is pointed at /dev/null first: Python's flush at exit would hit the closed pipe again and print an error. (Not
    SIGPIPE's default action, which would also end `serve` at a client's closed socket.)"""
    try:
        yield
    except (BrokenPipeError, SystemExit) as exc:
        if not isinstance(exc, BrokenPipeError) and not isinstance(exc.__context__, BrokenPipeError):
            raise
        with contextlib.suppress(OSError, ValueError):  # ValueError, io.UnsupportedOperation: no file (a test's)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(EXIT_CLOSED_STDOUT) from None


def fail(message: str, code: int) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {escape(message)}")  # messages hold [brackets]: not markup
    return typer.Exit(code)


@contextlib.contextmanager
def start_failures() -> Iterator[None]:
    """Starting a daemon (serve, and the demo's embedded one): one line and a code per class of start-up failure
    (README, "Running the daemon") instead of a traceback; whatever was built before the failure (the DRAM
    segment, locks) is released by start_server on the way out."""
    try:
        yield
    except errors.InsufficientResources as exc:  # memory, /dev/shm or disk smaller than the config asks
        raise fail(str(exc), EXIT_NO_RESOURCES) from None
    except errors.ConfigError as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None
    except (errors.AddressInUse, errors.AlreadyRunning) as exc:  # a port, socket path or NVMe directory held
        raise fail(str(exc), EXIT_IN_USE) from None
    except errors.NewerFormat as exc:  # a newer Engram's NVMe directory: left as it is (docs/FORMAT.md)
        raise fail(f"cannot start: {exc}", EXIT_START_FAILED) from None
    except OSError as exc:  # a file or directory the daemon needs: permissions, a read-only disk
        raise fail(f"cannot start: {exc}", EXIT_START_FAILED) from None


def load(config_path: str | None, overrides: dict[str, Any] | None = None) -> EngramConfig:
    try:
        return load_config(config_path, overrides=overrides)
    except errors.ConfigError as exc:
        raise fail(str(exc), EXIT_BAD_INPUT) from None


@dataclass(frozen=True)
class Target:
    """Where a command reaches its daemon and as whom: the address, the bearer token (tenancy on) and the PEM
    root certificate of a daemon that serves TLS."""

    address: str
    token: str = ""
    root_cert: bytes | None = None


def check_address(address: str) -> str:
    """host:port, [v6]:port or unix:/path (one a unix socket can hold); anything else is bad input (not
    "unreachable", nor the daemon failing the call)."""
    if address.startswith(("unix:", "unix-abstract:")) and len(address.split(":", 1)[1]) > 0:
        try:
            check_socket_path(address)
        except errors.InvalidArgument as exc:
            raise fail(str(exc), EXIT_BAD_INPUT) from None
        return address
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in host):
        return address
    raise fail(f"--address {address!r} is not host:port, [v6addr]:port or unix:/path/to.sock", EXIT_BAD_INPUT)


def address_of(config: EngramConfig, address: str | None) -> str:
    if address:
        return check_address(address)
    if config.server.unix_socket:
        return f"unix:{config.server.unix_socket}"
    return f"{config.server.host}:{config.server.port}"


def read_root_cert(ca: str) -> bytes:
    """--tls-ca's PEM file, or a CLI error saying what is wrong with it."""
    try:
        root_cert = Path(ca).read_bytes()
    except OSError as exc:
        raise fail(f"--tls-ca {ca}: {exc.strerror}; give the PEM certificate that signed the daemon's",
                   EXIT_BAD_INPUT) from None
    if b"-----BEGIN CERTIFICATE-----" not in root_cert:
        raise fail(f"--tls-ca {ca} is not a PEM certificate (no BEGIN CERTIFICATE line)", EXIT_BAD_INPUT)
    return root_cert


def target(config_path: str | None, address: str | None, token: str | None = None, tls_ca: str | None = None
           ) -> Target:
    """The daemon a command talks to: --address (else the config's own address), --token (else ENGRAM_TOKEN)
    and --tls-ca (else ENGRAM_TLS_CA; else, when the address comes from a config that serves TLS, its own
    certificate, which is its root when self-signed)."""
    cfg = load(config_path)
    addr = address_of(cfg, address)
    ca = tls_ca or (cfg.server.tls_cert if not address and not cfg.server.unix_socket else "") or None
    root_cert = read_root_cert(ca) if ca else None
    return Target(addr, check_token(token or ""), root_cert)


def check_token(token: str) -> str:
    """A bearer token travels in a gRPC header: printable ASCII without spaces (a token read from a file with a
    CRLF ending, or pasted with a non-ASCII character, failed deep in gRPC with a traceback)."""
    if not header_safe(token):
        raise fail("the token (--token or ENGRAM_TOKEN) holds a space, a control or a non-ASCII character; a token is "
                   "printable ASCII (a file's line ending copied with it?)", EXIT_BAD_INPUT)
    return token


STORE_WIDE = None  # call's timeout_s for check, evict and forget: each call bounded by itself, by its store's part


def call(where: Target, fn: Callable[[ControlClient], Coroutine[Any, Any, T]], timeout_s: float | None = 10.0,
         call_timeout_s: float | None = None) -> T:
    """Run one client coroutine against the daemon within timeout_s, each of its calls within call_timeout_s
    (default: timeout_s, else 10 s); map failures to CLI exit codes. timeout_s None (STORE_WIDE): no bound on
    the whole, for the calls whose work is a part of the store (check, evict, forget): the client gives each
    that part's time at its floor rates (engram/wire/deadline.py), which no fixed bound fits."""
    per_call = call_timeout_s or timeout_s or 10.0

    async def run() -> T:
        async with ControlClient(where.address, token=where.token, root_cert=where.root_cert,
                                 timeout_s=per_call) as client:
            return await asyncio.wait_for(fn(client), timeout_s)

    try:
        return asyncio.run(run())
    except (errors.EngramError, TimeoutError) as exc:
        message, code = failure(where, exc, timeout_s, per_call)
        raise fail(message, code) from None


def failure(where: Target, exc: errors.EngramError | TimeoutError, timeout_s: float | None = 10.0,
            per_call: float = 10.0) -> tuple[str, int]:
    """What the CLI says of a failed call, and its exit code."""
    if isinstance(exc, errors.DaemonError):
        return f"the daemon at {where.address} failed the call: {exc} (its log says more)", EXIT_DAEMON_ERROR
    if isinstance(exc, errors.DeadlineExceeded):
        more = "" if timeout_s is not None else " and the time its work on the store takes at the floor rates"
        return (f"the daemon at {where.address} did not answer within {per_call:g} s{more}: it is hung, stopped or "
                "overloaded, or its host is unreachable", EXIT_UNAVAILABLE)
    if isinstance(exc, errors.Unavailable) and ("handshake failed" in str(exc).lower() or tlshint.SERVES_TLS in str(exc)):
        return tls_mismatch(where, str(exc)), EXIT_BAD_INPUT
    if isinstance(exc, errors.Unavailable | TimeoutError):
        hint = "" if where.root_cert or where.address.startswith("unix") else " (if it serves TLS, pass --tls-ca)"
        why = f" ({exc})" if isinstance(exc, errors.Unavailable) and str(exc) else ""
        return f"no Engram daemon answers at {where.address}{why}{hint}; start one with `engram serve`", EXIT_UNAVAILABLE
    if isinstance(exc, errors.NotFound):
        return str(exc), EXIT_NOT_FOUND
    if isinstance(exc, errors.Unauthenticated):
        return f"{exc}; give the daemon's token with --token or ENGRAM_TOKEN", EXIT_DENIED
    if isinstance(exc, errors.PermissionDenied):
        return f"{exc}; use a token allowed there (an admin token for every namespace)", EXIT_DENIED
    return str(exc), EXIT_BAD_INPUT


def tls_mismatch(where: Target, why: str) -> str:
    """A TLS handshake that failed: something answers at the address, and the caller's TLS does not fit it (it was
    reported as "no Engram daemon answers ... start one with `engram serve`"), or a daemon serving TLS that closed
    this plain-text connection (the client found it serves TLS: engram/wire/tlshint.py)."""
    if tlshint.SERVES_TLS in why:
        return (f"the daemon at {where.address} serves TLS: give the PEM certificate that signed the daemon's with "
                "--tls-ca (or ENGRAM_TLS_CA)")
    if "CERTIFICATE_VERIFY_FAILED" in why:
        return (f"the daemon at {where.address} serves TLS with a certificate that --tls-ca (or ENGRAM_TLS_CA) did "
                f"not sign: give the PEM certificate that signed the daemon's ({why})")
    if "WRONG_VERSION_NUMBER" in why:
        return (f"the daemon at {where.address} does not serve TLS (a unix socket never does): leave out --tls-ca "
                f"and ENGRAM_TLS_CA for it ({why})")
    return f"the TLS handshake with the daemon at {where.address} failed: check --tls-ca and the address ({why})"


def nothing_in(namespace: str) -> errors.NotFound:
    """`-n NS` of a namespace holding no block and no session the caller may see (exit 3, `ls` and `stats` alike).
    Said alike of a namespace nobody used and of another tenant's: which one it is stays another tenant's."""
    return errors.NotFound(f"namespace {namespace!r} holds nothing this caller may see; `engram stats` lists the "
                           "namespaces it may")


class PartlyDone(Exception):
    """A command of one daemon call per namespace (a tenant's evict or pin of keys in several of its namespaces)
    whose later call failed after earlier ones had changed the store, which could not be undone: `done` is what
    they did (the command's own result type), in `namespaces`."""

    def __init__(self, cause: errors.EngramError, done: Any, namespaces: list[str]) -> None:
        super().__init__(str(cause))
        self.cause, self.done, self.namespaces = cause, done, namespaces


def namespaces(names: list[str]) -> str:
    return ("namespace " if len(names) == 1 else "namespaces ") + ", ".join(repr(n) for n in names)


def partly_done(where: Target, partly: PartlyDone, what: str) -> typer.Exit:
    """The failure's line with what had been done before it (`what`), exit EXIT_PARTLY_DONE whatever the cause."""
    message, _ = failure(where, partly.cause)
    return fail(f"{message}; refused part-way: {what}", EXIT_PARTLY_DONE)
