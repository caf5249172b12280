"""Write-through's promise: a put is acknowledged only once each of its blocks has a copy in a durable tier
(NVMe: `tier.durable`), whatever tiers sit above it (with an HBM tier the second copy goes to NVMe, not to
DRAM).

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
from engram.errors import NotDurable
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
                             *, index: int = 0) -> bool:
    """`make_durable` for a stored block that a put just deduplicated against: its durable copy is written
    from the put's payload only if that is the block's own bytes (two workers' KV for the same tokens may
    differ in the last bit), else from the block's own copy, so that the file never pairs one payload with
    the other's header and checksum."""
    if is_durable(store.placement, meta):
        return True
    if payload is None or payload_checksum != meta.checksum or len(payload) != meta.nbytes:
        payload = await store.placement.tier(meta.locations[0]).read(meta.key)
    return await make_durable(store, meta, payload, index=index)


async def make_durable(store: BlockStore, meta: BlockMeta, payload: Payload, *, index: int = 0) -> bool:
    """Give `meta` a copy in the durable tier, if it has none: True once it has one; False when it could not
    and the policy is degrade; NotDurable when it could not and the policy is fail."""
    placement = store.placement
    d = durable_tier(placement)
    if d is None:
        return True
    name = placement.tiers[d].name
    indexed = store.index.get(meta.key) is meta  # a stored block made durable again (not a put's new block)
    deadline = time.monotonic() + placement.wait_for_room_s
    while meta.moving and time.monotonic() < deadline:
        await asyncio.sleep(0.005)  # a demotion (or the flusher) is writing that copy right now: wait for it
    if name in meta.locations:
        return True
    if indexed and store.index.get(meta.key) is not meta:  # evicted while it waited: a copy would belong to nothing
        raise NotDurable(f"block {index} was evicted while its durable copy waited on a move; put it again")
    if not placement.available(d):
        reason = placement.health[name].reason or f"the {name} tier is degraded"
    elif meta.moving:
        reason = f"another move of the block to the {name} tier did not finish within {placement.wait_for_room_s:g}s"
    else:
        meta.moving = True  # not a victim while its durable copy is written
        placement.busy += 1
        try:
            await placement.place(meta, d, payload)
            return True
        except TIER_FAULTS as exc:
            reason = str(exc)
        finally:
            meta.moving = False
            placement.busy -= 1
            placement.notify_freed()
    if store.on_nvme_failure == OnNvmeFailure.FAIL:
        raise NotDurable(
            f"block {index} was not stored: write-through acknowledges a block only once it is on {name}, and "
            f"its {name} copy could not be written ({reason}). Retry once the tier recovers (engram stats shows "
            f"its state), or set tiers.on_nvme_failure = degrade to accept blocks that are not durable")
    store.counters.blocks_not_durable += 1
    return False
