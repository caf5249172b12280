"""Trace formats: JSON lines, one request a line.

Mooncake JSONL: {"timestamp" (ms), "input_length", "output_length", "hash_ids"}, where hash_ids holds one
chained id per block of input (equal ids mean equal prefixes: a block's id stands for its whole prefix). Other
fields are ignored. Every id of a Mooncake trace lives in one global scope.

Engram's session format (agent traces) is the same lines with optional fields more:

| field   | type   | meaning |
|---------|--------|---------|
| session | string | the agent session the request belongs to ("" or absent: none, a plain Mooncake request) |
| parent  | string | the session that started this one (a sub-agent); on its first request, and if repeated the same |
| close   | bool   | the session ends after this request: no later request of it, its references are dropped |
| scope   | string | the hash scope of the request's ids (below); absent or null: the session's default |
| back_ms | int    | the client's hint, after this request, of when the session's next one comes (ms; absent or 0: none): what a worker sends as AppendSession's expect_back_ms (an agent knows which tool it called); at most 86400000 (a day), the daemon's bound |

Hash scope: a request's hash_ids are ids within a scope, and the same id in two scopes is two different
blocks. A session's scope is the `scope` named on its requests if any ("" is the global scope every Mooncake
request uses, so sessions that write "scope": "" share ids with each other), else its parent's scope (a
sub-agent shares the ids of the agent that started it, at any depth of nesting), else a scope of its own:
ids are local to a top-level session unless the trace says they are shared. A session names at most one
scope. Requests without a session use their `scope`, or the global one.

Think time (an agent waiting on a tool call, or on its sub-agents) is the gap between the timestamps of one
session's requests; the replayer replays every request in timestamp order, so other sessions' requests run
in that gap, as on a daemon. Nested sub-agents: `parent` names another session of the trace, itself possibly
a sub-agent (no cycles).

`read_trace` checks each line (types, required fields) and the sessions across lines (a parent that names
no session of the file or forms a cycle, a session whose parent or scope changes, a request after its
session closed), raising InvalidArgument with FILE:LINE.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engram.errors import InvalidArgument
from engram.limits import MAX_EXPECT_BACK_MS


@dataclass(frozen=True)
class Request:
    timestamp: int  # ms
    hash_ids: tuple[int, ...]
    input_length: int = 0
    output_length: int = 0
    session: str = ""
    parent: str = ""
    close: bool = False
    scope: str | None = None  # None: the session's default (see the module docstring)
    back_ms: int = 0  # the client's hint of the wait until the session's next request; 0: none


def _int(d: dict[str, Any], name: str, default: int | None = None) -> int:
    v = d.get(name, default)
    if v is None:
        raise ValueError(f"{name} is missing")
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v != int(v) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return int(v)


def _str(d: dict[str, Any], name: str) -> str:
    v = d.get(name, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a string, got {v!r}")
    return v


def _line(d: Any, ids_seen: dict[int, int]) -> Request:
    """One line's request; its ids are the objects of `ids_seen` where an equal id was read before (a trace
    repeats its ids line after line: one int object each rather than one per access, a quarter of the memory)."""
    if not isinstance(d, dict):
        raise ValueError("a line must be a JSON object")
    ids = d.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise ValueError(f"hash_ids must be a list of integers, got {ids!r}")
    close = d.get("close", False)
    if not isinstance(close, bool):
        raise ValueError(f"close must be true or false, got {close!r}")
    scope = d.get("scope")
    if scope is not None and not isinstance(scope, str):
        raise ValueError(f"scope must be a string, got {scope!r}")
    session, parent = _str(d, "session"), _str(d, "parent")
    if parent and not session:
        raise ValueError("parent without session: only a session has a parent")
    if parent and parent == session:
        raise ValueError(f"session {session!r} names itself as its parent")
    back_ms = _int(d, "back_ms", 0)
    if back_ms and not session:
        raise ValueError("back_ms without session: the hint is of a session's next request")
    if back_ms > MAX_EXPECT_BACK_MS:  # else refused by the replay's sessions, after the read, without FILE:LINE
        raise ValueError(f"back_ms must be at most {MAX_EXPECT_BACK_MS} (a day, the daemon's bound on "
                         f"expect_back_ms), got {back_ms}")
    seen = ids_seen.setdefault
    return Request(_int(d, "timestamp"), tuple([seen(h, h) for h in ids]), _int(d, "input_length", 0), _int(d, "output_length", 0),
                   session, parent, close, scope, back_ms)


def read_trace(path: str | Path) -> list[Request]:
    """The requests of a trace file, in file order; InvalidArgument with FILE:LINE on bad input."""
    out: list[Request] = []
    lines: list[int] = []
    ids_seen: dict[int, int] = {}
    n = 0
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                out.append(_line(json.loads(line), ids_seen))
            except (ValueError, TypeError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
                raise InvalidArgument(f"{path}:{n}: not a trace line: {exc}") from None
            lines.append(n)
    check_sessions(out, lines, str(path))
    return out


def check_sessions(requests: Sequence[Request], lines: Sequence[int] | None = None, where: str = "trace") -> None:
    """The rules across lines of the session format (module docstring); InvalidArgument names WHERE:LINE (the
    request's position, from 1, without `lines`)."""
    at = list(lines) if lines is not None else list(range(1, len(requests) + 1))
    parent: dict[str, tuple[str, int]] = {}
    scope: dict[str, tuple[str, int]] = {}
    for r, n in zip(requests, at, strict=True):
        if not r.session:
            continue
        if r.parent:
            had = parent.setdefault(r.session, (r.parent, n))
            if had[0] != r.parent:
                raise InvalidArgument(f"{where}:{n}: session {r.session!r} names parent {r.parent!r}, but "
                                      f"{had[0]!r} at line {had[1]}")
        if r.scope is not None:
            had = scope.setdefault(r.session, (r.scope, n))
            if had[0] != r.scope:
                raise InvalidArgument(f"{where}:{n}: session {r.session!r} names scope {r.scope!r}, but "
                                      f"{had[0]!r} at line {had[1]}")
    sessions = {r.session for r in requests if r.session}
    rooted: set[str] = set()
    for child, (p, n) in parent.items():
        if p not in sessions:
            raise InvalidArgument(f"{where}:{n}: session {child!r} names parent {p!r}, which has no request in "
                                  "the trace")
        seen = {child}
        while p in parent and p not in rooted:  # walk up: a cycle never reaches a top-level session
            if p in seen:
                raise InvalidArgument(f"{where}:{n}: session {child!r}: its parents form a cycle through {p!r}")
            seen.add(p)
            p = parent[p][0]
        rooted |= seen  # each reaches a top-level session: a later walk stops at any of them (linear, not square)
    closed: dict[str, int] = {}
    for i in sorted(range(len(requests)), key=lambda i: requests[i].timestamp):
        r, n = requests[i], at[i]
        if not r.session:
            continue
        if r.session in closed:
            raise InvalidArgument(f"{where}:{n}: session {r.session!r} has a request after it closed (line "
                                  f"{closed[r.session]})")
        if r.close:
            closed[r.session] = n


def scopes(requests: Sequence[Request]) -> list[tuple[str, str]]:
    """Each request's hash scope, as ("shared", name) for a named scope ("" is the global one) or ("session",
    id) for a top-level session's own (module docstring)."""
    named = {r.session: r.scope for r in requests if r.session and r.scope is not None}
    parent = {r.session: r.parent for r in requests if r.parent}
    of: dict[str, tuple[str, str]] = {}

    def scope(session: str) -> tuple[str, str]:
        chain: list[str] = []
        s = session
        while s not in of and s not in named and s in parent and len(chain) <= len(parent):
            chain.append(s)
            s = parent[s]
        if len(chain) > len(parent):
            raise InvalidArgument(f"session {session!r}: its parents form a cycle")
        found = of.get(s) or (("shared", named[s] or "") if s in named else ("session", s))
        for c in (*chain, s):
            of[c] = found
        return found

    return [scope(r.session) if r.session else ("shared", r.scope or "") for r in requests]


def prefix_ids(requests: Sequence[Request]) -> tuple[list[Request], list[int]]:
    """The requests with their hash ids made global: each block becomes a dense id
    0, 1, 2 ... for (its scope, its parent block, its id), so one id is one prefix whatever the scopes, and
    a trace whose ids are not consistently chained still gets one id per distinct prefix. Also returns
    each dense id's parent (-1: the chain's first block)."""
    ids: dict[tuple[tuple[str, str], int, int], int] = {}
    parent_of: list[int] = []
    out = []
    for r, scope in zip(requests, scopes(requests), strict=True):
        prev = -1
        chain = []
        for h in r.hash_ids:
            d = ids.get((scope, prev, h))
            if d is None:
                d = ids[(scope, prev, h)] = len(parent_of)
                parent_of.append(prev)
            chain.append(d)
            prev = d
        out.append(Request(r.timestamp, tuple(chain), r.input_length, r.output_length, r.session, r.parent,
                           r.close, "", r.back_ms))
    return out, parent_of


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
    """JSON lines; fields at their defaults are left out (a trace without sessions is plain Mooncake)."""
    defaults = {"input_length": 0, "output_length": 0, "session": "", "parent": "", "close": False, "scope": None,
                "back_ms": 0}
    with open(path, "w") as fh:
        for r in requests:
            d = {k: v for k, v in asdict(r).items() if k not in defaults or v != defaults[k]}
            d["hash_ids"] = list(r.hash_ids)
            fh.write(json.dumps(d) + "\n")
