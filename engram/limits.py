"""Upper bounds on what a caller may name or describe, checked where a request enters the daemon.

Every size a request carries ends up somewhere with a fixed width or a finite budget: a namespace in a
block file's u16 length field and in every key, a layout's dimensions in the bytes of every block, a
replay factor in a count of tokens. Unbounded, a hostile (or mistaken) caller reached those places and
failed there with INTERNAL, or made the daemon allocate what it could not hold, and the failure could land
on another client's later request (a block with a 70 KB namespace failed every demotion after it). Each
bound is checked at the edge with InvalidArgument saying what to change, and again where the value is
used, so no path (a peer's block, a recovered file) gets past one check by skipping the other.

The bounds are generous for real models: DeepSeek-class layouts (61 layers, 1 latent head of 576),
Llama-class ones (126 layers, 8 KV heads of 128) and 64K-token blocks fit with room to spare.
"""

from __future__ import annotations

import math
import unicodedata

from engram.errors import InvalidArgument

MAX_NAMESPACE_BYTES = 1024  # utf-8; a namespace travels in every key root and block file
MAX_SESSION_ID_BYTES = 256
MAX_NAME_BYTES = 1024  # a model's name and weights_id
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_BLOCK_TOKENS = 1 << 16
MAX_WINDOW = 1 << 20  # keys a sliding layer sees
MAX_APPROX_K = 1 << 16  # approx replay re-runs approx_k * W tokens
MAX_EXPECT_BACK_MS = 86_400_000  # a session's hint of when it is back: a day at most
MAX_SHAPE_DIMS = 8  # a block's shape has 5 dimensions, a window's 5, a stream's entry 1-3


def check_length(what: str, value: str, limit: int) -> None:
    n = len(value.encode("utf-8", "surrogatepass"))
    if n > limit:
        raise InvalidArgument(f"{what} is {n} bytes long; at most {limit} bytes (utf-8) are allowed: use a shorter one")


def check_namespace(namespace: str) -> str:
    check_length("the namespace", namespace, MAX_NAMESPACE_BYTES)
    return namespace


# Control characters (C0, DEL, C1: a newline, a carriage return, a terminal's escape) and the line and paragraph
# separators: what ends or rewrites a line of a log or a terminal
LINE_BREAKING = frozenset({"Cc", "Zl", "Zp"})


def check_session_id(session_id: str) -> str:
    """Within MAX_SESSION_ID_BYTES, and no control character nor line separator: the daemon names ids in its log
    and its answers, and an id with a newline wrote a line of its client's choosing into the log (an audit, session
    47). Refused at OpenSession (and ForkSession) rather than escaped everywhere an id is shown: no client needs one,
    and sessions do not outlive a restart, so no stored id is refused later. (Namespaces are not checked so: they
    are in stored blocks' keys, and logged quoted.)"""
    check_length("the session id", session_id, MAX_SESSION_ID_BYTES)
    bad = next((i for i, c in enumerate(session_id) if unicodedata.category(c) in LINE_BREAKING), None)
    if bad is not None:
        raise InvalidArgument(f"the session id holds a control character ({session_id[bad]!r}, character {bad}); "
                              "use printable characters")
    return session_id


def check_approx_k(approx_k: float) -> float:
    """A replay factor: finite and in [0, MAX_APPROX_K] (NaN and Inf used to fail only at Resume)."""
    if not math.isfinite(approx_k) or not 0 <= approx_k <= MAX_APPROX_K:
        raise InvalidArgument(f"approx_k must be a finite number in [0, {MAX_APPROX_K}] (approx mode replays "
                              f"approx_k * W tokens), got {approx_k}")
    return approx_k


def check_count(what: str, count: int, limit: int) -> None:
    """A repeated field's length, checked before its items are converted one by one (a RegisterModel of 15 M
    layers built every LayerSpec before the layout refused them: 35 s on the event loop, an audit)."""
    if count > limit:
        raise InvalidArgument(f"{what}: {count} given, at most {limit} are allowed")


def check_dimension(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must be in [{low}, {high}], got {value}")


def check_expect_back_ms(wait_ms: float) -> float:
    """A session's hint of when it is back: 0 (none) up to a day."""
    if not 0 <= wait_ms <= MAX_EXPECT_BACK_MS:
        raise InvalidArgument(f"expect_back_ms must be between 0 and {MAX_EXPECT_BACK_MS} (a day), got {wait_ms}")
    return wait_ms
