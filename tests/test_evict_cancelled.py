"""An evict whose caller goes mid-call (Ctrl-C on `engram evict`, a client timeout) against a real daemon: the
block it had begun to remove is removed all the way (its NVMe file unlinked, its journal remove written) and
counted. Its unlink, waiting for the tier's I/O thread, was cancelled with the call: the file stayed on disk, known
to no index, its bytes outside every quota (a tenant could repeat it), `engram check` counted it valid, a restart
brought the evicted block back, and blocks_evicted_on_request was one short."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from engram.client import EngramClient
from engram.control import ControlClient
from engram.tiers.nvme import NvmeTier

from helpers import random_kv, rpcs_answered, tiny_model, tokens, until


def block_files(root: Path) -> set[str]:
    return {p.name.removesuffix(".blk") for p in (root / "blocks").rglob("*.blk")}


async def test_an_evict_cancelled_while_its_unlink_waits_still_removes_the_file_and_counts_it(
        server_factory: Any, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    cfg = {"tiers.nvme.path": str(root), "tiers.write_policy": "write-through", "tiers.nvme.io_threads": 1,
           "server.metrics_port": -1}
    srv = await server_factory(**cfg)
    nvme = srv.store.tiers[-1]
    assert isinstance(nvme, NvmeTier)
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="gone") as c, ControlClient(srv.address, namespace="gone") as ctl:
        fp = await c.register_model(spec)
        keys = list((await c.put(fp, tokens(64), random_kv(spec, 64))).keys)  # 4 blocks, on NVMe (write-through)
        assert block_files(root) == {k.hex() for k in keys}

        # The tier's one I/O thread held by another namespace's write: the evict's first unlink waits behind it
        held, release = threading.Event(), threading.Event()

        def gate(op: str, path: Path) -> None:
            if op == "write":
                held.set()
                release.wait(30)

        nvme.fault_hook = gate
        other = asyncio.create_task(c.put(fp, tokens(16, seed=1), random_kv(spec, 16, seed=1), namespace="other"))
        assert await asyncio.to_thread(held.wait, 10)
        evict = asyncio.create_task(ctl.evict(whole_namespace=True, namespace="gone", timeout_s=60))

        async def first_removal_begun() -> bool:
            return srv.store.block(keys[-1]) is None

        await until(first_removal_begun, "the evict removed its first block from the index")
        evict.cancel()

        async def daemon_saw_the_cancel() -> bool:
            return rpcs_answered(srv, "Evict", "CANCELLED") == 1

        await until(daemon_saw_the_cancel, "the daemon's Evict handler ended, cancelled")
        release.set()
        await other
        nvme.fault_hook = None

        indexed = {m.key for m in srv.store.index if m.namespace == "gone"}
        assert keys[-1] not in indexed and keys[0] in indexed
        gone = len(keys) - len(indexed)

        async def files_match_the_index() -> bool:
            return block_files(root) == {k.hex() for k in nvme.keys()}  # noqa: SIM118  (a tier, not a dict)

        await until(files_match_the_index, "no block file but the tier's (no orphan)", timeout=10)
        assert keys[-1].hex() not in block_files(root)
        assert srv.store.counters.blocks_evicted_on_request == gone
    await srv.stop(0)

    # The journal recorded the remove: a restart on the directory does not bring the evicted block back
    again = await server_factory(**cfg)
    assert again.store.block(keys[-1]) is None
    assert {m.key for m in again.store.index if m.namespace == "gone"} == indexed
