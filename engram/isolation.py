"""Isolation checks: one tenant (the owner) writes, another (the prober) tries every path to what it wrote.

Each check pairs a probe with a positive control: the owner must reach its own blocks, sessions and
figures through the same path (on the tier under test), and the prober must not. A check whose control
fails proves nothing (caching off passes every denial), so it is reported as "no control", not as
isolated. Statuses: "isolated", "leak", "no control", "not checked" (a path this run cannot reach, with
the reason).

Paths: Lookup by content; Get, Pin, DescribeBlocks and Evict by the owner's keys; naming the owner's
namespace; Get asking for zero-copy descriptors (the request only: whether the shared memory itself is
isolated is the hit path's business, reported "not checked"); sessions by id; inspection and Stats; a model
only the owner registered (the model registry); the key salt (per namespace, secret, dependent on `auth.salt_secret`); and, with a cluster, the Redis index
(keys an attacker with Redis access could compute) and peer fetch through a second daemon. Timing: the
prober's Lookup answer times for prefixes the owner holds against absent ones (ROC AUC; 0.5 = no
signal), beside the same measure inside the owner's namespace, which must show a signal (else the probe
could not see a leak either).

What this module does not do: start daemons or Redis (engram/isolation_rig.py does, for
`engram verify-isolation`), or move blocks between tiers (the rig asks the store to).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from engram import errors
from engram.client import EngramClient
from engram.keys import chain_keys
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

ISOLATED, LEAK, NO_CONTROL, NOT_CHECKED = "isolated", "leak", "no control", "not checked"
AUC_MARGIN = 0.1  # |AUC - 0.5| beyond this across namespaces is a timing leak (benchmarks: <= 0.6)
SIGNAL_AUC = 0.6  # inside one namespace the probe must separate held from absent at least this well


def probe_model() -> ModelSpec:
    """A small model (2 global layers of 2 KV heads x 16, 16-token blocks, raw): 4 KiB blocks, so a run
    puts hundreds of blocks in seconds."""
    layers = (LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)) * 2
    return ModelSpec("engram-isolation-probe", "v1", KVLayout(layers, 2, 16, DType.BF16, block_tokens=16), codec="raw")


def prefix(spec: ModelSpec, blocks: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 32_000, blocks * spec.layout.block_tokens, dtype=np.int32)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(spec.layout.block_shape(len(toks)), generator=gen).to(spec.layout.dtype.torch_dtype)
    return toks, kv


@dataclass(frozen=True)
class Check:
    path: str
    tier: str  # the tier the owner's blocks were in, or "-" where no tier applies
    status: str
    detail: str = ""


@dataclass(frozen=True)
class Timing:
    samples: int  # lookups per class (per run)
    across_auc: float  # the prober: prefixes the owner holds against absent ones
    within_auc: float  # the owner: its own held prefixes against absent ones (the probe's sensitivity)
    across_median_us: tuple[float, float]  # (held, absent)
    within_median_us: tuple[float, float]
    runs: int = 1  # measurements taken; with more than one, this is the one with the median across AUC

    @property
    def status(self) -> str:
        if abs(self.across_auc - 0.5) > AUC_MARGIN:
            return LEAK
        return ISOLATED if self.within_auc >= SIGNAL_AUC else NO_CONTROL


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    timing: Timing | None = None

    @property
    def leaks(self) -> list[str]:
        out = [f"{c.path} [{c.tier}]: {c.detail}" for c in self.checks if c.status == LEAK]
        if self.timing is not None and self.timing.status == LEAK:
            out.append(f"timing: the prober's AUC is {self.timing.across_auc:.3f} (0.5 = no signal)")
        return out

    @property
    def inconclusive(self) -> list[str]:
        out = [f"{c.path} [{c.tier}]" for c in self.checks if c.status == NO_CONTROL]
        if self.timing is not None and self.timing.status == NO_CONTROL:
            out.append("timing (no signal even inside one namespace)")
        return out

    def to_dict(self) -> dict[str, Any]:
        timing = None
        if self.timing is not None:
            timing = {**asdict(self.timing), "status": self.timing.status}
        return {"leaks": self.leaks, "inconclusive": self.inconclusive, "checks": [asdict(c) for c in self.checks],
                "timing": timing}


def verdict(path: str, tier: str, control: bool, denied: bool, detail: str = "") -> Check:
    if not denied:
        return Check(path, tier, LEAK, detail or "the other namespace reached the owner's data")
    if not control:
        return Check(path, tier, NO_CONTROL, detail or "the owner could not reach its own data: this proves nothing")
    return Check(path, tier, ISOLATED, detail)


async def refused(call: Callable[[], Awaitable[Any]], *codes: type[errors.EngramError]) -> bool:
    """Whether a call fails with one of `codes` (a leak when it succeeds, or fails otherwise)."""
    try:
        await call()
    except codes:
        return True
    except errors.EngramError:
        return False
    return False


async def succeeds(call: Callable[[], Awaitable[Any]]) -> bool:
    try:
        await call()
    except errors.EngramError:
        return False
    return True


@dataclass
class Written:
    """A prefix the owner stored: what the probes look for."""

    fp: bytes
    tokens: np.ndarray
    kv: torch.Tensor
    keys: list[bytes]


class Prober:
    """The owner and the prober: two clients (two tokens) of one daemon."""

    def __init__(self, owner: EngramClient, other: EngramClient, owner_ns: str, other_ns: str) -> None:
        self.owner, self.other = owner, other
        self.owner_ns, self.other_ns = owner_ns, other_ns
        self.spec = probe_model()

    async def register(self) -> bytes:
        fp = await self.owner.register_model(self.spec)
        await self.other.register_model(self.spec)
        return fp

    async def write(self, fp: bytes, blocks: int, seed: int) -> Written:
        toks, kv = prefix(self.spec, blocks, seed)
        put = await self.owner.put(fp, toks, kv, namespace=self.owner_ns, skip_cached=False)
        return Written(fp, toks, kv, list(put.keys))

    # ---- blocks, on one tier ----------------------------------------------------------------------

    async def blocks(self, w: Written, tier: str) -> list[Check]:
        """Every path to the owner's blocks by content and by key, the blocks being in `tier` ("-": wherever
        they are). The owner's own Get comes last: a read from a lower tier promotes the block."""
        o, p, fp = self.owner, self.other, w.fp
        hexes = [k.hex() for k in w.keys]
        look = await o.lookup(fp, w.tokens, namespace=self.owner_ns)
        placed = look.matched_tokens == len(w.tokens) and (tier == "-" or all(b.tier == tier for b in look.blocks))
        where = f"the owner's blocks are in {sorted({b.tier for b in look.blocks}) or 'no tier'}"
        checks = [verdict("lookup by content", tier, placed,
                          (await p.lookup(fp, w.tokens, namespace=self.other_ns)).matched_tokens == 0,
                          "" if placed else where)]
        checks.append(verdict("naming the owner's namespace", tier, placed, await refused(
            lambda: p.lookup(fp, w.tokens, namespace=self.owner_ns), errors.PermissionDenied)))
        checks.append(verdict("get by key", tier, placed, await refused(
            lambda: p.get(fp, w.keys, namespace=self.other_ns, zero_copy=False), errors.NotFound)))
        checks.append(verdict("zero-copy get by key (the request)", tier, placed, await refused(
            lambda: p.get(fp, w.keys, namespace=self.other_ns, zero_copy=True), errors.NotFound)))
        checks.append(verdict("pin by key", tier, placed, await refused(
            lambda: p.pin(fp, w.keys, namespace=self.other_ns), errors.NotFound)))
        described = await succeeds(lambda: o.describe_blocks(key_prefixes=hexes, namespace=self.owner_ns))
        checks.append(verdict("describe blocks by key", tier, placed and described, await refused(
            lambda: p.describe_blocks(key_prefixes=hexes, namespace=self.other_ns), errors.NotFound)))
        checks.append(verdict("evict by key", tier, placed and described, await refused(
            lambda: p.evict(key_prefixes=hexes[-1:], namespace=self.other_ns), errors.NotFound)))
        got = torch.cat(await o.get(fp, w.keys, namespace=self.owner_ns, zero_copy=False), dim=2)
        zc = torch.cat(await o.get(fp, w.keys, namespace=self.owner_ns, zero_copy=True), dim=2)
        intact = torch.equal(got, w.kv) and torch.equal(zc, w.kv)
        checks.append(verdict("the owner's data intact after the probes", tier, intact, True,
                              "" if intact else "the owner's blocks came back different"))
        return checks

    # ---- sessions, inspection, figures ------------------------------------------------------------

    async def sessions(self, w: Written) -> list[Check]:
        o, p = self.owner, self.other
        sid = f"iso-{random.getrandbits(32):08x}"
        await o.open_session(w.fp, mode="persist", session_id=sid, tokens=w.tokens, namespace=self.owner_ns)
        try:
            control = sid in {s.info.session_id for s in await o.list_sessions(namespace=self.owner_ns)}
            checks = []
            for name, call in (("resume", lambda: p.resume(sid, namespace=self.other_ns)),
                               ("fork", lambda: p.fork_session(sid, namespace=self.other_ns)),
                               ("append", lambda: p.append_session(sid, [1], namespace=self.other_ns)),
                               ("suspend", lambda: p.suspend_session(sid, namespace=self.other_ns)),
                               ("describe", lambda: p.describe_blocks(session_id=sid, namespace=self.other_ns)),
                               ("close", lambda: p.close_session(sid, namespace=self.other_ns))):
                checks.append(verdict(f"session {name} by id", "-", control, await refused(call, errors.NotFound)))
            listed = {s.info.session_id for s in await p.list_sessions(namespace=self.other_ns)}
            checks.append(verdict("session listing", "-", control, sid not in listed))
            checks.append(verdict("session listing of every namespace", "-", control, await refused(
                lambda: p.list_sessions(all_namespaces=True), errors.PermissionDenied)))
            return checks
        finally:
            await o.close_session(sid, namespace=self.owner_ns)

    async def figures(self, w: Written) -> list[Check]:
        o, p = self.owner, self.other
        mine = await o.stats()
        control = self.owner_ns in {n.namespace for n in mine.namespaces} and \
            sum(m.blocks for m in mine.models if m.model_fingerprint == w.fp) >= len(w.keys)
        theirs = await p.stats()
        other_blocks = (await p.describe_namespace(self.other_ns)).blocks
        return [
            verdict("stats: namespaces", "-", control, self.owner_ns not in {n.namespace for n in theirs.namespaces}),
            verdict("stats: per-model blocks", "-", control,
                    sum(m.blocks for m in theirs.models) == other_blocks,
                    f"the prober's Stats counts {sum(m.blocks for m in theirs.models)} blocks, it holds {other_blocks}"),
            verdict("describe the owner's namespace", "-", control, await refused(
                lambda: p.describe_namespace(self.owner_ns), errors.PermissionDenied)),
            verdict("list namespaces", "-", control, await refused(p.list_namespaces, errors.PermissionDenied)),
            verdict("check (admin only)", "-", control, await refused(p.check, errors.PermissionDenied)),
        ]

    # ---- the model registry -----------------------------------------------------------------------

    async def models(self) -> Check:
        """A model the owner registered and the prober did not: the prober's Lookup naming it must answer as one
        naming a fingerprint nobody registered (an answer that differed told it which models the owner runs).
        The model is the probe model under a name of the owner's namespace, so a run against a live daemon adds
        one model per owner, whichever tokens a later run swaps."""
        spec = replace(self.spec, weights_id=f"owner-only/{self.owner_ns}")
        nobody = replace(self.spec, weights_id=f"nobody/{random.getrandbits(64):016x}").fingerprint
        fp = await self.owner.register_model(spec)
        toks, _ = prefix(spec, 1, seed=0)
        control = await succeeds(lambda: self.owner.lookup(fp, toks, namespace=self.owner_ns))

        async def answer(fingerprint: bytes) -> str:
            try:
                await self.other.lookup(fingerprint, toks, namespace=self.other_ns)
            except errors.EngramError as exc:
                return f"{type(exc).__name__}: {str(exc).replace(fingerprint.hex(), '<fp>')}"
            return "OK"

        theirs, unknown = await answer(fp), await answer(nobody)
        return verdict("a model only the owner registered", "-", control, theirs == unknown,
                       "" if theirs == unknown else f"the prober got {theirs!r}, for an unknown model {unknown!r}")

    # ---- the key salt -----------------------------------------------------------------------------

    async def salts(self, w: Written, salt_under_another_secret: bytes | None) -> list[Check]:
        """Keys the prober could compute: without a salt, with its own salt, and whether the salt changes
        with the daemon's secret (`salt_under_another_secret`: the owner's salt from a daemon with another
        `auth.salt_secret`; None where this run cannot start one)."""
        bt = self.spec.layout.block_tokens
        owner_salt = (await self.owner.describe_namespace(self.owner_ns)).key_salt
        other_salt = (await self.other.describe_namespace(self.other_ns)).key_salt
        keys = set(w.keys)
        control = bool(owner_salt) and [k for k, _, _ in chain_keys(self.owner_ns, w.fp, w.tokens, bt, owner_salt)] == \
            w.keys
        unsalted = {k for k, _, _ in chain_keys(self.owner_ns, w.fp, w.tokens, bt)}
        with_own = {k for k, _, _ in chain_keys(self.owner_ns, w.fp, w.tokens, bt, other_salt)}
        checks = [
            verdict("key salt: per namespace", "-", control, owner_salt != other_salt,
                    "" if owner_salt != other_salt else "both namespaces have the same salt"),
            verdict("key salt: keys need it", "-", control, not unsalted & keys,
                    "" if not unsalted & keys else "the owner's keys are computable without a salt"),
            verdict("key salt: another tenant's salt", "-", control, not with_own & keys,
                    "" if not with_own & keys else "the prober computes the owner's keys with its own salt"),
        ]
        if salt_under_another_secret is None:
            checks.append(Check("key salt: depends on auth.salt_secret", "-", NOT_CHECKED,
                                "needs a second daemon with another secret (the built-in run starts one)"))
        else:
            same = salt_under_another_secret == owner_salt
            checks.append(verdict("key salt: depends on auth.salt_secret", "-", control, not same,
                                  "the salt is the same under another auth.salt_secret" if same else ""))
        return checks

    def candidate_keys(self, w: Written, other_salt: bytes) -> set[bytes]:
        """Keys of the owner's prefix an attacker who reads Redis could compute: unsalted, or with a salt
        it knows (its own)."""
        bt = self.spec.layout.block_tokens
        return {k for salt in (b"", other_salt) for k, _, _ in chain_keys(self.owner_ns, w.fp, w.tokens, bt, salt)}

    # ---- timing -----------------------------------------------------------------------------------

    async def timing_verdict(self, fp: bytes, samples: int, *, seed: int = 10_000) -> Timing:
        """`timing`, measured again twice when the first run does not come out isolated, keeping the run
        with the median across-namespace AUC: one run of a loaded machine (a GC pause, another process)
        can tilt an AUC past the margin; a real leak tilts all three."""
        first = await self.timing(fp, samples, seed=seed)
        if first.status == ISOLATED:
            return first
        runs = sorted([first, await self.timing(fp, samples, seed=seed + 1),
                       await self.timing(fp, samples, seed=seed + 2)], key=lambda t: t.across_auc)
        middle = runs[1]
        return Timing(middle.samples, middle.across_auc, sorted(t.within_auc for t in runs)[1],
                      middle.across_median_us, middle.within_median_us, runs=3)

    async def timing(self, fp: bytes, samples: int, *, pool: int = 8, blocks: int = 64, repeat: int = 3,
                     seed: int = 10_000) -> Timing:
        """Lookup answer times: the prober's for `pool` prefixes the owner holds against `pool` absent ones,
        `samples` per class, in a random interleaving (so drift hits both classes alike); and the owner's
        own, the same way, as the probe's sensitivity. Each sample is the fastest of `repeat` back-to-back
        lookups of one prefix: on a loaded machine a preempted lookup takes milliseconds longer, and the
        minimum keeps what the daemon's own work costs (held prefixes of 64 blocks make that work differ
        clearly inside a namespace)."""
        held = [prefix(self.spec, blocks, seed + i)[0] for i in range(pool)]
        absent = [prefix(self.spec, blocks, seed + pool + i)[0] for i in range(pool)]
        for i, toks in enumerate(held):
            _, kv = prefix(self.spec, blocks, seed + i)
            await self.owner.put(fp, toks, kv, namespace=self.owner_ns, skip_cached=False)

        async def measure(client: EngramClient, ns: str) -> tuple[list[float], list[float]]:
            order = [(h, i % pool) for i in range(samples) for h in (True, False)]
            random.Random(seed).shuffle(order)
            for toks in held[:4] + absent[:4]:  # warm up the channel and the code paths
                await client.lookup(fp, toks, namespace=ns)
            out: tuple[list[float], list[float]] = ([], [])
            for is_held, i in order:
                toks = held[i] if is_held else absent[i]
                best = None
                for _ in range(repeat):
                    t0 = time.perf_counter_ns()
                    await client.lookup(fp, toks, namespace=ns)
                    took = time.perf_counter_ns() - t0
                    best = took if best is None else min(best, took)
                out[0 if is_held else 1].append((best or 0) / 1000)
            return out

        across = await measure(self.other, self.other_ns)
        within = await measure(self.owner, self.owner_ns)
        return Timing(samples, roc_auc(*across), roc_auc(*within), (_median(across[0]), _median(across[1])),
                      (_median(within[0]), _median(within[1])))


def _median(xs: Sequence[float]) -> float:
    return float(np.median(xs))


def roc_auc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """P(a positive's time > a negative's time) + P(equal) / 2: the ROC AUC of time as a classifier of
    "held" (the Mann-Whitney U statistic over n_pos * n_neg). 0.5: no signal either way."""
    pos, neg = np.asarray(positive, dtype=float), np.asarray(negative, dtype=float)
    ranks = _ranks(np.concatenate([pos, neg]))
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
