"""Domain errors. Each names what went wrong and what to change; the gRPC edge maps them to status codes
in one place (engram/wire/status.py), which the client uses to map them back."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound="EngramError")


class EngramError(Exception):
    """Base class of every error Engram raises on purpose."""

    for_tenant: str | None = None  # what a tenant is told instead of the message (None: the message)

    def told(self, admin: bool) -> str:
        """What a caller is told of this error: its message, or to a tenant `for_tenant` where it has one
        (`TierFull` keeps the daemon's figures from a tenant, and so does an error that says one: `restated`)."""
        return str(self) if admin or self.for_tenant is None else self.for_tenant


def restated(cls: type[E], prefix: str, cause: EngramError) -> E:
    """An error of `cls` saying `prefix` then `cause`, told to a tenant with what `cause` tells one: an error whose
    message took another's (a TierFull's) told a tenant the figures the other keeps from it."""
    err = cls(f"{prefix}{cause}")
    if cause.for_tenant is not None:
        err.for_tenant = f"{prefix}{cause.for_tenant}"
    return err


class InvalidArgument(EngramError):
    """The request is malformed: wrong shape, dtype, size, checksum, or a value out of range."""


class NotFound(EngramError):
    """A named thing (model fingerprint, block key, session) does not exist in this namespace."""


UNKNOWN_MODEL = "unknown model fingerprint"  # how the daemon's message starts: the client knows the error by it


class UnknownModel(NotFound):
    """A model fingerprint the daemon does not know (never registered, or forgotten by a daemon that restarted
    without a model registry; with tenancy on, one the caller's tenant has not registered, whoever else has), or
    this client never registered: register the model, then call again."""


class AlreadyExists(EngramError):
    """A thing that must be new already exists."""


class ResourceExhausted(EngramError):
    """A budget is spent: a tier's bytes, a request's block or token count, a quota."""


class TierFull(ResourceExhausted):
    """A tier in which no room can be made. The message names the tier's use, every tenant's blocks in it: for an
    admin (tenancy off, every caller is one) and the log. A tenant is told `for_tenant`, the same without it: the
    bytes other tenants' blocks hold move with their puts, and tell their prompt lengths."""

    def __init__(self, message: str, for_tenant: str) -> None:
        super().__init__(message)
        self.for_tenant = for_tenant


class StorageFull(ResourceExhausted):
    """The filesystem under a tier is out of space (ENOSPC), whatever the tier's own budget says."""


class FailedPrecondition(EngramError):
    """The request is well formed but the daemon's state does not allow it (e.g. a missing parent block)."""


class AlreadyRunning(FailedPrecondition):
    """Another daemon holds what this one needs for itself (its unix socket path, its NVMe directory)."""


class NewerFormat(FailedPrecondition):
    """A file of a tier's directory (a block file, the index snapshot or a journal) is of a format version newer
    than this build reads: a newer Engram wrote it. It is never deleted nor changed (a roll-back must not lose
    what the newer build stored): a start refuses the directory, `engram check --fix` leaves it (docs/FORMAT.md,
    "Version skew")."""

    def __init__(self, path: str, what: str, version: int, reads: int, advice: str = "") -> None:
        self.path, self.what, self.version, self.reads = path, what, version, reads
        super().__init__(f"{path}: {what} format version {version}, this Engram reads version {reads} at most: "
                         f"written by a newer Engram{'; ' + advice if advice else ''}")


class Unauthenticated(EngramError):
    """The call carries no valid credentials (a missing or unknown bearer token)."""


class PermissionDenied(EngramError):
    """The caller is known but may not act on what it named (another tenant's namespace, an admin call)."""


class DataLoss(EngramError):
    """Stored data failed verification (checksum, torn file); the block is dropped, never served."""


class Unavailable(EngramError):
    """The daemon (or a tier it needs) cannot serve right now; retrying later may succeed."""


class DeadlineExceeded(Unavailable):
    """The daemon did not answer within the client's timeout_s (a unary call's answer; a stream's next message or
    bytes): hung, stopped, overloaded, or a host gone without a reset. The call was given up and the client goes
    on; an Unavailable, for code that retries."""


class DaemonError(Unavailable):
    """The daemon failed the call itself (gRPC INTERNAL, UNKNOWN, UNIMPLEMENTED...): its message says why. An
    Unavailable for code that retries, but not "no daemon answers"."""


class StorageIOError(Unavailable):
    """An I/O error on one block's storage; that block fails, the tier and the daemon go on."""


class NotDurable(Unavailable):
    """A write-through put whose durable (NVMe) copy could not be made: it is not acknowledged."""


class ClientClosed(EngramError, RuntimeError):
    """A call on a client that close() ended, or that close() ended while the call ran (it was given up): make a
    new client. Not an Unavailable: calling the same client again cannot succeed."""


class ClientForked(ClientClosed):
    """A client used in a process forked from the one that made it, or a new client made in a fork of a process
    that had made one: gRPC and the client's event-loop thread do not survive fork() (engram/clientuse.py)."""


class ConfigError(EngramError):
    """The configuration is invalid: unknown key, wrong type, impossible value."""


class InsufficientResources(ConfigError):
    """The host cannot give what the configuration asks (memory, /dev/shm, disk): lower a capacity or add room."""


class AddressInUse(EngramError):
    """The daemon cannot listen where it was told (the port is taken, or the address is not this host's)."""


BRIEF_CHARS = 64  # a 32-byte value in hex: every real key (16 bytes) and fingerprint (16 bytes) is shown whole


def brief(value: bytes | str) -> str:
    """A key, fingerprint or prefix from a request as an error message repeats it: whole up to BRIEF_CHARS,
    else its start and its length. Repeated whole, a long one pushed the status details past gRPC's 16 KiB
    metadata limit, and the client got RESOURCE_EXHAUSTED "Stream removed" instead of NOT_FOUND (an audit)."""
    text = value.hex() if isinstance(value, bytes | bytearray) else value
    if not text:
        return "<empty>"
    if len(text) <= BRIEF_CHARS:
        return text
    unit = "bytes" if isinstance(value, bytes | bytearray) else "characters"
    return f"{text[:32]}... ({len(value)} {unit})"
