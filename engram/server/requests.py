"""What every handler does to a request first: decode it (undecodable bytes are INVALID_ARGUMENT, not
gRPC's generic INTERNAL) and hold its counts to the server's limits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engram.errors import InvalidArgument, ResourceExhausted


class _Undecodable:
    """What a request deserializer returns for bytes that are not a valid message, so the handler can
    answer INVALID_ARGUMENT instead of gRPC's generic INTERNAL."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error


def safe_decoder(message_cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except Exception as exc:
            return _Undecodable(message_cls.DESCRIPTOR.full_name, exc)

    return decode


def decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"request is not a valid {request.message_type} message: {request.error}")
    return request


def check_limit(what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ResourceExhausted(f"{what}: {count} exceeds the server's limit of {limit}; split the request")
