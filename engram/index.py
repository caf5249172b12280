"""The chain index: block metadata by key, and the longest-prefix match over a token sequence.

Full blocks are found by walking the chain of keys that the query's tokens hash to (O(blocks) dict
lookups). Where the walk stops, the query's next tokens may still share a prefix with a stored child of
the last matched block: a partial tail (whose key the query cannot compute, not knowing its length) or a
block that diverges from the query part-way. KV is causal, so the first m tokens of such a block serve
the query's next m tokens: every block is therefore also listed under its parent, and the match ends with
the child sharing the longest prefix with the query (the last block then counts only m of its tokens;
callers slice). A key match is only a hint: stored tokens are always compared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from engram.block import BlockRecord
from engram.keys import chain_keys, root_key, tokens_to_bytes
from engram.layout import DType


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
    pins: int = 0
    leases: int = 0
    children: int = 0  # indexed blocks whose parent this is; only leaves (0) may be evicted
    tick: int = 0  # recency, from engram/eviction.py's clock
    moving: bool = False  # a copy to another tier is being written: not a victim until it lands
    hits: int = 0
    created: float = field(default_factory=time.time)

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and self.leases == 0 and not self.moving

    @property
    def tier(self) -> str:
        """The fastest tier holding the block: where reads go."""
        return self.locations[0]

    def record(self) -> BlockRecord:
        return BlockRecord(self.key, self.parent, self.model_fingerprint, self.namespace, self.dtype, self.full,
                           self.shape, self.tokens, self.nbytes, self.checksum)

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


class ChainIndex:
    def __init__(self) -> None:
        self._entries: dict[bytes, BlockMeta] = {}
        self._children: dict[bytes, dict[bytes, BlockMeta]] = {}  # parent key -> its blocks

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockMeta]:
        return iter(self._entries.values())

    def get(self, key: bytes) -> BlockMeta | None:
        return self._entries.get(key)

    def add(self, meta: BlockMeta) -> None:
        if meta.key in self._entries:
            raise AssertionError(f"block {meta.key.hex()} is already indexed")
        self._entries[meta.key] = meta
        parent = self._entries.get(meta.parent)
        if parent is not None:
            parent.children += 1
        self._children.setdefault(meta.parent, {})[meta.key] = meta

    def remove(self, key: bytes) -> tuple[BlockMeta | None, BlockMeta | None]:
        """Drop a block; returns it and its parent if that parent just became a leaf."""
        meta = self._entries.pop(key, None)
        if meta is None:
            return None, None
        siblings = self._children.get(meta.parent)
        if siblings is not None:
            siblings.pop(key, None)
            if not siblings:
                del self._children[meta.parent]
        parent = self._entries.get(meta.parent)
        if parent is not None:
            parent.children -= 1
            if parent.children == 0:
                return meta, parent
        return meta, None

    def children_of(self, parent: bytes) -> list[BlockMeta]:
        return list(self._children.get(parent, {}).values())

    def partial_children(self, parent: bytes) -> list[BlockMeta]:
        return [m for m in self._children.get(parent, {}).values() if not m.full]

    def match(self, namespace: str, model_fingerprint: bytes, tokens: np.ndarray, block_tokens: int) -> PrefixMatch:
        """Longest stored prefix of `tokens`: consecutive full blocks, then at most one partial block."""
        found: list[BlockMeta] = []
        matched = 0
        parent = root_key(namespace, model_fingerprint)
        for key, start, end in chain_keys(namespace, model_fingerprint, tokens, block_tokens):
            if end - start < block_tokens:
                break  # the query's own tail is partial: handled with the stored partials below
            meta = self._entries.get(key)
            if meta is None or not self._same(meta, namespace, model_fingerprint, tokens[start:end]):
                break
            found.append(meta)
            matched = end
            parent = key
        tail = np.asarray(tokens[matched : matched + block_tokens], dtype="<i4")
        best: BlockMeta | None = None
        best_m = 0
        if len(tail):
            for cand in self._children.get(parent, {}).values():
                if cand.namespace != namespace or cand.model_fingerprint != model_fingerprint:
                    continue
                m = _common_prefix(cand.token_array(), tail)
                if m > best_m:
                    best, best_m = cand, m
        if best is not None:
            found.append(best)
            matched += best_m
        return PrefixMatch(tuple(found), matched)

    @staticmethod
    def _same(meta: BlockMeta, namespace: str, model_fingerprint: bytes, tokens: np.ndarray) -> bool:
        # Namespace and model are already inside the key; comparing them again costs nothing and keeps
        # isolation true even if a key ever collided.
        return (
            meta.full
            and meta.namespace == namespace
            and meta.model_fingerprint == model_fingerprint
            and meta.tokens == tokens_to_bytes(tokens)
        )
