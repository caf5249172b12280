"""Turning daemon replies into what a user reads: JSON with keys as hex, ages, session states."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from engram.v1 import engram_pb2 as pb

_MODE = {pb.REPLAY_MODE_EXACT: "exact", pb.REPLAY_MODE_APPROX: "approx", pb.REPLAY_MODE_PERSIST: "persist",
         pb.REPLAY_MODE_UNSPECIFIED: "exact"}


def to_dict(msg: Message) -> dict[str, Any]:
    """Every field (defaults included), bytes as hex (block keys, fingerprints), enums by name, 64-bit
    integers as numbers (protobuf's JSON mapping would make them strings)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if repeated:
                out[field.name] = [to_dict(v) for v in value]
            elif msg.HasField(field.name):
                out[field.name] = to_dict(value)
            else:
                out[field.name] = None
        elif field.type == FieldDescriptor.TYPE_BYTES:
            out[field.name] = [v.hex() for v in value] if repeated else value.hex()
        elif field.type == FieldDescriptor.TYPE_ENUM:
            names = field.enum_type.values_by_number
            out[field.name] = ([_enum_name(names, v) for v in value] if repeated else _enum_name(names, value))
        else:
            out[field.name] = list(value) if repeated else value
    return out


def _enum_name(names: Any, value: int) -> str | int:
    return names[value].name if value in names else value


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True)


def mode_name(info: pb.SessionInfo) -> str:
    return _MODE.get(info.mode, str(info.mode))


def session_state(info: pb.SessionInfo) -> str:
    """hot: the daemon holds a rebuilt window; persisted: persist mode with a stored window; cold: a
    Resume replays (or, persist mode without a window, cannot resume yet)."""
    if info.mode == pb.REPLAY_MODE_PERSIST:
        return "persisted" if info.hot else "cold"
    return "hot" if info.hot else "cold"


def age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
