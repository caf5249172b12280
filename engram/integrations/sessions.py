"""Keeping a daemon session in step with a serving stack's requests, for stacks that do not speak sessions.

An agent harness behind a serving stack (vLLM, a transformers loop) sends each turn as a whole prompt: the
conversation so far. `SessionLink.join` makes the daemon's session of that agent hold the prompt: an append of
the new tokens when the prompt extends what the session held, else the session opened afresh on the prompt
(new to this process, closed on the daemon since (idle, or a restart), or its context rewritten by the
harness). Its blocks are then held by a live session (eviction's held classes) and carry its hint
(expect_back_ms: eviction's hint order, prefetch). Sessions are opened in persist mode: the daemon needs no
model of its own for them. What a session holds is remembered by length and hash, not by its tokens (long
prompts x many sessions), for the last MAX_SESSIONS sessions. A failed call is logged and counted, never
raised: the request it follows is done.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from engram import limits
from engram.api import SessionMode
from engram.errors import EngramError, InvalidArgument, NotFound
from engram.integrations.registration import Registration

log = logging.getLogger("engram.integrations")

MAX_SESSIONS = 65536


@dataclass(frozen=True)
class _Known:
    tokens: int  # the prompt the daemon's session holds: its length
    digest: int  # and its xxh3


def _digest(tokens: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(tokens.tobytes())


def wait_ms(value: Any, what: str = "expect_back_ms") -> int:
    """A hint as a caller sent it (JSON: any number), checked as the daemon checks it (the wire field is
    unsigned, so a negative one must not reach it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of milliseconds, got {value!r}")
    return int(limits.check_expect_back_ms(value))


class SessionLink:
    """The daemon's sessions of one model and namespace, kept in step through a (sync) client."""

    def __init__(self, model: Registration, *, namespace: str | None = None, hint_name: str = "expect_back_ms"
                 ) -> None:
        self.model = model  # its client makes the calls; a session is opened on its fingerprint
        self.client = model.client
        self.namespace = namespace
        self.hint_name = hint_name  # how the caller spells the hint, for its error messages
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self.failures = 0

    def join(self, session_id: str, prompt: Any, expect_back_ms: Any = 0) -> bool:
        """Make session `session_id` hold `prompt` with the hint (0: none). Returns whether it did."""
        toks = np.asarray(prompt, dtype=np.int32)
        try:
            back = wait_ms(expect_back_ms, self.hint_name)
        except InvalidArgument as exc:  # nothing sent: what the session holds is still known
            return self._failed(session_id, exc)
        known = self._known.pop(session_id, None)  # until the calls below succeed, unknown
        try:
            if known is not None and known.tokens <= len(toks) and _digest(toks[:known.tokens]) == known.digest:
                try:
                    self.client.append_session(session_id, toks[known.tokens:], expect_back_ms=back,
                                               namespace=self.namespace)
                except NotFound:  # closed on the daemon since
                    self._open(session_id, toks, back)
            else:
                self._open(session_id, toks, back)
        except EngramError as exc:
            return self._failed(session_id, exc)
        self._known[session_id] = _Known(len(toks), _digest(toks))
        while len(self._known) > MAX_SESSIONS:
            self._known.popitem(last=False)
        return True

    def _failed(self, session_id: str, exc: EngramError) -> bool:
        self.failures += 1
        log.warning("Engram session %r was not updated (the KV is stored all the same): %s", session_id, exc)
        return False

    def _open(self, session_id: str, toks: np.ndarray, back: int) -> None:
        def open_() -> None:
            self.model.call(lambda fp: self.client.open_session(fp, mode=SessionMode.PERSIST, session_id=session_id,
                                                                tokens=toks, namespace=self.namespace))
        try:
            open_()
        except InvalidArgument as exc:
            if "already exists" not in str(exc):
                raise
            self.client.close_session(session_id, namespace=self.namespace)  # it holds another context: reset
            open_()
        if back:
            self.client.append_session(session_id, toks[:0], expect_back_ms=back, namespace=self.namespace)
