"""The HBM tier: one preallocated device tensor carved into page runs by the slot allocator, so blocks
cost no cudaMalloc and the pool's footprint is fixed from start-up (tiers.hbm.capacity). Released
explicitly on close (the caching allocator's memory is handed back with torch.cuda.empty_cache).

Without a GPU the same tier runs over a CPU tensor (tiers.hbm.device = cpu), which is how CI exercises
the hbm -> dram -> nvme chain.
"""

from __future__ import annotations

import torch

from engram.errors import ConfigError
from engram.tiers.pool import PoolTier, auto_page_bytes
from engram.tiers.shm import SharedSegment
from engram.tiers.slots import SlotAllocator


def hbm_tier(capacity: int, device: str | torch.device = "cuda", page_bytes: int = 0, *,
             shm_dir: str | None = None, group: str = "") -> PoolTier:
    """With shm_dir (and a CUDA device), the allocator's generation table lives in a small shared segment
    there, so a worker that reads HBM blocks through CUDA IPC can check its descriptors (group: the workers'
    group it is readable by, SharedSegment)."""
    dev = torch.device(device)
    page = page_bytes or auto_page_bytes(capacity)
    pages = -(-capacity // page)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        if pages * page > free:
            raise ConfigError(f"tiers.hbm.capacity ({pages * page} bytes) exceeds the {free} bytes free on {dev}; "
                              "lower tiers.hbm.capacity")
    buffer = torch.empty(pages * page, dtype=torch.uint8, device=dev)
    table = SharedSegment(shm_dir, pages * page, page, pin=False, with_data=False, group=group) \
        if shm_dir and dev.type == "cuda" else None

    def release() -> None:
        if table is not None:
            table.close()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()

    allocator = SlotAllocator(pages, table.generations if table is not None else None)
    return PoolTier("hbm", buffer, page, allocator, on_close=release, segment=table)
