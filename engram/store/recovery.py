"""Rebuilding the index at start-up from the tiers that outlive the process (NVMe), and checking every
stored copy on request (`engram check [--fix]`).

Recovery removes torn, corrupt and stray files (the NVMe tier's own scan) and blocks whose parent is gone
(unreachable from a root), and re-adds valid blocks parents first, so the index never holds an orphan.
Blocks of a model whose model file was lost are kept: they match again once it is registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engram.block import BlockRecord, checksum
from engram.eviction import tick
from engram.index import BlockMeta

if TYPE_CHECKING:
    from engram.store.core import BlockStore


@dataclass
class StoreReport:
    """What a recovery or a check found: per tier, valid blocks and problems (path, what, fixed)."""

    scanned: int = 0
    valid: int = 0
    findings: list[tuple[str, str, bool]] = field(default_factory=list)
    recovered_blocks: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings


async def recover(store: BlockStore) -> StoreReport:
    report = StoreReport()
    placement = store.placement
    for tier in placement.tiers:
        tier_recover = getattr(tier, "recover", None)
        if tier_recover is None:
            continue
        tr = await tier_recover()
        report.scanned += tr.scanned
        report.findings += [(f.path, f.problem, f.fixed) for f in tr.findings]
        records = {rec.key: rec for rec, _ in tr.records}
        reachable = _reachable(store, records)
        for rec in sorted(records.values(), key=lambda r: reachable.get(r.key, -1)):
            if rec.key in reachable and rec.key not in store.index:
                meta = BlockMeta.from_record(rec, [tier.name])
                tick(meta)
                store.index.add(meta)
                placement.lru[tier.name].add(meta)
                report.recovered_blocks += 1
            elif rec.key not in reachable:
                await tier.delete(rec.key)
                report.findings.append((f"{tier.name}:{rec.key.hex()}", "its parent block is gone (orphan)", True))
        report.valid += report.recovered_blocks
    return report


def _reachable(store: BlockStore, records: dict[bytes, BlockRecord]) -> dict[bytes, int]:
    """Depth of every record whose chain reaches its root through records or indexed blocks, so the
    caller can add parents before children; orphans are left out."""
    depth: dict[bytes, int | None] = {}
    for key in records:
        path: list[bytes] = []
        k = key
        parent_depth: int | None
        while True:
            if k in depth:
                parent_depth = depth[k]
                break
            rec = records.get(k)
            if rec is None or k in path:
                if rec is not None and k not in path:
                    path.append(k)
                parent_depth = None
                break
            path.append(k)
            if rec.parent == store.root(rec.namespace, rec.model_fingerprint) or rec.parent in store.index:
                parent_depth = -1
                break
            k = rec.parent
        for n, pk in enumerate(reversed(path)):
            depth[pk] = None if parent_depth is None else parent_depth + 1 + n
    return {k: d for k, d in depth.items() if d is not None}


async def check(store: BlockStore, *, fix: bool) -> StoreReport:
    """Verify every stored copy (DRAM payloads, NVMe files); with fix, drop what is broken."""
    report = StoreReport()
    placement = store.placement
    for tier in placement.tiers:
        tier_check = getattr(tier, "check", None)
        if tier_check is not None:
            tr = await tier_check(fix=fix)
            report.scanned += tr.scanned
            report.valid += tr.valid
            report.findings += [(f.path, f.problem, f.fixed) for f in tr.findings]
            on_disk = {rec.key for rec, _ in tr.records}
            for meta in list(store.index):
                if tier.name in meta.locations and meta.key not in on_disk:
                    report.findings.append((meta.key.hex(), f"indexed in {tier.name} but its file is invalid "
                                            "or missing", fix))
                    if fix:
                        tier.forget(meta.key)  # type: ignore[attr-defined]
                        meta.locations.remove(tier.name)
                        if not meta.locations:
                            placement.unindex(meta)
            continue
        for meta in list(store.index):
            if tier.name not in meta.locations:
                continue
            report.scanned += 1
            payload = await tier.read(meta.key)
            if checksum(payload) == meta.checksum:
                report.valid += 1
                continue
            report.findings.append((f"{tier.name}:{meta.key.hex()}", "payload checksum mismatch", fix))
            if fix:
                await placement.drop_copy(meta, tier.name)
                if not meta.locations:
                    placement.unindex(meta)
    return report
