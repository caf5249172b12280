"""The one place where domain errors and gRPC status codes map to each other: the server aborts with the
status of the error it caught, and the client raises the same error class from the status it received."""

from __future__ import annotations

import grpc

from engram import errors

STATUS_OF: dict[type[errors.EngramError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
}
ERROR_OF: dict[grpc.StatusCode, type[errors.EngramError]] = {code: exc for exc, code in STATUS_OF.items()}
ERROR_OF[grpc.StatusCode.INVALID_ARGUMENT] = errors.InvalidArgument


def status_of(exc: errors.EngramError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]  # type: ignore[index]
    return grpc.StatusCode.UNKNOWN


# what a daemon that answered can fail with beyond the domain errors: its own bug, a method it lacks
_DAEMON_FAILED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED,
                  grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE}


# How gRPC's client fails every call on a channel it could not make (a target it cannot parse, a unix socket path
# too long): UNKNOWN, as a daemon's own failure is, though no daemon was reached
_NO_CHANNEL = "Failed to create channel"


def error_from_rpc(exc: grpc.aio.AioRpcError) -> errors.EngramError:
    """The domain error a failed call stands for, with the server's message; codes with no domain error
    become Unavailable: DaemonError where the daemon answered and failed the call (INTERNAL, UNKNOWN...),
    plain Unavailable where it did not answer (down, unreachable). DEADLINE_EXCEEDED (the daemon cut a stream
    that stalled: server.stream_stall_s) is DeadlineExceeded, as the client's own timeout is. A channel gRPC
    could not make is the caller's address: InvalidArgument."""
    cls = ERROR_OF.get(exc.code())
    if exc.code() == grpc.StatusCode.UNKNOWN and (exc.details() or "").startswith(_NO_CHANNEL):
        return errors.InvalidArgument(f"the address is not one gRPC can open a channel to: {exc.details()}")
    if cls is None:
        failed = errors.DaemonError if exc.code() in _DAEMON_FAILED else errors.Unavailable
        return failed(f"{exc.code().name}: {exc.details()}")
    return domain_error(cls, exc.details() or exc.code().name)


def domain_error(cls: type[errors.EngramError], message: str) -> errors.EngramError:
    """cls(message), a NotFound of a model as UnknownModel: its status is NOT_FOUND like any other, and a worker
    recovers from it alone, by registering the model again (engram/integrations/registration.py)."""
    if cls is errors.NotFound and message.startswith(errors.UNKNOWN_MODEL):
        return errors.UnknownModel(message)
    return cls(message)
