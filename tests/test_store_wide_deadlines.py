"""The admin calls whose work is a part of the store (Check, Evict, ForgetModel) are waited for as long as that
part takes, not the client's timeout_s alone: a daemon answers them only once it has read or removed every block.

Before, `check()` through the library failed DeadlineExceeded after timeout_s (30 s by default) on any store that
takes longer to read, a few GiB from disk, while the daemon went on working; an evict of a large namespace did
too (a gap left by sessions 45 and 46). Here a small timeout_s (0.2 s) stands for the 30 s, against work measured
on the shared 2-core machine to take 5-11 times longer: a 1 GiB store read from disk (its files dropped from the
page cache first: 1.1 s; cached it took a fifth of that), the removal of 4,096 blocks (2.0 s) and of a model's
3,072 (2.2 s). Each test fails before the fix, DeadlineExceeded after 0.2 s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from engram.client import EngramClient
from engram.config import load_config
from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import start_server

from helpers import put_tokens, random_kv, tiny_model, tokens

TIMEOUT_S = 0.2
BIG = ModelSpec("big-blocks", "seed-0", KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8,
                                                 head_dim=128, block_tokens=256), codec="raw")  # 2 MiB blocks


def config(tmp_path: Path) -> dict[str, object]:
    return {"server.port": 0, "server.unix_socket": str(tmp_path / "engram.sock"), "tiers.dram.capacity": "4MiB",
            "tiers.dram.prefault": False, "tiers.nvme.path": str(tmp_path / "nvme"),
            "tiers.write_policy": "write-through", "tiers.nvme.fsync": False}


def out_of_the_page_cache(root: Path) -> int:
    """Write every file under root to disk and drop it from the page cache: a check reads it from the disk, as
    it does a store larger than memory's cache. Returns how many files."""
    n = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


async def test_a_check_that_reads_a_store_for_longer_than_the_timeout_is_waited_for(tmp_path: Path) -> None:
    """1 GiB on NVMe, not cached: the daemon reads it all before it answers, longer than timeout_s; the client
    waits timeout_s and the store's bytes and blocks at the floor rates (learned from Stats first)."""
    srv = await start_server(load_config(env={}, overrides=config(tmp_path)))
    try:
        fp = srv.store.registry.register(BIG)
        n = 512
        kv = random_kv(BIG, 16 * 256, seed=0)
        for first in range(0, n, 16):
            await put_tokens(srv.store, "t", fp, tokens(16 * 256, seed=first), kv)
        assert out_of_the_page_cache(tmp_path / "nvme") >= n
        async with EngramClient(srv.address, namespace="t", timeout_s=TIMEOUT_S) as client:
            t0 = time.monotonic()
            report = await client.check()
            took = time.monotonic() - t0
        assert took > TIMEOUT_S, f"the check took {took:.2f} s: not longer than the timeout, this tests nothing"
        assert report.valid == report.scanned >= n and not report.findings
    finally:
        await srv.stop(0)


async def test_an_evict_and_a_forget_that_remove_blocks_for_longer_than_the_timeout_are_waited_for(
        tmp_path: Path) -> None:
    """The daemon removes a namespace's 4,096 blocks, then a model's 3,072, one file after another before it
    answers; the client waits timeout_s and their blocks at the floor rate."""
    srv = await start_server(load_config(env={}, overrides=config(tmp_path)))
    try:
        spec, other = tiny_model(), tiny_model(weights_id="seed-1")
        fp, other_fp = srv.store.registry.register(spec), srv.store.registry.register(other)
        kv = random_kv(spec, 512 * 16, seed=0)
        for first in range(0, 4096, 512):
            await put_tokens(srv.store, "t", fp, tokens(512 * 16, seed=first), kv)
        for first in range(0, 3072, 512):
            await put_tokens(srv.store, "u", other_fp, tokens(512 * 16, seed=first), kv)
        async with EngramClient(srv.address, namespace="t", timeout_s=TIMEOUT_S) as client:
            t0 = time.monotonic()
            evicted = await client.evict(whole_namespace=True)
            took = time.monotonic() - t0
            assert took > TIMEOUT_S, f"the evict took {took:.2f} s: not longer than the timeout, this tests nothing"
            assert len(evicted.evicted) == 4096 and not srv.store.index.blocks_in("t")
            t0 = time.monotonic()
            forgot = await client.forget_model(other_fp)
            took = time.monotonic() - t0
        assert took > TIMEOUT_S, f"the forget took {took:.2f} s: not longer than the timeout, this tests nothing"
        assert forgot.evicted == 3072 and other_fp not in srv.store.registry
    finally:
        await srv.stop(0)
