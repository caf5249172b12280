"""The chain index: block metadata by key, and the longest-prefix match over a token sequence.

Full blocks are found by walking the chain of keys that the query's tokens hash to (O(blocks) dict
lookups). Where the walk stops, the query's next tokens may still share a prefix with a stored child of
the last matched block: a partial tail (whose key the query cannot compute, not knowing its length) or a
block that diverges from the query part-way. KV is causal, so the first m tokens of such a block serve
the query's next m tokens: every block is therefore also listed under its parent, and the match ends with
the child sharing the longest prefix with the query (the last block then counts only m of its tokens;
callers slice). A key match is only a hint: stored tokens are always compared.

Finding that child costs the same whatever the fan-out: up to `_SCAN_LIMIT` children of a block are
compared one by one; past that they are also kept in a token trie (`_Children`), where each step of the
match is one dictionary probe by the query's next token and a child sits at the shortest prefix that sets
it apart from its siblings. The work is bounded by the block's length, not by how many blocks extend the
same prefix (a shared system prompt can have thousands). `ChainIndex.probes` counts that work.

The index is partitioned by namespace: a match walks only its own namespace's tables, so a lookup by one
tenant never reads (and so cannot time) another tenant's entries. A flat table by key serves the store's
own bookkeeping (eviction, recovery), never a tenant's query.

The index also keeps what Stats reports of its blocks (`Tally`: per model and per tier, each namespace's and the
daemon's, and each namespace's blocks by home tier; a namespace's logical bytes and referenced blocks), up to date as blocks are added and removed, gain or
lose a copy in a tier (`add_copy`, `drop_copy`), a pin (`set_pins`) or a session's reference (`add_refs`): Stats
runs on the daemon's event loop, and walking every block for it (three walks; seconds at a million blocks)
stalled every request in flight for as long, each time `engram top` or a client's check() asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from engram.block import BlockRecord
from engram.keys import block_key_of_bytes, root_key
from engram.layout import DType

if TYPE_CHECKING:
    from engram.eviction import Expected

K = TypeVar("K")  # a tally's key: a tier's name or a model's fingerprint


@dataclass(slots=True)
class BlockMeta:
    key: bytes
    parent: bytes
    namespace: str
    model_fingerprint: bytes
    tokens: bytes  # int32 little-endian
    num_tokens: int
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    locations: list[str]  # tiers holding a complete copy, fastest first
    full: bool  # num_tokens == block_tokens
    pins: int = 0  # every pin, a tenant's or the operator's; set through ChainIndex.set_pins once indexed
    operator_pins: int = 0  # of them, taken by an admin (or with tenancy off): no tenant's pin share counts them
    pin_held_children: int = 0  # indexed children kept by a tenant's pin (pinned, or extended by a pinned block)
    # Of the tenant pins, each tenant's (its pins are its own to lift, and count in its share alone); those no owner
    # is recorded for are the owner "" (`owner_pins`): restored from an earlier build's journal, which kept counts
    # only, or of a tenant no longer given the namespace (engram/store/pins.py `restore`)
    pin_owners: dict[str, int] | None = None
    held_for: dict[str, int] | None = None  # per pin owner: the indexed children that owner's pins keep
    leases: int = 0
    children: int = 0  # indexed blocks whose parent this is; only leaves (0) may be evicted
    tick: int = 0  # the clock's reading at its last use (engram/eviction.py); 0: never used
    uses: int = 0  # comebacks: uses after its first put, counted across deletions (eviction.py's ghosts)
    cls: int = 0  # its eviction class at its last use (eviction.py); -1: already counted gone
    chosen: int = 0  # which eviction orders picked it as a victim (eviction.py: 1 recency, 2 density, 4 hint)
    moving: bool = False  # a copy to another tier is being written: not a victim until it lands
    hits: int = 0
    refs: int = 0  # live sessions whose prefix holds this block (engram/sessions.py); eviction prefers 0
    # Of them, each tenant's sessions' (a tenant's Stats and DescribeBlocks count its own: in a namespace tenants
    # share, they told it what the others' sessions hold); the rest are of the owner "" (admins, tenancy off)
    owner_refs: dict[str, int] | None = None
    holder: Expected | None = None  # eviction.Expected of the last session that took a reference: when it said it is back
    created: float = field(default_factory=time.time)

    # Written out rather than generated by @dataclass (which keeps a class's own __init__): compiled, the generated
    # one stayed a Python function that set every field through the generic attribute path, 8% of a replayed miss
    # (benchmarks/RESULTS.md trace_speed, session 54); this one stores them directly. The fields above, in order,
    # with their defaults (tests/test_index.py checks they agree).
    def __init__(self, key: bytes, parent: bytes, namespace: str, model_fingerprint: bytes, tokens: bytes,
                 num_tokens: int, dtype: DType, shape: tuple[int, ...], nbytes: int, checksum: int,
                 locations: list[str], full: bool, pins: int = 0, operator_pins: int = 0, pin_held_children: int = 0,
                 pin_owners: dict[str, int] | None = None, held_for: dict[str, int] | None = None, leases: int = 0,
                 children: int = 0, tick: int = 0, uses: int = 0, cls: int = 0, chosen: int = 0,
                 moving: bool = False, hits: int = 0, refs: int = 0, owner_refs: dict[str, int] | None = None,
                 holder: Expected | None = None, created: float | None = None) -> None:
        self.key = key
        self.parent = parent
        self.namespace = namespace
        self.model_fingerprint = model_fingerprint
        self.tokens = tokens
        self.num_tokens = num_tokens
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes
        self.checksum = checksum
        self.locations = locations
        self.full = full
        self.pins = pins
        self.operator_pins = operator_pins
        self.pin_held_children = pin_held_children
        self.pin_owners = pin_owners
        self.held_for = held_for
        self.leases = leases
        self.children = children
        self.tick = tick
        self.uses = uses
        self.cls = cls
        self.chosen = chosen
        self.moving = moving
        self.hits = hits
        self.refs = refs
        self.owner_refs = owner_refs
        self.holder = holder
        self.created = time.time() if created is None else created

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and self.leases == 0 and not self.moving

    @property
    def tenant_pins(self) -> int:
        """The pins a tenant's share counts (engram/store/pins.py): all but the operator's."""
        return self.pins - self.operator_pins

    @property
    def pin_held(self) -> bool:
        """Kept by a tenant's pin: pinned itself, or extended by a pinned block (only leaves leave the last tier,
        so a pin keeps every block its chain runs through). What the namespace's pinned bytes count; an operator's
        pin keeps a block from eviction just the same (`evictable`), outside every share."""
        return self.pins > self.operator_pins or self.pin_held_children > 0

    def owner_pins(self, owner: str) -> int:
        """The tenant pins of `owner` ("": those of no recorded owner)."""
        owners = self.pin_owners or {}
        return owners.get(owner, 0) if owner else self.tenant_pins - sum(owners.values())

    def held_by(self, owner: str) -> bool:
        """Kept by `owner`'s pins: pinned by it, or extended by a block it pinned (`pin_held`, one owner's)."""
        return self.owner_pins(owner) > 0 or bool(self.held_for and self.held_for.get(owner))

    def counted_for(self, owner: str) -> bool:
        """Kept by pins that `owner`'s share counts as held (PinShare.check): its own, and those of no recorded
        owner (`pin_owners`: counted in every tenant's held bytes of the namespace), so pinning it adds nothing to
        that share. (Counting only its own, a tenant's pins restored owner-less were counted twice after a restart,
        and pinning its own chain again was refused: a review, session 49.)"""
        return self.held_by(owner) or (owner != "" and self.held_by(""))

    def holders(self) -> set[str]:
        """The pin owners keeping it (`held_by`)."""
        out = {o for o in (self.pin_owners or ()) if self.pin_owners and self.pin_owners[o]}
        if self.owner_pins(""):
            out.add("")
        out.update(self.held_for or ())
        return out

    def pinned_by_another(self, tenant: str) -> bool:
        """Another tenant's pin (a recorded owner's) holds it: not `tenant`'s to lift."""
        return any(n and o != tenant for o, n in (self.pin_owners or {}).items())

    @property
    def tier(self) -> str:
        """The fastest tier holding the block: where reads go."""
        return self.locations[0]

    def record(self) -> BlockRecord:
        # tuple.__new__, as the named tuple's own __new__ does, without the Python frame of that __new__ (every
        # copy a tier takes builds one: 3% of a compiled replayed miss)
        return tuple.__new__(BlockRecord, (self.key, self.parent, self.model_fingerprint, self.namespace, self.dtype,
                                           self.full, self.shape, self.tokens, self.nbytes, self.checksum))

    @classmethod
    def from_record(cls, rec: BlockRecord, locations: list[str]) -> BlockMeta:
        return cls(key=rec.key, parent=rec.parent, namespace=rec.namespace, model_fingerprint=rec.model_fingerprint,
                   tokens=rec.tokens, num_tokens=rec.num_tokens, dtype=rec.dtype, shape=rec.shape, nbytes=rec.nbytes,
                   checksum=rec.checksum, locations=locations, full=rec.full)

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<i4")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class PrefixMatch:
    blocks: tuple[BlockMeta, ...]
    matched_tokens: int


_SCAN_LIMIT = 8  # children of one block compared one by one; past this many, the trie finds the best


class _Node:
    """A trie node at depth d: the children whose first d tokens are this node's path."""

    __slots__ = ("ends", "next")

    def __init__(self) -> None:
        self.next: dict[int, _Node | BlockMeta] = {}  # token at depth d -> a deeper node, or the one child there
        self.ends: list[BlockMeta] = []  # children of exactly d tokens (partial blocks)


def _token(meta: BlockMeta, d: int) -> int:
    return int.from_bytes(meta.tokens[4 * d : 4 * d + 4], "little", signed=True)


def _place(node: _Node, meta: BlockMeta, d: int) -> None:
    if d == meta.num_tokens:
        node.ends.append(meta)
    else:
        node.next[_token(meta, d)] = meta


class _Children:
    """The blocks that extend one parent: by key, and past `_SCAN_LIMIT` of them also in a token trie."""

    __slots__ = ("by_key", "partials", "trie")

    def __init__(self) -> None:
        self.by_key: dict[bytes, BlockMeta] = {}
        self.partials: dict[bytes, BlockMeta] = {}  # the partial ones: each put of a full block reads them
        self.trie: _Node | None = None

    def __len__(self) -> int:
        return len(self.by_key)

    def add(self, meta: BlockMeta) -> None:
        self.by_key[meta.key] = meta
        if not meta.full:
            self.partials[meta.key] = meta
        if self.trie is not None:
            self._insert(meta)
        elif len(self.by_key) > _SCAN_LIMIT:
            self.trie = _Node()
            for m in self.by_key.values():
                self._insert(m)

    def remove(self, key: bytes) -> None:
        meta = self.by_key.pop(key, None)
        if self.partials:  # (most parents have none: no probe)
            self.partials.pop(key, None)
        if meta is None or self.trie is None:
            return
        path: list[tuple[_Node, int]] = []  # (node, the token leading out of it) down to the child
        node, d = self.trie, 0
        while True:
            if d == meta.num_tokens:
                node.ends.remove(meta)
                break
            tok = _token(meta, d)
            slot = node.next[tok]
            if isinstance(slot, _Node):
                path.append((node, tok))
                node, d = slot, d + 1
                continue
            del node.next[tok]
            break
        while path and not node.next and not node.ends:  # prune the branch that led only to it
            node, tok = path.pop()
            del node.next[tok]

    def _insert(self, meta: BlockMeta) -> None:
        assert self.trie is not None
        node, d = self.trie, 0
        while d < meta.num_tokens:
            tok = _token(meta, d)
            slot = node.next.get(tok)
            if slot is None:
                break
            if isinstance(slot, BlockMeta):  # a sibling shares this token: both move one level down
                deeper = _Node()
                _place(deeper, slot, d + 1)
                node.next[tok] = slot = deeper
            node, d = slot, d + 1
        _place(node, meta, d)

    def best(self, tail: np.ndarray, count: Callable[[int], None]) -> tuple[BlockMeta | None, int]:
        """The child sharing the longest prefix with `tail`, and how many tokens it shares (0: none)."""
        if self.trie is None:
            best: BlockMeta | None = None
            best_m = 0
            for cand in self.by_key.values():
                count(1)
                m = _common_prefix(cand.token_array(), tail)
                if m > best_m:
                    best, best_m = cand, m
            return best, best_m
        node, d = self.trie, 0
        while d < len(tail):
            count(1)
            slot = node.next.get(int(tail[d]))
            if slot is None:
                break
            if isinstance(slot, BlockMeta):  # the only child with these d + 1 tokens
                return slot, _common_prefix(slot.token_array(), tail)
            node, d = slot, d + 1
        if d == 0:
            return None, 0
        while not node.ends:  # every child below shares exactly d tokens with the tail: any one serves
            count(1)
            slot = next(iter(node.next.values()))
            if isinstance(slot, BlockMeta):
                return slot, d
            node = slot
        return node.ends[0], d


@dataclass(slots=True)
class Tally:
    """Blocks, stored bytes, tokens and pinned blocks (any pin) of a group of indexed blocks: a model's, or the
    copies one tier holds."""

    blocks: int = 0
    nbytes: int = 0
    tokens: int = 0
    pinned: int = 0

    def count(self, meta: BlockMeta, sign: int) -> None:
        self.blocks += sign
        self.nbytes += sign * meta.nbytes
        self.tokens += sign * meta.num_tokens
        if meta.pins:
            self.pinned += sign

    def copy(self) -> Tally:
        return Tally(self.blocks, self.nbytes, self.tokens, self.pinned)

    def add(self, other: Tally) -> None:
        self.blocks += other.blocks
        self.nbytes += other.nbytes
        self.tokens += other.tokens
        self.pinned += other.pinned


@dataclass
class _Space:
    """One namespace's part of the index."""

    entries: dict[bytes, BlockMeta] = field(default_factory=dict)
    children: dict[bytes, _Children] = field(default_factory=dict)  # parent key -> the blocks extending it
    nbytes: int = 0  # physical bytes: each stored block once
    pinned: int = 0  # bytes of its blocks a tenant's pin keeps (BlockMeta.pin_held)
    pinned_by: dict[str, int] = field(default_factory=dict)  # the same per pin owner (held_by): what a share counts
    models: dict[bytes, Tally] = field(default_factory=dict)  # its blocks per model: a model holding none may go
    tiers: dict[str, Tally] = field(default_factory=dict)  # its blocks' copies per tier
    logical: int = 0  # each block's bytes once per session referencing it (once if none does)
    referenced: int = 0  # blocks some live session references
    # The same per tenant, of its own sessions' references alone (`BlockMeta.owner_refs`): the blocks they hold,
    # and the bytes their second and later references add to the namespace's physical bytes
    referenced_by: dict[str, int] = field(default_factory=dict)
    extra_by: dict[str, int] = field(default_factory=dict)
    # Per tier, the blocks a tenant's pins keep pinned there, as a tenant sees them (the pins it may lift: its own,
    # and those of no recorded owner, the owner ""): a block with pins of no recorded owner is counted under ""
    # alone, any other under each tenant pinning it, so a tenant's figure, its own and ""'s added, counts each
    # block once (`_lifters`)
    pinned_tiers_by: dict[str, dict[str, int]] = field(default_factory=dict)
    # Each block once, in its home: the slowest tier holding a copy, the one that keeps it (`home_of`). Copies above
    # it come and go with reads (a hit copies a block up) and with every other reader's: in a namespace tenants share,
    # a tenant's Stats count its blocks here, so another tenant's read moves none of its figures
    homes: dict[str, Tally] = field(default_factory=dict)
    pinned_homes_by: dict[str, dict[str, int]] = field(default_factory=dict)  # as pinned_tiers_by, per home


TIER_RANK = {"hbm": 0, "dram": 1, "nvme": 2}  # the tiers fastest first, until the store gives the index its own


def _count_copy(tiers: dict[str, Tally], meta: BlockMeta, name: str, sign: int) -> None:
    t = tiers.get(name)
    if t is None:
        t = tiers[name] = Tally()
    t.count(meta, sign)


def _bump(tallies: dict[K, Tally], name: K, sign: int, nbytes: int, tokens: int, pinned: int) -> Tally:
    """One block in (sign 1) or out (-1) of the tally `tallies[name]` (made when missing); returns it."""
    t = tallies.get(name)
    if t is None:
        t = tallies[name] = Tally()
    t.blocks += sign
    t.nbytes += nbytes
    t.tokens += tokens
    t.pinned += pinned
    return t


def _lifters(meta: BlockMeta) -> list[str]:
    """The pin owners `_Space.pinned_tiers_by` counts the block under: "" where pins of no recorded owner are among
    its tenant pins (every tenant of the namespace may lift them), else each tenant pinning it."""
    if meta.pins <= meta.operator_pins:
        return []
    if meta.owner_pins("") > 0:
        return [""]
    return [o for o, n in (meta.pin_owners or {}).items() if n > 0]


def _count_lifters(table: dict[str, dict[str, int]], owners: list[str], tiers: Sequence[str], sign: int) -> None:
    """Count a block in (+1) or out of (-1) `table` (a space's pinned_tiers_by or pinned_homes_by) under each of
    `owners`, in `tiers`."""
    for owner in owners:
        counts = table.setdefault(owner, {})
        for name in tiers:
            n = counts.get(name, 0) + sign
            if n:
                counts[name] = n
            else:
                del counts[name]
        if not counts:
            del table[owner]


def _homes(meta: BlockMeta) -> tuple[str, ...]:
    """The block's home as a tuple of at most one tier (its locations are kept fastest first: the last)."""
    return (meta.locations[-1],) if meta.locations else ()


def _count_owner_refs(space: _Space, owner: str, nbytes: int, was: int, now: int) -> None:
    """A block of `nbytes` went from `was` to `now` references of `owner`'s sessions (or in or out of the index
    with them): the owner's referenced blocks and extra logical bytes follow, an owner at zero left out."""
    for table, delta in ((space.referenced_by, (now > 0) - (was > 0)),
                         (space.extra_by, nbytes * (max(1, now) - max(1, was)))):
        if delta:
            left = table.get(owner, 0) + delta
            if left:
                table[owner] = left
            else:
                del table[owner]


def _summed(groups: Iterable[dict[K, Tally]]) -> dict[K, Tally]:
    """The tallies of several groups added up by key (several namespaces' tiers or models), as copies."""
    out: dict[K, Tally] = {}
    for group in groups:
        for name, t in group.items():
            mine = out.get(name)
            if mine is None:
                out[name] = t.copy()
            else:
                mine.add(t)
    return out


IndexListener = Callable[[str, BlockMeta], None]  # ("add" | "remove", block): the cluster index follows
# (key, tenant pins, operator pins, each owner's tenant pins) of an indexed block whose pins changed, (key, 0, 0,
# None) of a pinned block that left the index: the NVMe tier's journal records them, so a restart pins the blocks
# that come back, each tenant's pins its own again
PinsListener = Callable[[bytes, int, int, dict[str, int] | None], None]


class ChainIndex:
    def __init__(self) -> None:
        self._entries: dict[bytes, BlockMeta] = {}
        self.get_entry = self._entries.get  # `get` without a Python frame, for the eviction search's checks
        self._spaces: dict[str, _Space] = {}
        self._models: dict[bytes, Tally] = {}  # blocks per model, every namespace's (holds_model, Stats)
        self._tiers: dict[str, Tally] = {}  # copies per tier, every namespace's (Stats)
        self.rank: dict[str, int] = TIER_RANK  # each tier's place, fastest first (the store sets its placement's)
        self.listeners: list[IndexListener] = []
        self.pins_listener: PinsListener | None = None
        self.probes = 0  # the work of every match so far: key probes, children compared, trie steps
        self._walks: dict[str, list[PrefixWalk]] = {}  # open walks that have given the loop a turn, by namespace

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockMeta]:
        return iter(self._entries.values())

    def get(self, key: bytes) -> BlockMeta | None:
        """By key across namespaces: the store's bookkeeping only; tenant-facing reads use `get_in`."""
        return self._entries.get(key)

    def get_in(self, namespace: str, key: bytes) -> BlockMeta | None:
        space = self._spaces.get(namespace)
        return None if space is None else space.entries.get(key)

    def namespaces(self) -> list[str]:
        return sorted(self._spaces)

    def blocks_in(self, namespace: str) -> list[BlockMeta]:
        space = self._spaces.get(namespace)
        return [] if space is None else list(space.entries.values())

    def holds_model(self, model_fingerprint: bytes, namespaces: Collection[str] | None = None) -> bool:
        """Whether any block of the model is stored in one of `namespaces` (None: in any namespace)."""
        if namespaces is None:
            return model_fingerprint in self._models
        return any(model_fingerprint in space.models
                   for space in (self._spaces.get(ns) for ns in namespaces) if space is not None)

    def physical_bytes(self, namespace: str) -> int:
        space = self._spaces.get(namespace)
        return 0 if space is None else space.nbytes

    def pinned_bytes(self, namespace: str, owner: str | None = None) -> int:
        """Bytes of the namespace's blocks kept by a tenant's pins (`owner`'s alone, when given): each pinned block
        and every block it extends, once."""
        space = self._spaces.get(namespace)
        if space is None:
            return 0
        return space.pinned if owner is None else space.pinned_by.get(owner, 0)

    def pin_growth(self, metas: Sequence[BlockMeta | None], owner: str | None = None) -> int:
        """How many bytes pinning `metas` would add to their namespaces' pinned bytes (`owner`'s share's, when given):
        each one not kept by a pin (that share counts, `BlockMeta.counted_for`) yet, with the blocks it extends that
        are not. A block not indexed yet (a put's, about to be published under its parent) counts as not kept,
        whatever its pins."""
        seen: set[bytes] = set()
        grow = 0
        entries = self._entries
        for meta in metas:
            space = None if meta is None else self._spaces.get(meta.namespace)
            m = meta
            while m is not None and m.key not in seen and not (
                    (m.pin_held if owner is None else m.counted_for(owner)) and entries.get(m.key) is m):
                seen.add(m.key)
                grow += m.nbytes
                m = None if space is None else space.entries.get(m.parent)
        return grow

    def set_pins(self, meta: BlockMeta, pins: int, operator_pins: int = -1, owner: str = "") -> None:
        """Change a block's pin count (and of them the operator's; -1: as many as before); the tenant pins that
        change are `owner`'s ("": of no recorded owner; none left: every owner's go). For an indexed block, its
        namespace's pinned bytes (each owner's too) follow, and so does the pins listener."""
        if operator_pins < 0:
            operator_pins = meta.operator_pins
        if pins < operator_pins:
            raise AssertionError(f"block {meta.key.hex()} unpinned more often than pinned")
        if (pins, operator_pins) == (meta.pins, meta.operator_pins):
            return
        owners = dict(meta.pin_owners or {}) if pins > operator_pins else {}
        if owner and pins > operator_pins:  # ("": the pins of no recorded owner, what the owners' leave)
            n = owners.get(owner, 0) + (pins - operator_pins) - meta.tenant_pins
            if n:
                owners[owner] = n
            else:
                owners.pop(owner, None)
        if (owner and owners.get(owner, 0) < 0) or sum(owners.values()) > pins - operator_pins:
            raise AssertionError(f"block {meta.key.hex()}: more of {owner!r}'s pins lifted than it took")
        before, lifters = meta.holders(), _lifters(meta)
        was, was_pinned = meta.pin_held, meta.pins > 0
        meta.pins, meta.operator_pins, meta.pin_owners = pins, operator_pins, owners or None
        if self._entries.get(meta.key) is not meta:
            return
        space = self._spaces[meta.namespace]
        if (now := _lifters(meta)) != lifters:
            for table, tiers in ((space.pinned_tiers_by, meta.locations), (space.pinned_homes_by, _homes(meta))):
                _count_lifters(table, lifters, tiers, -1)
                _count_lifters(table, now, tiers, 1)
        if was_pinned != (pins > 0):
            self._count_pinned(meta, 1 if pins else -1)
        if was != meta.pin_held:
            self._pin_held_changed(space, meta, meta.pin_held)
        after = meta.holders()
        for o in before ^ after:
            self._owner_held_changed(space, meta, o, o in after)
        if self.pins_listener is not None:
            self.pins_listener(meta.key, pins - operator_pins, operator_pins, meta.pin_owners)

    def _count_pinned(self, meta: BlockMeta, sign: int) -> None:
        space = self._spaces[meta.namespace]
        fp = meta.model_fingerprint
        space.models[fp].pinned += sign
        self._models[fp].pinned += sign
        for name in meta.locations:
            space.tiers[name].pinned += sign
            self._tiers[name].pinned += sign
        for name in _homes(meta):
            space.homes[name].pinned += sign

    def add_copy(self, meta: BlockMeta, tier: str) -> None:
        """A complete copy of the block in `tier` counts now (joins its locations, in tier order); an indexed
        block's figures follow."""
        was = _homes(meta)
        rank, locations = self.rank, meta.locations
        at = len(locations)
        while at and rank[locations[at - 1]] > rank[tier]:
            at -= 1
        locations.insert(at, tier)
        if self._entries.get(meta.key) is meta:
            space = self._spaces[meta.namespace]
            _count_copy(space.tiers, meta, tier, 1)
            _count_copy(self._tiers, meta, tier, 1)
            lifters = _lifters(meta) if meta.pins > meta.operator_pins else []
            if lifters:
                _count_lifters(space.pinned_tiers_by, lifters, (tier,), 1)
            if not was or rank[tier] > rank[was[0]]:  # a slower tier than any before: its new home
                self._move_home(space, meta, was, (tier,), lifters)

    def drop_copy(self, meta: BlockMeta, tier: str) -> bool:
        """The block's copy in `tier` no longer counts (leaves its locations); False if it held none there."""
        if tier not in meta.locations:
            return False
        if self._entries.get(meta.key) is not meta:  # (an evicted block, unindexed first: no figures to follow)
            meta.locations.remove(tier)
            return True
        was = _homes(meta)
        meta.locations.remove(tier)
        space = self._spaces[meta.namespace]
        _count_copy(space.tiers, meta, tier, -1)
        _count_copy(self._tiers, meta, tier, -1)
        lifters = _lifters(meta) if meta.pins > meta.operator_pins else []
        if lifters:
            _count_lifters(space.pinned_tiers_by, lifters, (tier,), -1)
        if was == (tier,):  # its home's copy went: the next slower one (if any) is its home now
            self._move_home(space, meta, was, _homes(meta), lifters)
        return True

    @staticmethod
    def _move_home(space: _Space, meta: BlockMeta, was: tuple[str, ...], now: tuple[str, ...],
                   lifters: list[str]) -> None:
        """An indexed block's home went from `was` to `now` (each a tier or none): its namespace's homes follow."""
        for name in was:
            _count_copy(space.homes, meta, name, -1)
        for name in now:
            _count_copy(space.homes, meta, name, 1)
        if lifters:
            _count_lifters(space.pinned_homes_by, lifters, was, -1)
            _count_lifters(space.pinned_homes_by, lifters, now, 1)

    def add_refs(self, meta: BlockMeta, delta: int, owner: str = "") -> None:
        """One session's reference more (+1) or fewer (-1) on the block, of a session of `owner` (a tenant; "":
        an admin's, or any with tenancy off); an indexed block's namespace's logical bytes and referenced blocks
        follow, and so do the owner's own. Nothing changes when it raises."""
        was = meta.refs
        now = was + delta
        if now < 0:
            raise AssertionError(f"block {meta.key.hex()} unreferenced more often than referenced")
        owners = meta.owner_refs
        mine = owners.get(owner, 0) if owner and owners else 0
        if owner and mine + delta < 0:
            raise AssertionError(f"block {meta.key.hex()} unreferenced by {owner!r} more often than referenced")
        meta.refs = now
        if owner:
            if owners is None:
                owners = meta.owner_refs = {}
            if mine + delta:
                owners[owner] = mine + delta
            else:
                del owners[owner]
                if not owners:
                    meta.owner_refs = None
        if self._entries.get(meta.key) is meta:
            space = self._spaces[meta.namespace]
            space.logical += meta.nbytes * (max(1, now) - max(1, was))
            space.referenced += (now > 0) - (was > 0)
            if owner:
                _count_owner_refs(space, owner, meta.nbytes, mine, mine + delta)

    def _tally(self, space: _Space, meta: BlockMeta, sign: int) -> None:
        """Count a block in (+1) or out of (-1) its namespace's and the daemon's figures, as it is now. (Inline,
        not through Tally.count: every put and eviction comes here, a dozen calls were 10% of an interpreted
        put into a full tier; each table named, not looped over as a tuple of two, nor an empty dict of owners
        made per call: a compiled replayed miss spent 5% here.)"""
        nbytes, tokens, pinned = sign * meta.nbytes, sign * meta.num_tokens, sign if meta.pins else 0
        fp = meta.model_fingerprint
        if not _bump(space.models, fp, sign, nbytes, tokens, pinned).blocks:
            del space.models[fp]  # a model holding no block is not listed (holds_model)
        if not _bump(self._models, fp, sign, nbytes, tokens, pinned).blocks:
            del self._models[fp]
        locations = meta.locations
        for name in locations:
            _bump(space.tiers, name, sign, nbytes, tokens, pinned)
            _bump(self._tiers, name, sign, nbytes, tokens, pinned)
        if locations:  # its home: the slowest copy (locations are fastest first)
            _bump(space.homes, locations[-1], sign, nbytes, tokens, pinned)
        if meta.pins > meta.operator_pins:
            lifters = _lifters(meta)
            _count_lifters(space.pinned_tiers_by, lifters, locations, sign)
            _count_lifters(space.pinned_homes_by, lifters, _homes(meta), sign)
        refs = meta.refs
        space.logical += nbytes * (refs if refs > 1 else 1)
        if refs:
            space.referenced += sign
        if meta.owner_refs:
            for owner, n in meta.owner_refs.items():
                _count_owner_refs(space, owner, meta.nbytes, *((0, n) if sign > 0 else (n, 0)))

    def tier_tallies(self, namespaces: Collection[str] | None = None) -> dict[str, Tally]:
        """The copies each tier holds: of every namespace, or of `namespaces` only."""
        if namespaces is None:
            return _summed((self._tiers,))
        return _summed(space.tiers for space in (self._spaces.get(ns) for ns in set(namespaces))
                       if space is not None)

    def home_tallies(self, namespaces: Collection[str]) -> dict[str, Tally]:
        """Of `namespaces`, each block once, in its home tier (the slowest holding a copy): the figures no read moves
        (a tenant's Stats of a namespace other tenants share)."""
        return _summed(space.homes for space in (self._spaces.get(ns) for ns in set(namespaces)) if space is not None)

    def pinned_tiers(self, namespaces: Collection[str], owner: str, *, homes: bool = False) -> dict[str, int]:
        """Per tier, the blocks of `namespaces` held pinned there by pins tenant `owner` may lift (its own, and
        those of no recorded owner), each block once: its Stats' figure, as its DescribeBlocks counts pins. With
        `homes`, each block in its home tier alone (`home_tallies`)."""
        out: dict[str, int] = {}
        for space in (self._spaces.get(ns) for ns in set(namespaces)):
            if space is None:
                continue
            table = space.pinned_homes_by if homes else space.pinned_tiers_by
            for who in {owner, ""}:
                for name, n in table.get(who, {}).items():
                    out[name] = out.get(name, 0) + n
        return out

    def model_tallies(self, namespaces: Collection[str] | None = None) -> dict[bytes, Tally]:
        """Each model's blocks: of every namespace, or of `namespaces` only; a model holding none is left out."""
        if namespaces is None:
            return _summed((self._models,))
        return _summed(space.models for space in (self._spaces.get(ns) for ns in set(namespaces))
                       if space is not None)

    def namespace_tally(self, namespace: str) -> Tally:
        """The namespace's blocks, stored bytes, tokens and pinned blocks (its models' tallies added up)."""
        space = self._spaces.get(namespace)
        total = Tally()
        if space is not None:
            for t in space.models.values():
                total.add(t)
        return total

    def block_count(self, namespace: str) -> int:
        space = self._spaces.get(namespace)
        return 0 if space is None else len(space.entries)

    def logical_bytes(self, namespace: str, owner: str | None = None) -> int:
        """Each of the namespace's blocks' bytes once per live session referencing it, once if none does; of
        `owner`'s sessions alone, a tenant's (None: every session's)."""
        space = self._spaces.get(namespace)
        if space is None:
            return 0
        return space.logical if owner is None else space.nbytes + space.extra_by.get(owner, 0)

    def referenced_blocks(self, namespace: str, owner: str | None = None) -> int:
        """The namespace's blocks some live session references; of `owner`'s sessions alone (None: any session)."""
        space = self._spaces.get(namespace)
        if space is None:
            return 0
        return space.referenced if owner is None else space.referenced_by.get(owner, 0)

    @staticmethod
    def _pin_held_changed(space: _Space, meta: BlockMeta, held: bool) -> None:
        """`meta` became kept by a pin (or stopped being): counted, and so are the ancestors that change with it,
        up to the first one another pin keeps anyway."""
        m = meta
        while True:
            space.pinned += m.nbytes if held else -m.nbytes
            parent = space.entries.get(m.parent)
            if parent is None:
                return
            parent.pin_held_children += 1 if held else -1
            if parent.pins > parent.operator_pins or parent.pin_held_children != (1 if held else 0):
                return  # held before, and still: nothing above changes
            m = parent

    @staticmethod
    def _owner_held_changed(space: _Space, meta: BlockMeta, owner: str, held: bool) -> None:
        """`_pin_held_changed` of one pin owner's: what its share counts (engram/store/pins.py)."""
        m = meta
        while True:
            n = space.pinned_by.get(owner, 0) + (m.nbytes if held else -m.nbytes)
            if n:
                space.pinned_by[owner] = n
            else:
                del space.pinned_by[owner]
            parent = space.entries.get(m.parent)
            if parent is None:
                return
            kept = parent.held_for if parent.held_for is not None else {}
            k = kept.get(owner, 0) + (1 if held else -1)
            if k:
                kept[owner] = k
            else:
                del kept[owner]
            parent.held_for = kept or None
            if parent.owner_pins(owner) or k != (1 if held else 0):
                return  # held by the owner before, and still: nothing above changes
            m = parent

    def add(self, meta: BlockMeta) -> None:
        if meta.key in self._entries:
            raise AssertionError(f"block {meta.key.hex()} is already indexed")
        self._entries[meta.key] = meta
        space = self._spaces.get(meta.namespace)
        if space is None:  # (not setdefault: that builds a _Space, and below a _Children, for every add)
            space = self._spaces[meta.namespace] = _Space()
        space.entries[meta.key] = meta
        space.nbytes += meta.nbytes
        self._tally(space, meta, 1)
        parent = space.entries.get(meta.parent)
        if parent is not None:
            parent.children += 1
        siblings = space.children.get(meta.parent)
        if siblings is None:
            siblings = space.children[meta.parent] = _Children()
        siblings.add(meta)
        kids = space.children.get(meta.key)  # (none, but for one whose parent left while it was read)
        meta.pin_held_children = 0 if kids is None else sum(1 for k in kids.by_key.values() if k.pin_held)
        kept: dict[str, int] = {}
        for k in kids.by_key.values() if kids is not None and meta.pin_held_children else ():
            for o in k.holders():
                kept[o] = kept.get(o, 0) + 1
        meta.held_for = kept or None
        if meta.pin_held:
            self._pin_held_changed(space, meta, True)
            for o in meta.holders():
                self._owner_held_changed(space, meta, o, True)
        if meta.pins and self.pins_listener is not None:
            self.pins_listener(meta.key, meta.pins - meta.operator_pins, meta.operator_pins, meta.pin_owners)
        for listener in self.listeners:
            listener("add", meta)

    def changed(self, meta: BlockMeta) -> None:
        """A block's record changed in place (its checksum, re-indexed from its NVMe file): listeners hear it as
        an add again, which republishes it (the cluster's holder record carries the checksum)."""
        for listener in self.listeners:
            listener("add", meta)

    def remove(self, key: bytes) -> tuple[BlockMeta | None, BlockMeta | None]:
        """Drop a block; returns it and its parent if that parent just became a leaf."""
        meta = self._entries.pop(key, None)
        if meta is None:
            return None, None
        space = self._spaces[meta.namespace]
        if meta.pin_held:  # a pinned block deleted on request, or lost: its pin (and what it kept) ends with it
            self._pin_held_changed(space, meta, False)
            for o in meta.holders():
                self._owner_held_changed(space, meta, o, False)
        if meta.pins and self.pins_listener is not None:
            self.pins_listener(key, 0, 0, None)
        del space.entries[key]
        space.nbytes -= meta.nbytes
        self._tally(space, meta, -1)
        siblings = space.children.get(meta.parent)
        if siblings is not None:
            siblings.remove(key)
            if not siblings:
                del space.children[meta.parent]
        if not space.entries:
            del self._spaces[meta.namespace]
        walks = self._walks.get(meta.namespace)
        if walks:
            for walk in walks:
                walk.removed(meta)
        for listener in self.listeners:
            listener("remove", meta)
        parent = space.entries.get(meta.parent)
        if parent is not None:
            parent.children -= 1
            if parent.children == 0:
                return meta, parent
        return meta, None

    def has_partial_children(self, namespace: str, parent: bytes) -> bool:
        space = self._spaces.get(namespace)
        kids = None if space is None else space.children.get(parent)
        return kids is not None and bool(kids.partials)

    def partial_children(self, namespace: str, parent: bytes) -> list[BlockMeta]:
        space = self._spaces.get(namespace)
        kids = None if space is None else space.children.get(parent)
        return [] if kids is None else list(kids.partials.values())

    def children_of(self, parent: bytes) -> list[BlockMeta]:
        """The blocks that extend a stored block (in its namespace)."""
        meta = self._entries.get(parent)
        space = None if meta is None else self._spaces.get(meta.namespace)
        kids = None if space is None else space.children.get(parent)
        return [] if kids is None else list(kids.by_key.values())

    def match(self, namespace: str, model_fingerprint: bytes, tokens: np.ndarray, block_tokens: int,
              salt: bytes = b"") -> PrefixMatch:
        """Longest stored prefix of `tokens`: consecutive full blocks, then at most one partial block."""
        walk = PrefixWalk(self, namespace, model_fingerprint, tokens, block_tokens, salt)
        walk.step(len(tokens))
        return walk.result()

    def walk(self, namespace: str, model_fingerprint: bytes, tokens: np.ndarray, block_tokens: int,
             salt: bytes = b"") -> PrefixWalk:
        """`match` a slice at a time (PrefixWalk); the caller closes it."""
        return PrefixWalk(self, namespace, model_fingerprint, tokens, block_tokens, salt)

    def _watch(self, walk: PrefixWalk, on: bool) -> None:
        walks = self._walks.get(walk.namespace)
        if on:
            if walks is None:
                walks = self._walks[walk.namespace] = []
            walks.append(walk)
        elif walks is not None and walk in walks:
            walks.remove(walk)
            if not walks:
                del self._walks[walk.namespace]

    def match_keys(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes]) -> PrefixMatch:
        """The longest run of stored full blocks under `keys`, a chain's keys the caller derived itself (the
        trace replayer: BlockStore.lookup_keys): one probe per block, no hashing, no token compare."""
        found: list[BlockMeta] = []
        space = self._spaces.get(namespace)
        if space is None:
            return PrefixMatch((), 0)
        entries = space.entries
        matched = 0
        for key in keys:
            meta = entries.get(key)
            if meta is None or not meta.full or meta.model_fingerprint != model_fingerprint:
                break
            found.append(meta)
            matched += meta.num_tokens
        self.probes += len(found) + (len(found) < len(keys))
        return PrefixMatch(tuple(found), matched)

    def _count(self, n: int) -> None:
        self.probes += n


class PrefixWalk:
    """`ChainIndex.match` done a slice of blocks at a time, so that a caller on the daemon's event loop can give
    other calls a turn between slices: a million-token prefix of 16-token blocks is 65,536 blocks, a third of a
    second of hashing and probing, and one tenant's calls of such prefixes held every tenant's calls for seconds
    (an audit, session 48). Each full block of the query is hashed into its chain key, probed in its namespace
    and its stored tokens compared; once they stop matching, the stored child sharing the longest prefix with
    the query's next tokens ends the match (module docstring).

    Between slices the index may change: a block found may be evicted, deleted or lost. Once `watch`ed (before
    the caller first awaits anything), the walk hears of every block of its namespace the index removes, and
    `cut` is the first found block removed since: the answer (`result`, `found`) ends before it. A shorter match,
    never one naming a block that is gone; what the caller builds from the blocks it keeps checking `cut` until
    it answers (a lease taken in the same step as the last check covers exactly the blocks answered)."""

    __slots__ = (
        "_index",
        "_parent",
        "_pos",
        "_root",
        "_whole",
        "block_tokens",
        "blocks",
        "cut",
        "done",
        "matched",
        "model_fingerprint",
        "namespace",
        "tokens",
    )

    def __init__(self, index: ChainIndex, namespace: str, model_fingerprint: bytes, tokens: np.ndarray,
                 block_tokens: int, salt: bytes = b"") -> None:
        self._index = index
        self.namespace, self.model_fingerprint = namespace, model_fingerprint
        self.tokens = np.ascontiguousarray(tokens, dtype="<i4")
        self.block_tokens = block_tokens
        self._root = self._parent = root_key(namespace, model_fingerprint, salt)
        self.blocks: list[BlockMeta] = []
        self._whole = 0  # of `blocks`, those that match whole blocks of the query (the rest: the tail's)
        self.matched = 0  # tokens matched by `blocks`
        self.done = False
        self.cut = -1  # the first of `blocks` removed from the index since found; -1: none
        self._pos: dict[bytes, int] | None = None  # each found block's place, once watched

    def step(self, max_blocks: int) -> bool:
        """Walk up to `max_blocks` more full blocks (then the partial tail, once they stop); True when done."""
        if self.done:
            return True
        index = self._index
        space = index._spaces.get(self.namespace)
        if space is None:
            self.done = True
            return True
        entries = space.entries
        namespace, fp, bt = self.namespace, self.model_fingerprint, self.block_tokens
        blocks, pos, parent = self.blocks, self._pos, self._parent
        width = 4 * bt
        start = self.matched
        end = len(self.tokens) // bt * width  # the query's full blocks, in bytes
        last = min(end, (start // bt + max_blocks) * width)
        at = 4 * start
        # This slice's tokens as bytes (what keys hash and blocks hold), each block's cut from them: not the whole
        # query's, which every long call in flight would hold twice
        data = self.tokens[start : last // 4].tobytes()
        base = at
        probes = 0
        while at < last:
            chunk = data[at - base : at - base + width]
            key = block_key_of_bytes(parent, chunk)
            probes += 1
            meta = entries.get(key)
            # Namespace and model are already inside the key; comparing them again costs nothing and keeps
            # isolation true even if a key ever collided.
            if (meta is None or not meta.full or meta.tokens != chunk or meta.namespace != namespace
                    or meta.model_fingerprint != fp):
                last = -1
                break
            if pos is not None:
                pos[key] = len(blocks)
            blocks.append(meta)
            parent = key
            at += width
        index.probes += probes
        self._parent = parent
        self._whole = len(blocks)
        self.matched = at // 4
        if last == at < end:
            return False  # the slice ended, the query's full blocks did not
        self.done = True
        tail = self.tokens[self.matched : self.matched + bt]
        kids = space.children.get(parent) if len(tail) else None
        if kids is None:
            return True
        best, best_m = kids.best(tail, index._count)
        if best is not None and best.namespace == namespace and best.model_fingerprint == fp:
            if pos is not None:
                pos[best.key] = len(blocks)
            blocks.append(best)
            self.matched += best_m
        return True

    def watch(self) -> None:
        """From here on, a found block the index removes cuts the answer: before the caller first awaits."""
        if self._pos is None:
            self._pos = {m.key: i for i, m in enumerate(self.blocks)}
            self._index._watch(self, True)

    def removed(self, meta: BlockMeta) -> None:
        """The index removed a block of this walk's namespace (ChainIndex.remove)."""
        assert self._pos is not None
        i = self._pos.get(meta.key, -1)
        if i >= 0 and self.blocks[i] is meta and (self.cut < 0 or i < self.cut):
            self.cut = i

    def close(self) -> None:
        """Hear no more removals; the blocks found stay as they are."""
        if self._pos is not None:
            self._index._watch(self, False)

    def kept(self) -> int:
        """How many of the found blocks the answer keeps: those before `cut`."""
        return len(self.blocks) if self.cut < 0 else self.cut

    def found(self) -> list[BlockMeta]:
        return self.blocks if self.cut < 0 else self.blocks[: self.cut]

    def matched_tokens(self) -> int:
        """Tokens the kept blocks match: all before a cut are full (only the last block may match part)."""
        return self.matched if self.cut < 0 else self.cut * self.block_tokens

    def whole(self) -> tuple[int, bytes]:
        """The kept blocks that match whole blocks of the query: (their tokens, the query's chain key after them,
        the last one's or the root's): where a fill from peers goes on (PeerFetcher.fill), hashing no key the walk
        hashed. A full block that matches the query only in part, kept at the end, is not one: its key is not the
        query's (counted whole, it had the fill skip the query's own block there, and ask for the next under a
        parent not stored here)."""
        n = min(self.kept(), self._whole)
        return n * self.block_tokens, self.blocks[n - 1].key if n else self._root

    def result(self) -> PrefixMatch:
        return PrefixMatch(tuple(self.found()), self.matched_tokens())
