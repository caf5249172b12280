"""What an operator asks of a running daemon: which namespaces and sessions it holds, where a session's
blocks live, and evicting blocks on request (engram ls / show / evict / pin).

Read-only queries walk the index and the session table when asked; nothing here runs on the put/get path
and nothing touches recency or hit counters (inspecting a cache must not change what it evicts next).

Eviction keeps prefix closure: evicting a block evicts every block that extends it (its descendants), so
no stored block is ever left unreachable from its root. Pinned blocks in that closure refuse the whole
request unless forced. Blocks being read or moved right now are skipped, with their ancestors (which
cannot go while a descendant stays), and reported, never waited for.
"""

from __future__ import annotations

import bisect
import string
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engram.api import BlockDetail, EvictResult, NamespaceSummary, SessionSummary
from engram.codec import stored
from engram.errors import FailedPrecondition, InvalidArgument, NotFound, brief
from engram.index import BlockMeta
from engram.sessions import Session, SessionManager
from engram.store import BlockStore


@dataclass(frozen=True)
class SessionChain:
    """A session with the stored chain its tokens resolve to now."""

    session: Session
    blocks: tuple[BlockMeta, ...]  # in chain order
    cached_tokens: int
    tiers: tuple[str, ...]  # fastest first
    stored_bytes: int
    age_s: float

    def summary(self, *, model_seen: bool = True) -> SessionSummary:
        return SessionSummary(info=self.session.info(model_seen=model_seen), cached_tokens=self.cached_tokens,
                              blocks=len(self.blocks), tiers=self.tiers, stored_bytes=self.stored_bytes,
                              age_s=self.age_s)


class Inspector:
    def __init__(self, store: BlockStore, sessions: SessionManager) -> None:
        self.store = store
        self.sessions = sessions

    # ---- listings ------------------------------------------------------------------------------

    def namespaces(self) -> list[NamespaceSummary]:
        acc: dict[str, list[int]] = {}
        for ns in self.store.namespaces_in_use():  # the index's tallies: no walk over every block
            t = self.store.stored_in(ns)
            acc[ns] = [t.blocks, t.nbytes, t.tokens, t.pinned, 0]
        for s in self.sessions.sessions():
            acc.setdefault(s.namespace, [0, 0, 0, 0, 0])[4] += 1
        return [NamespaceSummary(ns, *row) for ns, row in sorted(acc.items())]

    def session_list(self, namespace: str | None, tenant: str = "") -> list[SessionChain]:
        """Sessions of one namespace, or of every namespace when namespace is None; `tenant`'s own only ("": every
        one's), as `sessions_in`."""
        return [self.chain(s, tenant) for s in self.sessions_in(namespace, tenant)]

    def sessions_in(self, namespace: str | None, tenant: str = "") -> list[Session]:
        """The sessions `session_list` describes, in its order, not described yet (the caller may describe them
        one by one, letting other calls run between: each is a match of the session's tokens). A tenant's listing
        holds its own sessions only (`Session.seen_by`): in a namespace tenants share it listed every tenant's."""
        chosen = [s for s in self.sessions.sessions_of(tenant) if namespace is None or s.namespace == namespace]
        return sorted(chosen, key=lambda s: (s.namespace, s.created))

    def chain(self, s: Session, tenant: str = "") -> SessionChain:
        """The session's chain as `tenant` ("": an admin, tenancy off) sees it: its tiers are those of its blocks'
        copies, or, in a namespace other tenants share, of their homes alone (`tiers_seen`)."""
        blocks = self._chain(s)
        cached = 0
        for meta in blocks:
            cached = min(len(s.tokens), cached + meta.num_tokens)
        # `tiers_seen`'s choice, made once for the chain (one namespace's): made per block it held the event loop
        # 8 ms (an admin's) to 18 ms (a tenant's) longer for a session of 131,072 blocks
        if self.shows_homes(s.namespace, tenant):
            seen = {m.locations[-1] for m in blocks if m.locations}
        else:
            seen = {name for m in blocks for name in m.locations}
        tiers = sorted(seen, key=self.store.tier_rank)
        return SessionChain(s, blocks, cached, tuple(tiers), sum(m.nbytes for m in blocks),
                              time.time() - s.created)

    def _chain(self, s: Session) -> tuple[BlockMeta, ...]:
        # match, not lookup: an inspection must not count as a hit or a use.
        return self.store.match(s.namespace, s.fingerprint, s.tokens).blocks

    # ---- blocks --------------------------------------------------------------------------------

    def resolve(self, namespace: str | None, prefixes: Sequence[str]) -> list[BlockMeta]:
        """Blocks named by full hex keys or unique hex prefixes, in one namespace (None: every one).
        Another namespace's block is reported exactly like an absent one."""
        wanted = []
        for p in prefixes:
            p = p.strip().lower()
            if not p or any(c not in string.hexdigits for c in p):
                raise InvalidArgument(f"{brief(p)!r} is not a hex block key or key prefix (as `engram show` prints)")
            wanted.append(p)
        found: list[BlockMeta] = []
        hexes: list[str] = []  # every key of the namespace, sorted once, for short prefixes (a scan of them all
        metas: list[BlockMeta] = []  # per prefix stalled the daemon: 1,024 prefixes of 8,192 blocks took 1.5 s)
        for p in wanted:
            whole = self.store.block(bytes.fromhex(p)) if len(p) % 2 == 0 else None
            if whole is not None and whole.key.hex() == p and namespace in (None, whole.namespace):
                found.append(whole)
                continue
            if not hexes:
                ordered = sorted(((m.key.hex(), m) for m in self.store.blocks(namespace)), key=lambda e: e[0])
                hexes, metas = [h for h, _ in ordered], [m for _, m in ordered]
            # keys starting with p sort between p and p + "g" (after every hex digit)
            hits = metas[bisect.bisect_left(hexes, p) : bisect.bisect_left(hexes, p + "g")]
            if not hits:
                raise NotFound(f"no stored block has a key starting with {brief(p)}" +
                               ("" if namespace is None else f" in namespace {namespace!r}"))
            if len(hits) > 1:
                raise InvalidArgument(f"key prefix {brief(p)} matches {len(hits)} blocks; give more hex digits")
            found.append(hits[0])
        return found

    def describe(self, metas: Iterable[BlockMeta], session: Session | None = None, *, tenant: str = ""
                 ) -> list[BlockDetail]:
        """Blocks as `engram show` prints them. `sessions` counts the live sessions holding each (the references
        eviction reads), and `session` (when its chain is described) for every block of it: a block its tokens
        reach without its holding it (a longer block stored over its partial tail) is still on its way. `tenant`:
        whose call it is ("": an admin's, tenancy off: everyone's figures). A tenant sees its own: the sessions are
        its sessions, the pins those it may lift (its own, and those of no recorded owner a restart gave back), as
        its Stats counts them; in a namespace tenants share it saw every tenant's sessions and pins on the blocks
        (a review, session 49). Hits and leases are not kept per tenant: in a namespace other tenants share too, a
        tenant is shown 0 for both (they moved with the others' reads: a review, session 50), and of the tiers the
        block's home alone (`tiers_seen`: the others' reads copy blocks up). A model it has not
        registered is shown as one nobody registered
        (engram/registry.py): no codec, and no fingerprint (b""). In a namespace tenants share, another tenant's
        blocks told their model's exact fingerprint (an audit, session 48)."""
        now = time.time()
        starts: dict[bytes, int] = {}

        def refs(m: BlockMeta) -> int:
            held = m.refs if not tenant else (m.owner_refs or {}).get(tenant, 0)
            return held + (session is not None and session.held.get(m.key) is not m)

        def pins(m: BlockMeta) -> int:
            return m.pins if not tenant else m.owner_pins(tenant) + m.owner_pins("")

        def model(m: BlockMeta) -> bytes:
            return m.model_fingerprint if self.sees_model(m.model_fingerprint, tenant) else b""

        shared = self.store.namespaces.shared

        def others_read(m: BlockMeta) -> bool:  # (hits and leases are every tenant's)
            return bool(tenant) and shared(m.namespace)

        return [BlockDetail(
            key=m.key, parent=m.parent, namespace=m.namespace, model_fingerprint=model(m),
            num_tokens=m.num_tokens, full=m.full, tiers=self.tiers_seen(m, tenant), codec=self._codec(m, tenant),
            checksum=m.checksum, nbytes=m.nbytes, pins=pins(m), children=m.children, sessions=refs(m),
            refcount=m.children + refs(m) + pins(m), leases=0 if others_read(m) else m.leases,
            hits=0 if others_read(m) else m.hits, age_s=now - m.created,
            start_token=self._start(m, starts)) for m in metas]

    def tiers_seen(self, meta: BlockMeta, tenant: str = "") -> tuple[str, ...]:
        """The tiers `tenant` ("": an admin, tenancy off) is shown holding the block: every tier with a complete
        copy, fastest first; a tenant's call in a namespace other tenants share, its home alone, the slowest tier
        holding a copy (the one that keeps it: NVMe once it is durable). A copy above the home is made by a read, and
        by every tenant's: a Get copies a block up from NVMe into DRAM (promotion), so the block's tiers told the
        others of the namespace who had read which of its blocks (session 50's loose ends). The home moves only when
        the block is written down to a slower tier (write-back's flush, or a demotion before it), when its home's
        copy is dropped as damaged (up, to the next copy, until it is written down again), or when it leaves."""
        locations = meta.locations
        if locations and self.shows_homes(meta.namespace, tenant):
            return (locations[-1],)
        return tuple(locations)

    def shows_homes(self, namespace: str, tenant: str) -> bool:
        """Whether `tenant` is shown the blocks of `namespace` at their homes (`tiers_seen`)."""
        return bool(tenant) and self.store.namespaces.shared(namespace)

    def sees_model(self, fingerprint: bytes, tenant: str = "") -> bool:
        """Whether `tenant` ("": an admin, tenancy off) may see the model: it registered it (engram/registry.py)."""
        return self.store.registry.knows(fingerprint, tenant)

    def _codec(self, meta: BlockMeta, tenant: str = "") -> str:
        # A recovered block whose model file was lost keeps its bytes but has no known codec until registered.
        if not self.sees_model(meta.model_fingerprint, tenant):
            return "unknown (model not registered)"
        spec = self.store.spec(meta.model_fingerprint)
        codec = spec.stored_codec
        # a block kept lossless by the codec fallback (engram/store/quality.py) is a v1 block of the raw codec,
        # which no block in the model's own quantizing codec is as large as
        if (not stored.is_raw(codec) and not stored.is_streams(codec)
                and meta.nbytes == stored.lossless_nbytes(meta.shape, meta.dtype)):
            return f"raw (lossless fallback; the model's codec is {codec})"
        return spec.codec

    def _start(self, meta: BlockMeta, known: dict[bytes, int]) -> int:
        """The block's first token position: up the chain to the root, or to a block whose start `known` holds
        (the describe call's earlier answers: a chain described whole is one walk, not one per block)."""
        path, parent = [], self.store.block(meta.parent)
        while parent is not None and parent.key not in known:
            path.append(parent)
            parent = self.store.block(parent.parent)
        start = 0 if parent is None else known[parent.key] + parent.num_tokens
        for m in reversed(path):
            known[m.key] = start
            start += m.num_tokens
        known[meta.key] = start
        return start

    # ---- eviction ------------------------------------------------------------------------------

    def session_blocks_to_evict(self, s: Session, tenant: str = "") -> list[BlockMeta]:
        """The blocks of a session's chain that no other session runs through (a suffix of the chain:
        a block shared with another session shares its ancestors too). A block's `refs` counts the live sessions
        holding it (engram/sessions.py keeps it, eviction reads it): re-matching every session's tokens here
        stalled the daemon for every tenant (0.4 s a call behind 64 sessions of 4,096 blocks). A tenant's call in a
        namespace other tenants share reads its own sessions' references alone (`BlockMeta.owner_refs`): the blocks
        another's sessions hold as well are named too, and `evict` keeps them (`in_use`), as it keeps them named by
        key (left out, the blocks missing from the answer told which of them the others' sessions hold)."""
        if self._among_others(s.namespace, tenant):
            return [m for m in self._chain(s) if (m.owner_refs or {}).get(tenant, 0) <= 1]
        return [m for m in self._chain(s) if m.refs <= 1]

    def namespace_blocks(self, namespace: str) -> list[BlockMeta]:
        return self.store.blocks(namespace)

    def _among_others(self, namespace: str, tenant: str) -> bool:
        """A tenant's call ("": an admin's, tenancy off) in a namespace other tenants share."""
        return bool(tenant) and self.store.namespaces.shared(namespace)

    @staticmethod
    def _liftable_pins(meta: BlockMeta, tenant: str) -> int:
        """The pins on the block `tenant` may lift: its own, and those of no recorded owner (as store.pin)."""
        return meta.owner_pins(tenant) + meta.owner_pins("")

    @staticmethod
    def _held_by_another(meta: BlockMeta, tenant: str) -> bool:
        """Kept from a tenant's evict in a namespace other tenants share: another owner's session holds the block
        (an admin's too), a pin the tenant may not lift, or a read or move under way (any tenant's: leases are
        not kept per tenant)."""
        return (meta.refs > (meta.owner_refs or {}).get(tenant, 0) or meta.operator_pins > 0
                or meta.pinned_by_another(tenant) or meta.leases > 0 or meta.moving)

    async def evict(self, metas: Sequence[BlockMeta], *, force: bool, tenant: str = "") -> EvictResult:
        """Evict the blocks and their descendants. `tenant`: whose call it is ("": an admin, tenancy off). Its
        force lifts its own pins (and those of no recorded owner), never the operator's (an admin's) nor another
        tenant's in a namespace they share: such a block stays, with its ancestors, reported in `operator_pinned`,
        as the tenant's unpin leaves it (store.pin). A tenant's forced evict removed the blocks an operator, or
        another tenant of the namespace, had pinned (an audit, session 48).

        In a namespace other tenants share, a tenant's evict removes only what no one else holds: a block another
        owner's session holds, a pin it may not lift, or a read or move under way keeps the block and its ancestors,
        all reported together in `in_use`, the reason not told (a review, session 51: Bob's evict removed the blocks
        Carol's sessions ran through, and its answer told her sessions, her pins and everyone's reads apart), and
        only the pins it may lift refuse it unforced (another's pin refused it, naming the block)."""
        closure = self._closure(metas)
        shared = {ns for ns in {m.namespace for m in closure} if self._among_others(ns, tenant)}
        pinned = [m for m in closure
                  if (self._liftable_pins(m, tenant) if m.namespace in shared else m.pins)]
        if pinned and not force:
            raise FailedPrecondition(
                f"{len(pinned)} of the {len(closure)} blocks to evict (descendants included) are pinned"
                f"{' by you (or by no recorded owner)' if shared else ''}, e.g. {pinned[0].key.hex()}; unpin them "
                "(engram unpin) or pass --force")
        inside = {m.key: m for m in closure}
        held: dict[bytes, None] = {}
        # kept for a pin not the caller's (a tenant's force: the operator's or another tenant's), with their ancestors
        operators: dict[bytes, None] = {}
        in_use: dict[bytes, None] = {}  # kept from a tenant's evict in a shared namespace, with their ancestors
        evicted, unpinned = [], 0
        for meta in closure:  # deepest first, so every block is a leaf when its turn comes
            if meta.key in held or meta.key in operators or meta.key in in_use or self.store.block(meta.key) is not meta:
                continue
            if meta.namespace in shared:
                if self._held_by_another(meta, tenant) or meta.children:
                    self._hold(meta, inside, in_use)
                    continue
            elif tenant and (meta.operator_pins or meta.pinned_by_another(tenant)):
                self._hold(meta, inside, operators)
                continue
            # Read or moving (now: a reader may come while earlier removals wait on the disk), or above a block
            # that stays: held, with its ancestors.
            elif meta.leases or meta.moving or meta.children:
                self._hold(meta, inside, held)
                continue
            if meta.pins:  # no await between here and the removal's own check: a pin is lifted only if it goes
                self.store.lift_pins(meta)
                unpinned += 1
            await self.store.remove(meta)
            evicted.append(meta.key)
        return EvictResult(tuple(evicted), tuple(held), unpinned, tuple(k for k in operators if k not in held),
                           tuple(in_use))

    def _closure(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """The blocks and all their descendants, deepest first."""
        depth: dict[bytes, tuple[int, BlockMeta]] = {}
        stack = [(m, 0) for m in metas]
        while stack:
            meta, d = stack.pop()
            if meta.key in depth and depth[meta.key][0] >= d:
                continue
            depth[meta.key] = (d, meta)
            stack.extend((child, d + 1) for child in self.store.children(meta.key))
        return [m for _, m in sorted(depth.values(), key=lambda dm: -dm[0])]

    @staticmethod
    def _hold(meta: BlockMeta, inside: dict[bytes, BlockMeta], held: dict[bytes, None]) -> None:
        """A block that stays, and its ancestors within the closure (each keeps a child)."""
        m: BlockMeta | None = meta
        while m is not None and m.key in inside and m.key not in held:
            held[m.key] = None
            m = inside.get(m.parent)
