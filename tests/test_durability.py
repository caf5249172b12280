"""Write-through means acknowledged = durable (docs/RELIABILITY.md), through a real daemon over gRPC.

Expected behaviour, per fault of the NVMe copy (ENOSPC, EIO, a degraded tier):
- tiers.on_nvme_failure = fail (default): the put fails with UNAVAILABLE naming the cause and the setting;
  nothing of the failed block is acknowledged or kept (a Lookup misses it, so a retry sends it again); the
  daemon keeps serving, and puts succeed again once the disk does.
- tiers.on_nvme_failure = degrade: the put is acknowledged with PutResult.not_durable counting the blocks
  that have no NVMe copy, Stats.blocks_not_durable counts them, the activity log warns.
- With an HBM tier, the second copy of a write-through put goes to NVMe, not to DRAM.
Both put paths are covered: Put streams (a private DRAM pool) and in-place puts (the shared pool).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path

import pytest

from engram import errors
from engram.client import EngramClient

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)
NS = "durable"


def fault(kind: int):  # type: ignore[no-untyped-def]
    state = {"on": True, "hits": 0}

    def hook(op: str, path: Path) -> None:
        if op == "write" and state["on"]:
            state["hits"] += 1
            raise OSError(kind, "No space left on device" if kind == errno.ENOSPC else "Input/output error")

    return hook, state


@pytest.mark.parametrize("pool", ["private", "shared"])
@pytest.mark.parametrize("kind", [errno.ENOSPC, errno.EIO], ids=["enospc", "eio"])
async def test_write_through_refuses_a_put_it_cannot_make_durable(server_factory, tmp_path: Path, pool: str,  # type: ignore[no-untyped-def]
                                                                  kind: int) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.pool": pool, "tiers.dram.capacity": 64 * BLOCK, "tiers.retry_s": 0.05})
    hook, state = fault(kind)
    nvme = srv.store.tiers[-1]
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        good = tokens(2 * BLOCK_TOKENS, seed=1)
        await client.put(fp, good, random_kv(SPEC, len(good), seed=1))
        nvme.fault_hook = hook
        bad = tokens(3 * BLOCK_TOKENS, seed=2)
        with pytest.raises(errors.Unavailable, match=r"write-through.*tiers\.on_nvme_failure = degrade"):
            await client.put(fp, bad, random_kv(SPEC, len(bad), seed=2))
        assert state["hits"] >= 1
        assert (await client.lookup(fp, bad)).matched_tokens == 0  # nothing of it kept: a retry sends it all
        n, got = await client.get_prefix(fp, good)  # the daemon serves on
        assert n == len(good) and got is not None
        stats = await client.stats()
        assert stats.blocks_not_durable == 0
        assert stats.tier("nvme").enospc >= 1 if kind == errno.ENOSPC else stats.tier("nvme").io_errors >= 1
        state["on"] = False  # the disk is back
        await asyncio.sleep(0.1)  # past tiers.retry_s
        result = await client.put(fp, bad, random_kv(SPEC, len(bad), seed=2))
        assert result.not_durable == 0 and result.stored == 3
    assert all("nvme" in m.locations for m in srv.store.blocks())
    assert len(nvme) == 5  # type: ignore[arg-type]


@pytest.mark.parametrize("pool", ["private", "shared"])
async def test_degrade_acknowledges_puts_as_not_durable_counts_and_warns(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                        pool: str, caplog: pytest.LogCaptureFixture
                                                                        ) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.on_nvme_failure": "degrade", "tiers.dram.pool": pool,
                                  "tiers.dram.capacity": 64 * BLOCK, "logging.summary_s": 0.05,
                                  "tiers.write_back_window_s": 0})
    hook, _ = fault(errno.ENOSPC)
    srv.store.tiers[-1].fault_hook = hook
    caplog.set_level(logging.WARNING, logger="engram.activity")
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        toks = tokens(3 * BLOCK_TOKENS + 5, seed=3)
        kv = random_kv(SPEC, len(toks), seed=3)
        result = await client.put(fp, toks, kv)
        assert result.stored == 4 and result.not_durable == 4
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and got is not None
        stats = await client.stats()
        assert stats.blocks_not_durable == 4 and stats.tier("nvme").state == "degraded"
        for _ in range(100):
            if "acknowledged without a durable copy" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "4 write-through blocks acknowledged without a durable copy" in caplog.text


async def test_with_an_hbm_tier_the_write_through_copy_goes_to_nvme(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.hbm.capacity": 64 * BLOCK, "tiers.hbm.device": "cpu",
                                  "tiers.dram.capacity": 64 * BLOCK, "tiers.dram.pool": "private"})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        toks = tokens(3 * BLOCK_TOKENS, seed=4)
        await client.put(fp, toks, random_kv(SPEC, len(toks), seed=4))
    assert [t.name for t in srv.store.tiers] == ["hbm", "dram", "nvme"]
    assert [m.locations for m in srv.store.blocks()] == [["hbm", "nvme"]] * 3
