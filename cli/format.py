"""Turning daemon replies (engram.api dataclasses) into what a user reads: JSON with keys as hex, ages."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

HEX_INTS = frozenset({"checksum"})  # u64 hashes: past 2**53, which JSON readers (jq, JavaScript) round


def to_dict(obj: Any) -> Any:
    """Every field (defaults included), bytes as hex (block keys, fingerprints), checksums as 16 hex digits,
    enums by value, nested replies as objects, sequences as lists, integers as numbers (docs/JSON.md)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: f"{getattr(obj, f.name):016x}" if f.name in HEX_INTS else to_dict(getattr(obj, f.name))
                for f in dataclasses.fields(obj)}
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    return obj


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True)


def age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
