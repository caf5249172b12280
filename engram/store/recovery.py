"""Rebuilding the index at start-up from the tiers that outlive the process (NVMe), and checking every
stored copy on request (`engram check [--fix]`).

Recovery removes torn, corrupt and stray files (the NVMe tier's own scan) and blocks whose parent is gone
(unreachable from a root), and re-adds valid blocks parents first, so the index never holds an orphan.
Blocks of a model whose model file was lost are kept: they match again once it is registered.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engram.block import BlockRecord, checksum
from engram.errors import NotFound
from engram.eviction import TierVictims, tick
from engram.index import BlockMeta, ChainIndex
from engram.store import pins
from engram.store.pins import SharesOf
from engram.tiers.base import StaleRecord, Tier

if TYPE_CHECKING:
    from engram.store.core import BlockStore

log = logging.getLogger("engram.store")


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


async def recover(store: BlockStore, pin_shares: SharesOf | None = None) -> StoreReport:
    # A restart creates a few objects per block (100k blocks: ~1M); with the cyclic GC on, its full
    # collections rescan all of them again and again and took most of the time. Nothing made here is cyclic
    # garbage, so the collector waits until the index is built.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return await _recover(store, pin_shares)
    finally:
        if enabled:
            gc.enable()


async def _recover(store: BlockStore, pin_shares: SharesOf | None) -> StoreReport:
    report = StoreReport()
    placement = store.placement
    for tier in placement.tiers:
        tier_recover = getattr(tier, "recover", None)
        if tier_recover is None:
            continue
        tr = await tier_recover()
        journal_error = getattr(tier, "journal_error", None)
        if journal_error is not None:  # it serves its files without its journal; writes retry it (NvmeTier.write)
            placement.tier_failed(placement.rank[tier.name], journal_error, degrade=True)
        report.scanned += tr.scanned
        report.findings += [(f.path, f.problem, f.fixed) for f in tr.findings]
        victims = placement.victims[tier.name]
        index = store.index
        roots: dict[tuple[str, bytes], bytes] = {}

        def add(rec: BlockRecord, name: str = tier.name, victims: TierVictims = victims,
                index: ChainIndex = index) -> None:
            meta = BlockMeta.from_record(rec, [name])
            tick(meta)
            index.add(meta)
            victims.add(meta)
            report.recovered_blocks += 1

        # One pass over records that come parents first (a journal's order): each is added once its parent is
        # a root or indexed; the rest (a scan's order, or a parent written after its child) go through the
        # general reachability walk.
        rest: dict[bytes, BlockRecord] = {}
        for rec, _ in tr.records:
            if rec.key in index:
                continue
            root = roots.get((rec.namespace, rec.model_fingerprint))
            if root is None:
                root = roots[rec.namespace, rec.model_fingerprint] = store.root(rec.namespace, rec.model_fingerprint)
            if rec.parent == root or rec.parent in index:
                add(rec)
            else:
                rest[rec.key] = rec
        reachable = _reachable(store, rest)
        for rec in sorted(rest.values(), key=lambda r: reachable.get(r.key, -1)):
            if rec.key in reachable and rec.key not in index:
                add(rec)
            elif rec.key not in reachable:
                await tier.delete(rec.key)
                report.findings.append((f"{tier.name}:{rec.key.hex()}", "its parent block is gone (orphan)", True))
        report.valid += report.recovered_blocks
        recorded = getattr(tier, "recorded_pins", None)
        if recorded:
            pins.restore(store.index, recorded, pin_shares, tier.note_pins)  # type: ignore[attr-defined]
        if getattr(tier, "unverified", None):
            store.background.add(asyncio.get_running_loop().create_task(_verify_trusted(store, tier)))
    return report


async def _verify_trusted(store: BlockStore, tier: Tier) -> None:
    """Check, in the background, the files a tier trusted from its journal at start-up, and drop the copies
    whose file is broken (as `check --fix` does: a block with no copy left leaves the index, and so do the
    blocks that extend it). A read before the check got there verified the file itself, so nothing broken
    is served meanwhile."""
    bad = await tier.verify_trusted()  # type: ignore[attr-defined]
    for key, what in bad:
        meta = store.index.get(key)
        if isinstance(what, StaleRecord) and meta is not None and store.adopt(meta, tier.name, what.found):
            continue  # re-indexed under its file's checksum (adopt logs it)
        if meta is None or tier.name not in meta.locations:
            log.warning("recovery: %s block %s: %s (no longer indexed)", tier.name, key.hex(), what)
            continue
        # a str: the tier forgot its file, only the index's copy goes; a DataLoss: the tier deletes the file here
        await store.drop_damaged_copy(meta, tier.name)
        if not meta.locations and store.index.get(key) is meta:
            await drop_lost(store, meta)
        store.note_dropped(meta, tier.name, str(what), "the start's check of journal-trusted files")


def _reachable(store: BlockStore, records: dict[bytes, BlockRecord]) -> dict[bytes, int]:
    """Depth of every record whose chain reaches its root through records or indexed blocks, so the
    caller can add parents before children; orphans are left out."""
    depth: dict[bytes, int | None] = {}
    roots: dict[tuple[str, bytes], bytes] = {}  # one key hash per namespace and model, not per record
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
            root = roots.get((rec.namespace, rec.model_fingerprint))
            if root is None:
                root = roots[rec.namespace, rec.model_fingerprint] = store.root(rec.namespace, rec.model_fingerprint)
            if rec.parent == root or rec.parent in store.index:
                parent_depth = -1
                break
            k = rec.parent
        for n, pk in enumerate(reversed(path)):
            depth[pk] = None if parent_depth is None else parent_depth + 1 + n
    return {k: d for k, d in depth.items() if d is not None}


async def check(store: BlockStore, *, fix: bool) -> StoreReport:
    """Verify every stored copy (DRAM payloads, NVMe files); with fix, drop what is broken. Safe while puts,
    gets and evictions run: only blocks that held a copy when the check started are judged, a block whose
    file is not among the valid ones found is checked once more on its own before it is dropped (it may have
    been written or replaced during the scan), and a copy evicted meanwhile is not a finding."""
    report = StoreReport()
    placement = store.placement
    for tier in placement.tiers:
        tier_check = getattr(tier, "check", None)
        if tier_check is not None:
            before = {m.key for m in store.index if tier.name in m.locations}
            tr = await tier_check(fix=fix)
            report.scanned += tr.scanned
            report.valid += tr.valid
            report.findings += [(f.path, f.problem, f.fixed) for f in tr.findings]
            on_disk = {rec.key for rec, _ in tr.records}
            reported = {Path(f.path).name.partition(".")[0] for f in tr.findings}  # key hex of files found broken
            for meta in list(store.index):
                if tier.name not in meta.locations or meta.key not in before or meta.key in on_disk:
                    continue
                if meta.key.hex() not in reported:  # not a file found broken: it may have changed since
                    problem = await tier.verify(meta.key)  # type: ignore[attr-defined]
                    if problem is None or store.index.get(meta.key) is not meta or tier.name not in meta.locations:
                        continue  # valid now, or gone meanwhile
                    report.findings.append((meta.key.hex(), f"indexed in {tier.name} but its file is {problem}", fix))
                if fix:
                    newer = tr.newer_blocks.get(meta.key)
                    if newer is not None:  # a newer Engram's file: left on disk, and counted
                        tier.set_aside(meta.key, newer)  # type: ignore[attr-defined]
                    else:
                        tier.forget(meta.key)  # type: ignore[attr-defined]
                    await store.drop_damaged_copy(meta, tier.name, report)  # (the tier holds no file of it now)
                    if not meta.locations and store.index.get(meta.key) is meta:
                        await drop_lost(store, meta, report)
            continue
        for meta in list(store.index):
            if tier.name not in meta.locations:
                continue
            report.scanned += 1
            try:
                payload = await tier.read(meta.key)
            except NotFound:
                if tier.name in meta.locations:
                    raise
                continue  # its copy was dropped (evicted, demoted) while the check ran
            if checksum(payload) == meta.checksum:
                report.valid += 1
                continue
            report.findings.append((f"{tier.name}:{meta.key.hex()}", "payload checksum mismatch", fix))
            if fix:
                await store.drop_damaged_copy(meta, tier.name, report)
                if not meta.locations and store.index.get(meta.key) is meta:
                    await drop_lost(store, meta, report)
    if fix:
        await _drop_unreachable(store, report)
    return report


async def _drop_unreachable(store: BlockStore, report: StoreReport) -> None:
    """Blocks still indexed whose parent is not, and what extends them (a drop found them being read, by this
    check or another, or two drops of one block ran at once: the background check of trusted files beside
    `check --fix`), go now, deepest first, unless still busy (reported): a lookup can never reach them."""
    roots: dict[tuple[str, bytes], bytes] = {}
    tops = []
    for meta in store.index:
        root = roots.get((meta.namespace, meta.model_fingerprint))
        if root is None:
            root = roots[meta.namespace, meta.model_fingerprint] = store.root(meta.namespace, meta.model_fingerprint)
        if meta.parent != root and meta.parent not in store.index:
            tops.append(meta)
    for top in tops:
        below = [top]
        stack = list(store.children(top.key))
        while stack:
            m = stack.pop()
            below.append(m)
            stack.extend(store.children(m.key))
        for d in reversed(below):  # each after everything that extends it
            if store.index.get(d.key) is not d:
                continue
            if d.leases or d.moving or d.children:
                report.findings.append((d.key.hex(), "unreachable: a block it extends was dropped (being read: "
                                        "left until a restart)", False))
                continue
            store.lift_pins(d)
            await store.placement.delete_block(d)
            report.findings.append((d.key.hex(), "unreachable: a block it extends was dropped", True))


async def drop_lost(store: BlockStore, meta: BlockMeta, report: StoreReport | None = None) -> None:
    """A block with no copy left goes from the index, and every block that extends it with it: a lookup stops
    at the lost one, so they could never be reached again (a restart's recovery drops them as orphans). A
    descendant being read or moved stays until the restart, reported. A block the index no longer holds left with
    what extended it then (a reader that held it, ending after another dropped it): the blocks under its key now are
    those of a block put again under it, acknowledged, not this one's."""
    await drop_below(store, forget_lost(store, meta), report)


def forget_lost(store: BlockStore, meta: BlockMeta) -> list[BlockMeta]:
    """`drop_lost`'s first step, with no await: the block out of the index; the blocks that extend it, for
    `drop_below` (none when the index no longer holds it)."""
    if store.index.get(meta.key) is not meta:
        return []
    below: list[BlockMeta] = []
    stack = list(store.children(meta.key))
    while stack:  # children before the index forgets their parent (children_of needs it)
        m = stack.pop()
        below.append(m)
        stack.extend(store.children(m.key))
    store.placement.unindex(meta)
    return below


async def drop_below(store: BlockStore, below: list[BlockMeta], report: StoreReport | None = None) -> None:
    """`drop_lost`'s second step: the blocks that extended a lost one (`forget_lost`), deepest first."""
    for d in reversed(below):  # deepest first: each is a leaf when its turn comes
        if store.index.get(d.key) is not d:
            continue
        if d.leases or d.moving or d.children:
            if report is not None:
                report.findings.append((d.key.hex(), "unreachable: a block it extends was dropped (being read: "
                                        "left until a restart)", False))
            continue
        store.lift_pins(d)  # a pin on a block no lookup can reach holds nothing
        await store.placement.delete_block(d)
        if report is not None:
            report.findings.append((d.key.hex(), "unreachable: a block it extends was dropped", True))
