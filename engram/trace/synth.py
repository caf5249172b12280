"""Synthetic agent traces: a system prompt every session shares, a repository each session reads once,
per-session histories that grow turn by turn, and sub-agents that fork a parent's prefix. Block ids are
chained as in Mooncake's traces: a block's id stands for its whole prefix."""

from __future__ import annotations

import random
from typing import Any

from engram.trace.formats import Request


class _Chain:
    """Assigns chained ids: (parent id, block content) -> id, so equal prefixes get equal ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, str], int] = {}

    def extend(self, ids: list[int], contents: list[str]) -> list[int]:
        out = list(ids)
        for c in contents:
            out.append(self._ids.setdefault((out[-1] if out else -1, c), len(self._ids)))
        return out


def agent_trace(sessions: int = 24, turns: int = 6, seed: int = 0, *, system_blocks: int = 4,
                repo_blocks: int = 12, turn_blocks: tuple[int, int] = (1, 4), fork_p: float = 0.3,
                concurrent: int = 6) -> list[Request]:
    rng = random.Random(seed)
    chain = _Chain()
    system = chain.extend([], [f"system{i}" for i in range(system_blocks)])
    live: list[dict[str, Any]] = []
    out: list[Request] = []
    t = 0
    started = 0
    while started < sessions or live:
        while started < sessions and len(live) < concurrent:
            parent = rng.choice(live) if live and rng.random() < fork_p else None
            if parent is not None:  # a sub-agent: its parent's prefix, then its own task
                ids = chain.extend(list(parent["ids"]), [f"task{started}"])
            else:
                repo = rng.randrange(3)  # a few repositories; each session reads one once
                ids = chain.extend(system, [f"repo{repo}-{i}" for i in range(repo_blocks)])
            live.append({"id": f"s{started}", "ids": ids, "turns": 0, "parent": parent["id"] if parent else ""})
            started += 1
        s = rng.choice(live)
        n = rng.randint(*turn_blocks)
        s["ids"] = chain.extend(list(s["ids"]), [f"{s['id']}-t{s['turns']}-{i}" for i in range(n)])
        s["turns"] = int(s["turns"]) + 1
        done = int(s["turns"]) >= turns
        seen = tuple(s["ids"])
        out.append(Request(t, seen, len(seen) * 512, 256 * n, str(s["id"]),
                           str(s["parent"]) if s["turns"] == 1 else "", done, scope=""))
        if done:
            live.remove(s)
        t += rng.randint(50, 2000)
    return out
