"""Trace formats. Mooncake JSONL: one request a line, {"timestamp" (ms), "input_length", "output_length",
"hash_ids"} where hash_ids holds one chained id per 512-token block (equal ids mean equal prefixes).
Engram's session format is the same lines with two optional fields more: "session" (the agent session the
request belongs to; a sub-agent's first request names its parent in "parent") and "close" (the session
ends after this request), so a replay can hold and drop session references as the daemon does."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engram.errors import InvalidArgument


@dataclass(frozen=True)
class Request:
    timestamp: int  # ms
    hash_ids: tuple[int, ...]
    input_length: int = 0
    output_length: int = 0
    session: str = ""
    parent: str = ""
    close: bool = False


def read_trace(path: str | Path) -> list[Request]:
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(Request(int(d["timestamp"]), tuple(int(h) for h in d["hash_ids"]),
                                   int(d.get("input_length", 0)), int(d.get("output_length", 0)),
                                   str(d.get("session", "")), str(d.get("parent", "")), bool(d.get("close", False))))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"{path}:{n}: not a trace line (need timestamp and hash_ids): {exc}") from None
    return out


def in_time_order(requests: Sequence[Request]) -> tuple[list[Request], int]:
    """The requests sorted by timestamp (stable: equal timestamps keep their order), and how many of them
    came earlier than the request before them in the file (0: it was in order already)."""
    late = sum(1 for a, b in itertools.pairwise(requests) if b.timestamp < a.timestamp)
    return (sorted(requests, key=lambda r: r.timestamp) if late else list(requests)), late


def block_tokens_of(requests: Sequence[Request]) -> int | None:
    """Tokens per block, from the requests' input lengths and block counts: n blocks of b tokens cover
    ((n - 1) b, n b] tokens, so each request bounds b; the largest power of two every request allows (a
    trace's blocks are 16, 64, 512 ...), else the smallest b they all allow. None: the trace has no input
    lengths over several blocks, or they contradict each other."""
    lo, hi = 1, None
    for r in requests:
        n, length = len(r.hash_ids), r.input_length
        if n == 0 or length <= 0:
            continue
        lo = max(lo, -(-length // n))
        if n > 1:
            top = (length - 1) // (n - 1)
            hi = top if hi is None else min(hi, top)
    if hi is None or lo > hi:
        return None
    power = 1 << hi.bit_length() - 1
    return power if power >= lo else lo


def write_trace(path: str | Path, requests: Iterable[Request]) -> None:
    with open(path, "w") as fh:
        for r in requests:
            d = asdict(r)
            d["hash_ids"] = list(r.hash_ids)
            fh.write(json.dumps(d) + "\n")
