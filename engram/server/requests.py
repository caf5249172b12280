"""What every handler does to a request first: bound its size, decode it (undecodable bytes are
INVALID_ARGUMENT, not gRPC's generic INTERNAL) and hold its counts to the server's limits.

gRPC's receive limit (server.max_message_bytes) is one number for every method, sized for Put's payload
chunks. Protobuf parses a request of tiny repeated items (a 2-byte empty BlockHeader, a 2-byte LayerSpec) into
tens of bytes each, before any handler can count them: a 60 MB RegisterModel of 15 M layers held the event loop
35 s and left the daemon 2 GB larger (an audit). So each method's decoder refuses, from the raw bytes and
before parsing, a request larger than its kind can be (request_bytes), and one whose top level holds more
entries than its count limits allow (top_level_fields): either costs about the request's size, no more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engram.errors import EngramError, InvalidArgument, ResourceExhausted

CONTROL_BYTES = 64 * 2**10  # a request naming no tokens, keys or blocks: names, ids, a layout of 1,024 layers
TOKEN_BYTES = 10  # a token id on the wire, at most (a negative int32 is a 10-byte varint)
ID_BYTES = 11  # a lease id (u64 varint and its tag)
KEY_BYTES = 64  # a block key (16 bytes) or a key prefix (hex), with its tag and length
HEADER_BYTES = 256  # a BlockHeader, less its tokens: dtype, a shape of a few dimensions, sizes, codec
TOP_LEVEL_SLACK = 16  # the single fields beside a request's repeated one


def token_request_bytes(max_tokens: int, max_blocks: int) -> int:
    """Lookup, GetPrefix, OpenSession: up to max_tokens tokens (and a GetPrefix's lease ids)."""
    return CONTROL_BYTES + max_tokens * TOKEN_BYTES + max_blocks * ID_BYTES


def key_request_bytes(max_blocks: int) -> int:
    """Get, Pin, FetchBlocks, ReleaseLeases, DescribeBlocks, Evict: up to max_blocks keys and lease ids."""
    return CONTROL_BYTES + max_blocks * (KEY_BYTES + ID_BYTES)


def block_request_bytes(max_tokens: int, max_blocks: int) -> int:
    """ReservePut and a data-channel PUT's metadata: up to max_blocks BlockHeaders carrying the chain's tokens."""
    return CONTROL_BYTES + max_tokens * TOKEN_BYTES + max_blocks * HEADER_BYTES


class _Refused:
    """What a request deserializer returns for bytes it will not decode (too many, or not a valid message),
    so the handler answers with the error's status instead of gRPC's generic INTERNAL. It keeps the error's
    class and message, not an error: one raised holds its traceback, whose frames hold the handler's request,
    this, so a kept one made a reference cycle of every refused request (engram/server/errors.py says why that
    mattered)."""

    def __init__(self, kind: type[EngramError], message: str) -> None:
        self.kind = kind
        self.message = message


def _varint(data: bytes | bytearray, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end: the caller stops counting, the parser says what is wrong
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80 or shift > 63:
            return value, pos
        shift += 7


def top_level_fields(data: bytes | bytearray, limit: int) -> int:
    """How many fields the encoded message's top level holds, counted up to limit + 1 (so it costs at most
    that many steps whatever the size). Bytes that do not parse end the count: FromString reports them."""
    count = pos = 0
    end = len(data)
    try:
        while pos < end and count <= limit:
            tag, pos = _varint(data, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                pos += length
            elif wire_type == 5:
                pos += 4
            else:
                break
            count += 1
    except IndexError:
        pass
    return count


def safe_decoder(message_cls: Any, max_bytes: int | None = None, max_fields: int | None = None,
                 what: str = "") -> Callable[[bytes], Any]:
    """A request deserializer: refuses more than max_bytes, or more than max_fields top-level entries (a
    repeated field's items each count), RESOURCE_EXHAUSTED naming the limit, before parsing anything."""
    name = message_cls.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return _Refused(ResourceExhausted, f"a {name} of {len(data)} bytes exceeds the {max_bytes} this method "
                                               f"takes{what}; split the request")
        if max_fields is not None and top_level_fields(data, max_fields) > max_fields:
            return _Refused(ResourceExhausted, f"a {name} with more than {max_fields} entries exceeds this method's "
                                               f"limit{what}; split the request")
        try:
            return message_cls.FromString(data)
        except Exception as exc:
            return _Refused(InvalidArgument, f"request is not a valid {name} message: {exc}")

    return decode


def decoded(request: Any) -> Any:
    if isinstance(request, _Refused):
        raise request.kind(request.message)
    return request


def check_limit(what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ResourceExhausted(f"{what}: {count} exceeds the server's limit of {limit}; split the request")
