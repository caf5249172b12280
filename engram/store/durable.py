"""Write-through's promise: a put is acknowledged only once each of its blocks has a copy in a durable tier
(NVMe: `tier.durable`), whatever tiers sit above it (with an HBM tier the second copy goes to NVMe, not to
DRAM), and so has every stored block it extends: a restart's recovery drops a block whose parent is not on
disk, so a parent that lost its NVMe copy is copied there again, from memory, before its child is acknowledged.

When that copy cannot be made (the tier is degraded after ENOSPC, a write fails with EIO, no room can be
made) the store's `on_nvme_failure` decides:
- "fail" (the default): NotDurable is raised, which the gRPC edge answers with UNAVAILABLE; the put is not
  acknowledged, and its volatile copy is dropped so that a retry sends the block again.
- "degrade": the block is acknowledged as not durable: the put's reply counts it (PutResponse.not_durable),
  so does Stats.blocks_not_durable, the activity log warns, and the background flusher
  (engram/store/flusher.py) copies it to NVMe once the tier takes writes again.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import TYPE_CHECKING

from engram.block import Payload
from engram.errors import DataLoss, FailedPrecondition, NotDurable, NotFound, Unavailable
from engram.index import BlockMeta
from engram.store.placement import TIER_FAULTS, Placement

if TYPE_CHECKING:
    from engram.store.core import BlockStore


class OnNvmeFailure(enum.StrEnum):
    FAIL = "fail"
    DEGRADE = "degrade"


def durable_tier(placement: Placement) -> int | None:
    """The rank of the tier whose copies survive the process (the NVMe tier), if any."""
    for i, tier in enumerate(placement.tiers):
        if getattr(tier, "durable", False):
            return i
    return None


def is_durable(placement: Placement, meta: BlockMeta) -> bool:
    d = durable_tier(placement)
    return d is None or placement.tiers[d].name in meta.locations


async def make_durable_again(store: BlockStore, meta: BlockMeta, payload: Payload | None, payload_checksum: int,
                             *, index: int = 0, verified: str | None = None) -> bool:
    """`make_durable` for a stored block that a put just deduplicated against: its durable copy is written
    from the put's payload only if that is the block's own bytes (two workers' KV for the same tokens may
    differ in the last bit), else from the block's own copy, so that the file never pairs one payload with
    the other's header and checksum. That copy is the fastest one that verifies, as the flusher's: a copy
    that fails its checksum is dropped as a read drops it, never written to NVMe (a file that fails every
    read); DataLoss when none verified: the block was dropped (a Put stream then stores its own bytes anew; an
    in-place put's block fails with it).

    `verified`: the tier whose copy a dedupe just verified (`BlockStore.verify_stored`), given only by a dedupe
    (a put's bytes dropped for the stored block). Its durable copy is then read and verified too unless that was
    the one verified: the dedupe acknowledges the block durable, and a damaged or vanished NVMe file beside a
    sound memory copy was acknowledged on the index's word, and lost at the next crash (a review, session 46).
    One that fails is dropped (counted, logged) and written again as any missing durable copy. A disk read, on
    a dedupe only (rare: a race, a put with pin or skip_cached off); a skipped block (an in-place reservation's,
    a Lookup's) is not read back, or a worker's save would read its whole cached prefix from NVMe."""
    if is_durable(store.placement, meta):
        d = durable_tier(store.placement)
        if verified is None or d is None or store.placement.tiers[d].name == verified:
            return True
        name = store.placement.tiers[d].name
        try:
            await store._read_verified(meta, during="a put of it (deduplicated: its durable copy)", only=name)
            return True
        except DataLoss:  # the durable copy failed (or could not be read): dropped, counted, logged
            if not meta.locations:
                raise  # it was the last copy: the block was dropped
    if payload is None or payload_checksum != meta.checksum or len(payload) != meta.nbytes:
        payload, _ = await store._read_verified(meta, during="a put of it (its copy to NVMe)")
    return await make_durable(store, meta, payload, index=index)


async def make_durable(store: BlockStore, meta: BlockMeta, payload: Payload, *, index: int = 0) -> bool:
    """Give `meta` a copy in the durable tier, if it has none: True once it has one; False when it could not
    and the policy is degrade; NotDurable when it could not and the policy is fail. Its stored ancestors that
    lack a durable copy get one first (`_ancestors_durable`)."""
    placement = store.placement
    d = durable_tier(placement)
    if d is None:
        return True
    name = placement.tiers[d].name
    reason = await _ancestors_durable(store, meta, d, index)
    if reason is None:
        reason = await _write_durable(store, meta, payload, d, index)
    if reason is None:
        return True
    if store.on_nvme_failure == OnNvmeFailure.FAIL:
        raise NotDurable(
            f"block {index} was not stored: write-through acknowledges a block only once it is on {name}, and "
            f"its {name} copy could not be written ({reason}). Retry once the tier recovers (engram stats shows "
            f"its state), or set tiers.on_nvme_failure = degrade to accept blocks that are not durable")
    store.counters.blocks_not_durable += 1
    return False


async def _ancestors_durable(store: BlockStore, meta: BlockMeta, d: int, index: int) -> str | None:
    """Copy to the durable tier, parents first, the stored blocks above `meta` that have no copy there, up to
    the first that has one: a block on NVMe whose parent is not is an orphan to the next start's recovery,
    which drops it. (A stored block lacks a durable copy when it was acknowledged without one under degrade, or
    lost it as damaged (`check --fix`, a read) and writing it again from memory failed; a client's Lookup then
    skips it, and sends only the blocks after it.) Each is copied from its fastest copy that verifies, as the
    flusher copies: one that fails is dropped as a read drops it (counted, logged), and an ancestor with none
    left leaves the store with what extends it, `meta`'s parent among them: FailedPrecondition, as for a parent
    evicted under a put (it was refused as not durable, the ancestor kept with a copy that fails every read).
    None once they have one; else why not."""
    placement = store.placement
    name = placement.tiers[d].name
    if not placement.available(d):
        return None  # `meta`'s own copy fails for the same reason, without walking the chain
    todo: list[BlockMeta] = []
    parent = store.index.get(meta.parent)
    while parent is not None and name not in parent.locations:
        todo.append(parent)
        parent = store.index.get(parent.parent)
    for above in reversed(todo):
        await _settle(above, placement.wait_for_room_s)
        if name in above.locations:
            continue
        what = f"its parent block {above.key.hex()} had no {name} copy"
        try:
            if above.moving or not above.locations:
                raise Unavailable("it is being moved")
            payload, _ = await store._read_verified(above, during=f"a copy to {name} for a put that extends it")
        except DataLoss as exc:
            raise FailedPrecondition(
                f"block {index}: {what}, and no copy of it verified: it was dropped as damaged, with the blocks that "
                "extend it; Lookup again and put the chain from its first missing block") from exc
        except (*TIER_FAULTS, NotFound) as exc:
            return f"{what}, and it could not be read ({exc})"
        reason = await _write_durable(store, above, payload, d, 0)
        if reason is not None:
            if store.flusher is not None:
                store.flusher.note(above, now=True)  # it goes to NVMe once the tier takes writes
            return f"{what}, and writing one failed ({reason})"
    return None


async def _settle(meta: BlockMeta, wait_s: float) -> None:
    """Wait, up to `wait_s`, for a move of the block (a demotion, the flusher) that may be writing its durable copy."""
    deadline = time.monotonic() + wait_s
    while meta.moving and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


async def _write_durable(store: BlockStore, meta: BlockMeta, payload: Payload, d: int, index: int) -> str | None:
    """Write `meta`'s copy in tier d unless it has one: None once it has; else why not. NotDurable when an
    indexed block was evicted while it waited (a copy would belong to nothing)."""
    placement = store.placement
    name = placement.tiers[d].name
    indexed = store.index.get(meta.key) is meta  # a stored block made durable again (not a put's new block)
    await _settle(meta, placement.wait_for_room_s)  # a demotion (or the flusher) may be writing that copy now
    if name in meta.locations:
        return None
    if indexed and store.index.get(meta.key) is not meta:  # evicted while it waited: a copy would belong to nothing
        raise NotDurable(f"block {index} was evicted while its durable copy waited on a move; put it again")
    if not placement.available(d):
        return placement.unavailable_why(d)
    if meta.moving:
        return f"another move of the block to the {name} tier did not finish within {placement.wait_for_room_s:g}s"
    meta.moving = True  # not a victim while its durable copy is written
    placement.busy += 1
    try:
        await placement.place(meta, d, payload)
        return None
    except TIER_FAULTS as exc:
        return str(exc)
    finally:
        meta.moving = False
        placement.busy -= 1
        placement.notify_freed()
