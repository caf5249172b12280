"""Synthetic agent traces. Block ids are chained as in Mooncake's traces: a block's id stands for its whole
prefix, and every id is in the global hash scope (formats.py).

- `agent_trace`: the small generator the policy benchmarks were first measured with (benchmarks/trace_policy.py):
  a 4-block system prompt, one of 3 repositories read once per session, histories growing 1-4 blocks a turn,
  sub-agents forking a live parent; one timestamp gap between any two requests.
- `agent_workload` (parameters: `AgentWorkload`): closer to coding agents: a long shared system prompt, a few
  shared tool-definition prefixes, repository context shared by the sessions in a repository, model replies
  and tool results alternating, think time while tools run or the user answers, sub-agents (nested) that
  start from their parent's head prefix or fork its history while the parent waits, sessions arriving over
  time. Seeded: the same parameters give the same trace.
- `conversation_trace`: chats in Mooncake's format (no sessions): a shared system prompt, conversations arriving
  as a Poisson process, each turn re-sending its history plus 1-4 new blocks after a think time drawn uniformly
  from 30-600 s. Think times that long and that flat make LRU thrash: it evicts the longest-idle chat, the one
  nearest its next turn (benchmarks/RESULTS.md trace_policy: engram = LRU, the optimum 2.5x)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

from engram.limits import MAX_EXPECT_BACK_MS
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


# ---- agent workloads ------------------------------------------------------------------------------------

# A trace is built whole in memory before it is written (and `engram bench trace` reads it whole): about 30 bytes
# a block access while built (16.6 M accesses took 0.5 GB), 5.5 in the file. Past these bounds a typo'd size
# (--sessions 99999999999999999999) ran until the machine was out of memory.
MAX_BLOCK_ACCESSES = 50_000_000  # block ids over every request: ~1.5 GB built, ~275 MB written, a minute
MAX_REQUESTS = 10_000_000  # requests (each a Request, even one of no blocks)
MAX_SESSIONS = 1_000_000  # top-level sessions, each made up front
MAX_PREFIXES = 1_000_000  # toolsets and repos: each a list (and a repo its weight) made up front, whatever its blocks


@dataclass(frozen=True)
class AgentWorkload:
    """Parameters of `agent_workload` (docs/ARCHITECTURE.md "Trace replay" has them as a table). Ranges are
    (low, high), inclusive, drawn uniformly; every draw comes from one random.Random(seed)."""

    sessions: int = 64  # top-level agent sessions
    seed: int = 0
    block_tokens: int = 64  # tokens per block; input_length is written as blocks x block_tokens
    system_blocks: int = 256  # the system prompt every session opens with (16k tokens at 64-token blocks)
    toolsets: int = 3  # distinct tool-definition prefixes after the system prompt; a session uses one
    tool_blocks: int = 96  # blocks of one toolset's definitions
    repos: int = 4  # repositories; a session works in one, picked with weights 1, 1/2, 1/3 ... (a few are hot)
    repo_blocks: int = 48  # a repository's context read at session start (its instructions, the file tree):
    # shared by every session in that repository, since it comes right after the same system and tools
    turns: tuple[int, int] = (8, 40)  # requests of a top-level session
    subagent_turns: tuple[int, int] = (3, 12)  # requests of a sub-agent
    user_blocks: tuple[int, int] = (1, 4)  # a user message: the first turn's, and later turns' with user_p
    tool_result_blocks: tuple[int, int] = (1, 24)  # a tool's result (a file read, a command's output)
    assistant_blocks: tuple[int, int] = (1, 4)  # the model's reply (a tool call): the request's output
    task_blocks: tuple[int, int] = (1, 6)  # the task a sub-agent is given
    tool_ms: tuple[int, int] = (300, 8000)  # think time while a tool runs: the gap before the next request
    user_ms: tuple[int, int] = (10_000, 120_000)  # think time waiting on the user
    user_p: float = 0.1  # the chance that a turn waits on the user rather than on a tool
    subagent_p: float = 0.08  # the chance per turn that the session starts a sub-agent and waits for it
    fork_history_p: float = 0.5  # the chance that a sub-agent carries its parent's whole history (a fork);
    # otherwise it starts from the parent's system, tools and repository context only
    max_depth: int = 2  # sub-agents may start sub-agents down to this depth (1: only top-level sessions do)
    arrival_ms: int = 20_000  # mean gap between top-level session starts (exponential)
    hint_noise: float = 0.5  # back_ms hints (what a client would send as expect_back_ms): a tool call's is its
    # true wait times a log-normal error of this sigma (0.5: half of them within x0.71-1.4 of the truth); a wait
    # for the user is hinted as user_ms's middle (the client only knows a human is next); a wait for a
    # sub-agent, and a session's last request, are not hinted. Drawn from their own generator: the ids and
    # times do not depend on it. A negative sigma writes no hints.

    def check(self) -> None:
        """ValueError naming the first parameter no workload can have (a zero arrival gap divided by zero, an
        endless noise overflowed, negative times wrote a trace no replay reads)."""
        for name in ("sessions", "block_tokens", "toolsets", "repos", "max_depth", "arrival_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("system_blocks", "tool_blocks", "repo_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("turns", "subagent_turns", "user_blocks", "tool_result_blocks", "assistant_blocks", "task_blocks",
                     "tool_ms", "user_ms"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be LOW,HIGH with 0 <= LOW <= HIGH, got {low},{high}")
        for name in ("turns", "subagent_turns"):
            if getattr(self, name)[0] < 1:
                raise ValueError(f"{name} must be at least 1 request, got {getattr(self, name)}")
        for name in ("user_p", "subagent_p", "fork_history_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {getattr(self, name)}")
        if not math.isfinite(self.hint_noise):
            raise ValueError(f"hint_noise must be finite (negative: no hints), got {self.hint_noise}")
        self._check_size()

    def _check_size(self) -> None:
        """ValueError when the trace would not fit the bounds above: each size alone (a single request's blocks
        are made at once), then the accesses the whole trace is expected to hold."""
        if self.sessions > MAX_SESSIONS:
            raise ValueError(f"sessions must be at most {MAX_SESSIONS:,}, got {self.sessions:,}")
        for name in ("toolsets", "repos"):  # 50 M of them took GBs before a block was made (MemoryError)
            if getattr(self, name) > MAX_PREFIXES:
                raise ValueError(f"{name} must be at most {MAX_PREFIXES:,}, got {getattr(self, name):,}")
        for name in ("system_blocks", "tool_blocks", "repo_blocks"):
            if getattr(self, name) > MAX_BLOCK_ACCESSES:
                raise ValueError(f"{name} must be at most {MAX_BLOCK_ACCESSES:,}, got {getattr(self, name):,}")
        for name in ("turns", "subagent_turns", "user_blocks", "tool_result_blocks", "assistant_blocks", "task_blocks"):
            if getattr(self, name)[1] > MAX_BLOCK_ACCESSES:
                raise ValueError(f"{name}'s HIGH must be at most {MAX_BLOCK_ACCESSES:,}, got {getattr(self, name)[1]:,}")
        expected = self.expected_accesses()
        if expected > MAX_BLOCK_ACCESSES:
            raise ValueError(f"these parameters make a trace of about {expected:,.0f} block accesses (each request "
                             f"re-sends its session's prefix), more than the {MAX_BLOCK_ACCESSES:,} `trace synth` "
                             "builds in memory: fewer sessions or turns, or shorter prefixes")

    def expected_accesses(self) -> float:
        """The block ids a trace of these parameters holds, about: each top-level session's requests at their mean
        count, each its head and what the turns before it added, at the mean sizes, and the toolsets' prefixes
        (made up front). Sub-agents are left out, so a trace holds more (the default: 0.87 M expected, 1.45 M)."""
        def mean(r: tuple[int, int]) -> float:
            return (r[0] + r[1]) / 2

        turns = mean(self.turns)
        head = self.system_blocks + self.tool_blocks + self.repo_blocks + mean(self.user_blocks)
        growth = (mean(self.assistant_blocks) + (1 - self.user_p) * mean(self.tool_result_blocks)
                  + self.user_p * mean(self.user_blocks))
        per_session = turns * head + growth * turns * (turns - 1) / 2
        return self.sessions * per_session + self.toolsets * (self.system_blocks + self.tool_blocks)


@dataclass
class _Agent:
    id: str
    parent: str
    depth: int
    ids: list[int]
    turns_left: int
    head: int  # blocks of its system, tools and repository context
    children: int = 0
    first: bool = True


def agent_workload(params: AgentWorkload | None = None, **overrides: Any) -> list[Request]:
    """A synthetic agent workload (AgentWorkload's fields, or keyword overrides of its defaults): sessions
    arrive over time, open with a long shared system prompt, one of a few tool-definition prefixes and their
    repository's context (shared by every session in the repository), then alternate model replies and tool
    results, pausing between requests for tool calls (seconds) or the user (minutes). A session may start a
    sub-agent (from its head prefix, or forking its whole history) and wait for it to close; sub-agents nest
    to max_depth. Requests come in timestamp order, in the session format with every id in the global scope
    (block ids chained: equal prefixes, equal ids)."""
    p = dataclasses.replace(params or AgentWorkload(), **overrides)
    p.check()
    rng = random.Random(p.seed)
    hint_rng = random.Random(f"{p.seed}-hints")

    def hinted(gap: int, user: bool) -> None:
        if p.hint_noise >= 0:
            back = (p.user_ms[0] + p.user_ms[1]) / 2 if user else gap * hint_rng.lognormvariate(0.0, p.hint_noise)
            out[-1] = dataclasses.replace(out[-1], back_ms=min(MAX_EXPECT_BACK_MS, max(1, round(back))))
    chain = _Chain()
    bt = p.block_tokens
    system = chain.extend([], [f"system{i}" for i in range(p.system_blocks)])
    tools = [chain.extend(system, [f"tools{k}-{i}" for i in range(p.tool_blocks)]) for k in range(p.toolsets)]
    heads: dict[tuple[int, int], list[int]] = {}
    # summed once (choices(weights=) sums them at every call: a session cost O(repos)); the same draws
    repo_weights = list(itertools.accumulate(1 / (k + 1) for k in range(p.repos)))

    def span(r: tuple[int, int]) -> int:
        return rng.randint(*r)

    def grow(a: _Agent, kind: str, n: int) -> None:
        a.ids = chain.extend(a.ids, [f"{a.id}-{len(a.ids)}-{kind}{i}" for i in range(n)])

    events: list[tuple[int, int, _Agent]] = []
    seq = itertools.count()
    agents: dict[str, _Agent] = {}
    t = 0.0
    for k in range(p.sessions):
        t += rng.expovariate(1 / p.arrival_ms) if k else 0.0
        toolset, repo = rng.randrange(p.toolsets), rng.choices(range(p.repos), cum_weights=repo_weights)[0]
        head = heads.get((toolset, repo))
        if head is None:
            head = heads[(toolset, repo)] = chain.extend(tools[toolset], [f"repo{repo}-{i}"
                                                                          for i in range(p.repo_blocks)])
        a = agents[f"s{k}"] = _Agent(f"s{k}", "", 0, list(head), span(p.turns), len(head))
        grow(a, "user", span(p.user_blocks))
        heapq.heappush(events, (int(t), next(seq), a))
    out: list[Request] = []
    accesses = 0
    while events:
        now, _, a = heapq.heappop(events)
        accesses += len(a.ids)
        if accesses > MAX_BLOCK_ACCESSES or len(out) >= MAX_REQUESTS:
            raise ValueError(f"the trace passed {MAX_BLOCK_ACCESSES:,} block accesses or {MAX_REQUESTS:,} requests "
                             f"at request {len(out) + 1:,} (sub-agents and long turns add to the expected "
                             f"{p.expected_accesses():,.0f}): fewer sessions or turns, or shorter prefixes")
        a.turns_left -= 1
        done = a.turns_left <= 0
        out_blocks = span(p.assistant_blocks)
        out.append(Request(now, tuple(a.ids), len(a.ids) * bt, out_blocks * bt, a.id, a.parent if a.first else "",
                           done, scope=""))
        a.first = False
        if done:
            parent = agents.get(a.parent)
            if parent is not None:  # the parent resumes with the sub-agent's answer as a tool result
                grow(parent, "answer", span(p.tool_result_blocks))
                heapq.heappush(events, (now + span(p.tool_ms), next(seq), parent))
            continue
        grow(a, "reply", out_blocks)
        if a.depth < p.max_depth and rng.random() < p.subagent_p:
            a.children += 1
            cid = f"{a.id}.{a.children}"
            base = list(a.ids) if rng.random() < p.fork_history_p else a.ids[: a.head]
            child = agents[cid] = _Agent(cid, a.id, a.depth + 1, base, span(p.subagent_turns), a.head)
            grow(child, "task", span(p.task_blocks))
            heapq.heappush(events, (now + span(p.tool_ms), next(seq), child))
            continue  # the parent waits for its sub-agent
        user = rng.random() < p.user_p
        if user:
            grow(a, "user", span(p.user_blocks))
            gap = span(p.user_ms)
        else:
            grow(a, "tool", span(p.tool_result_blocks))
            gap = span(p.tool_ms)
        heapq.heappush(events, (now + gap, next(seq), a))
        hinted(gap, user)
    return out


def conversation_trace(conversations: int = 2000, seed: int = 0, *, system_blocks: int = 2,
                       first_blocks: tuple[int, int] = (2, 12), turn_blocks: tuple[int, int] = (1, 4),
                       mean_turns: float = 5.0, think_s: tuple[float, float] = (30.0, 600.0),
                       arrival_s: float = 2.0) -> list[Request]:
    """Multi-turn chats without session fields: conversation c arrives after an exponential gap of mean
    `arrival_s`, opens with the system prompt and `first_blocks` of its own, and runs 1 + Exp(mean_turns) turns,
    each re-sending the whole history and adding `turn_blocks` after a think time uniform in `think_s`.
    Requests in time order, timestamps in ms."""
    rng = random.Random(seed)
    ids = itertools.count(system_blocks + 1)
    system = list(range(1, system_blocks + 1))
    events: list[tuple[float, tuple[int, ...]]] = []
    start = 0.0
    for _ in range(conversations):
        start += rng.expovariate(1 / arrival_s)
        history = system + [next(ids) for _ in range(rng.randint(*first_blocks))]
        at = start
        for _ in range(1 + int(rng.expovariate(1 / mean_turns))):
            events.append((at, tuple(history)))
            history = history + [next(ids) for _ in range(rng.randint(*turn_blocks))]
            at += rng.uniform(*think_s)
    events.sort(key=lambda e: e[0])
    return [Request(int(at * 1000), hist) for at, hist in events]
