"""A bound on the lines one kind of event logs: a burst (a disk gone bad fails every read of it) logs its first
lines whole and counts the rest, which the next line let through names, instead of flooding the log."""

from __future__ import annotations

import time


class LogBudget:
    """At most `lines` lines every `per_s` seconds."""

    def __init__(self, lines: int = 20, per_s: float = 60.0) -> None:
        self.lines = lines
        self.per_s = per_s
        self._since = -per_s  # the start of the current period
        self._said = 0  # lines let through in it
        self.held = 0  # lines held back since the last one let through

    def take(self) -> int | None:
        """None when this line is to be held back (counted); else how many were held back before it."""
        now = time.monotonic()
        if now - self._since >= self.per_s:
            self._since, self._said = now, 0
        if self._said >= self.lines:
            self.held += 1
            return None
        self._said += 1
        held, self.held = self.held, 0
        return held
