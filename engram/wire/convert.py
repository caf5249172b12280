"""Protobuf messages <-> domain values, for the client and the server alike.

engram.api's result dataclasses mirror their messages field for field, so `from_pb` / `to_pb` convert them
generically: nested dataclasses recurse, tuples are repeated fields, `X | None` is an optional message, and
enums go through `_ENUMS` (a table keyed by the domain type). Layouts, model specs and block headers, whose
domain types carry checks of their own, have explicit functions below.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf import message_factory
from google.protobuf.message import Message

from engram import limits
from engram.api import SessionMode
from engram.errors import InvalidArgument, brief
from engram.layout import MAX_STREAMS, Axis, DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.v1 import engram_pb2 as pb

if TYPE_CHECKING:  # numpy (and the block module) load on first use: the CLI's inspection path needs neither
    import numpy as np

    from engram.block import BlockHeader

T = TypeVar("T")

# domain enum -> (protobuf value -> member, member -> protobuf value)
_ENUMS: dict[type[enum.Enum], tuple[dict[int, Any], dict[Any, int]]] = {
    SessionMode: ({pb.REPLAY_MODE_UNSPECIFIED: SessionMode.EXACT, pb.REPLAY_MODE_EXACT: SessionMode.EXACT,
                   pb.REPLAY_MODE_APPROX: SessionMode.APPROX, pb.REPLAY_MODE_PERSIST: SessionMode.PERSIST,
                   pb.REPLAY_MODE_AUTO: SessionMode.AUTO},
                  {SessionMode.EXACT: pb.REPLAY_MODE_EXACT, SessionMode.APPROX: pb.REPLAY_MODE_APPROX,
                   SessionMode.PERSIST: pb.REPLAY_MODE_PERSIST, SessionMode.AUTO: pb.REPLAY_MODE_AUTO}),
}


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def from_pb(cls: type[T], msg: Message) -> T:
    """The engram.api dataclass `cls` read from its message."""
    return cls(**{name: read(msg) for name, read in _readers(typing.cast(Any, cls))})  # type: ignore[call-arg]


@functools.cache
def _readers(cls: Any) -> list[tuple[str, Any]]:
    """Per field of cls, a function reading it from the message: worked out once per class, so a reply of
    many blocks converts at the speed of attribute reads."""
    hints = _hints(cls)
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], f.name
        inner = _optional(tp)
        if inner is not None:
            out.append((name, lambda m, n=name, t=inner: from_pb(t, getattr(m, n)) if m.HasField(n) else None))
        elif typing.get_origin(tp) is tuple or dataclasses.is_dataclass(tp) or tp in _ENUMS:
            out.append((name, lambda m, n=name, t=tp: _value_from_pb(t, getattr(m, n), n)))
        else:
            out.append((name, operator.attrgetter(name)))
    return out


def _value_from_pb(tp: Any, value: Any, name: str) -> Any:
    if typing.get_origin(tp) is tuple:
        (item, *_) = typing.get_args(tp)
        return tuple(_value_from_pb(item, v, name) for v in value)
    if dataclasses.is_dataclass(tp):
        return from_pb(tp, value)  # type: ignore[arg-type]
    if tp in _ENUMS:
        try:
            return _ENUMS[tp][0][value]
        except KeyError:
            raise InvalidArgument(f"unknown {name} {value}") from None
    return value


def enum_from_pb(tp: type[T], value: int, name: str) -> T:
    """A domain enum member from its protobuf value; InvalidArgument names the field for an unknown one."""
    result: T = _value_from_pb(tp, value, name)
    return result


def to_pb(obj: Any, msg_cls: type[Message]) -> Any:
    """The message `msg_cls` holding an engram.api dataclass."""
    fields = msg_cls.DESCRIPTOR.fields_by_name
    values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        fd = fields[f.name]
        sub = message_factory.GetMessageClass(fd.message_type) if fd.message_type is not None else None
        if isinstance(value, tuple):
            values[f.name] = [to_pb(v, sub) if sub is not None else scalar_to_pb(v) for v in value]
        elif sub is not None:
            values[f.name] = to_pb(value, sub)
        else:
            values[f.name] = scalar_to_pb(value)
    return msg_cls(**values)


def scalar_to_pb(value: Any) -> Any:
    table = _ENUMS.get(type(value))
    return table[1][value] if table is not None else value


# ---- layouts, models, block headers ----------------------------------------------------------------

def dtype_from_pb(value: int, where: str) -> DType:
    try:
        return DType(value)
    except ValueError:
        raise InvalidArgument(f"{where}: dtype must be DTYPE_BF16, DTYPE_FP16, DTYPE_FP32 or DTYPE_FP64, got {value}") from None


_KINDS = "LAYER_KIND_GLOBAL, LAYER_KIND_SLIDING, LAYER_KIND_SHARED, LAYER_KIND_REINDEX or LAYER_KIND_REUSE"
_AXES = {pb.GROUP_AXIS_UNSPECIFIED: Axis.TOKEN, pb.GROUP_AXIS_TOKEN: Axis.TOKEN, pb.GROUP_AXIS_CHANNEL: Axis.CHANNEL}


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    if msg.layers:  # counted before any is converted; none at all: KVLayout says a layout needs one
        limits.check_dimension("a layout's number of layers", len(msg.layers), 1, limits.MAX_LAYERS)
    limits.check_count("a layout's streams", len(msg.streams), MAX_STREAMS)
    limits.check_count("a layout's window streams", len(msg.window_streams), MAX_STREAMS)
    layers = []
    for i, layer in enumerate(msg.layers):
        try:
            kind = LayerKind(layer.kind)
        except ValueError:
            raise InvalidArgument(f"layout layer {i}: kind must be {_KINDS}") from None
        layers.append(LayerSpec(kind, layer.window))
    return KVLayout(layers=tuple(layers), num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
                    dtype=dtype_from_pb(msg.dtype, "layout"), block_tokens=msg.block_tokens,
                    streams=tuple(stream_from_pb(s, "layout stream") for s in msg.streams),
                    window_streams=tuple(stream_from_pb(s, "layout window stream") for s in msg.window_streams))


def shape_from_pb(values: Any, where: str) -> tuple[int, ...]:
    """A shape's dimensions, refused before they are copied when there are more than any layout has."""
    limits.check_count(f"{where}: shape dimensions", len(values), limits.MAX_SHAPE_DIMS)
    return tuple(values)


def stream_from_pb(msg: pb.StreamSpec, where: str) -> StreamSpec:
    if msg.axis not in _AXES:
        raise InvalidArgument(f"{where} {brief(msg.name)}: axis must be GROUP_AXIS_CHANNEL or GROUP_AXIS_TOKEN, got {msg.axis}")
    return StreamSpec(msg.name, shape_from_pb(msg.shape, f"{where} {brief(msg.name)}"),
                      dtype_from_pb(msg.dtype, f"{where} {brief(msg.name)}"), msg.codec,
                      _AXES[msg.axis], msg.compress or 1)


def stream_to_pb(s: StreamSpec) -> pb.StreamSpec:
    axis = pb.GROUP_AXIS_CHANNEL if s.axis == Axis.CHANNEL else pb.GROUP_AXIS_TOKEN
    return pb.StreamSpec(name=s.name, shape=list(s.shape), dtype=int(s.dtype), codec=s.codec, axis=axis,  # type: ignore[arg-type]
                         compress=s.compress)


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        layers=[pb.LayerSpec(kind=int(layer.kind), window=layer.window) for layer in layout.layers],  # type: ignore[arg-type]
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=int(layout.dtype),  # type: ignore[arg-type]
        block_tokens=layout.block_tokens, streams=[stream_to_pb(s) for s in layout.streams],
        window_streams=[stream_to_pb(s) for s in layout.window_streams],
    )


def model_from_pb(msg: pb.ModelSpec) -> ModelSpec:
    return ModelSpec(name=msg.name, weights_id=msg.weights_id, layout=layout_from_pb(msg.layout), codec=msg.codec)


def model_to_pb(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(name=spec.name, weights_id=spec.weights_id, layout=layout_to_pb(spec.layout), codec=spec.codec)


def header_from_pb(msg: pb.BlockHeader, index: int) -> BlockHeader:
    import numpy as np

    from engram.block import BlockHeader

    return BlockHeader(tokens=np.asarray(msg.tokens, dtype="<i4"), dtype=dtype_from_pb(msg.dtype, f"block {index}"),
                       shape=shape_from_pb(msg.shape, f"block {index}"), payload_nbytes=msg.payload_nbytes, checksum=msg.checksum,
                       codec=msg.codec or "raw")


def header_to_pb(header: BlockHeader) -> pb.BlockHeader:
    return pb.BlockHeader(tokens=header.tokens.tolist(), dtype=int(header.dtype),  # type: ignore[arg-type]
                          shape=list(header.shape), payload_nbytes=header.payload_nbytes, checksum=header.checksum,
                          codec=header.codec)


def tokens_from_pb(values: Any) -> np.ndarray:
    import numpy as np

    return np.asarray(values, dtype="<i4")


def tokens_array(tokens: Any) -> Any:
    """Token ids as the int32 array the wire carries (numpy). Anything else is InvalidArgument: an int64 array
    was cast with wrap-around and floats truncated (other tokens' keys, silently), a Python int past int32
    raised OverflowError."""
    import numpy as np

    arr = np.asarray(tokens)
    if arr.dtype == np.int32 and arr.ndim == 1:
        return arr
    if arr.ndim != 1 and arr.size:
        raise InvalidArgument(f"tokens are a flat sequence of token ids, got an array of shape {arr.shape}")
    if not arr.size:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids are integers, got {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < -(2**31) or high >= 2**31:
        raise InvalidArgument(f"token ids are 32-bit integers; got {low if low < -(2**31) else high}")
    return arr.astype(np.int32)


def tokens_to_pb(tokens: Any) -> list[int]:
    return tokens_array(tokens).tolist()  # type: ignore[no-any-return]
