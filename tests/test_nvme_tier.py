"""The NVMe tier on real files: durable writes, verified reads, demotion and promotion, recovery after a
restart, and every kind of broken file detected and never served."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import shutil
import struct
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engram import errors
from engram.block import BlockHeader, BlockRecord, checksum
from engram.client import EngramClient
from engram.codec.stored import RAW, encode
from engram.config import load_config
from engram.keys import root_key
from engram.layout import DType
from engram.server.app import build_store
from engram.store import BlockStore
from engram.tiers.journal import FILE_HEAD_LEN as JOURNAL_HEAD_LEN
from engram.tiers.journal import (
    JOURNAL_MAGIC,
    OWNED_PINS,
    PINS,
    IndexJournal,
    Pins,
    encode_entry,
    encode_head,
    encode_pins,
    parse_entries,
)
from engram.tiers.nvme import NvmeTier

from helpers import BLOCK_TOKENS, ENGRAM, NEUTRAL_CWD, random_kv, small_tmpfs, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)
NS = "tenant-a"


async def make_store(root: Path, dram_blocks: int = 4, nvme_blocks: int = 64, **tiers: object) -> BlockStore:
    overrides = {"tiers.dram.capacity": dram_blocks * BLOCK, "tiers.nvme.path": str(root),
                 "tiers.nvme.capacity": nvme_blocks * (BLOCK + 256), "tiers.retry_s": 0.05,
                 **{f"tiers.{k}": v for k, v in tiers.items()}}
    store = await build_store(load_config(env={}, overrides=overrides))
    store.registry.register(SPEC)
    return store


async def put_seq(store: BlockStore, toks: np.ndarray, kv: torch.Tensor, pin: bool = False) -> list[bytes]:
    fp = SPEC.fingerprint
    parent = root_key(NS, fp)
    keys = []
    for i, start in enumerate(range(0, len(toks), BLOCK_TOKENS)):
        t = toks[start : start + BLOCK_TOKENS]
        block = kv[:, :, start : start + BLOCK_TOKENS]
        payload = encode(block, RAW)
        header = BlockHeader(t, SPEC.layout.dtype, tuple(block.shape), len(payload), checksum(payload))
        out = await store.put(NS, fp, parent, header, payload, pin=pin, index=i)
        keys.append(out.key)
        parent = out.key
    return keys


async def get_seq(store: BlockStore, toks: np.ndarray) -> tuple[int, torch.Tensor | None]:
    match = store.lookup(NS, SPEC.fingerprint, toks)
    if not match.blocks:
        return 0, None
    store.acquire(match.blocks)
    try:
        payloads = [await store.read(m) for m in match.blocks]
    finally:
        store.release(match.blocks)
    dtype = SPEC.layout.dtype.torch_dtype
    parts = [torch.frombuffer(bytearray(p), dtype=torch.uint8).view(dtype).reshape(m.shape)
             for p, m in zip(payloads, match.blocks, strict=True)]
    return match.matched_tokens, torch.cat(parts, dim=2)


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").rglob("*.blk"))


async def test_demotion_then_promotion_keeps_every_block_readable(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=4)
    seqs = [tokens(3 * BLOCK_TOKENS, seed=s) for s in range(6)]
    kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
    for t, kv in zip(seqs, kvs, strict=True):
        await put_seq(store, t, kv)
    dram, nvme = store.tiers
    assert dram.used_bytes <= 4 * BLOCK
    assert len(nvme) == 18 - len(dram)  # write-back: what left DRAM went down, nothing was lost
    assert store.counters.tiers["dram"].demotions == 18 - len(dram)
    assert list((tmp_path / "tmp").iterdir()) == []  # no temp file outlives its write
    for t, kv in zip(seqs, kvs, strict=True):
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    assert store.counters.tiers["dram"].promotions > 0
    match = store.lookup(NS, SPEC.fingerprint, seqs[-1])
    assert all(m.tier == "dram" for m in match.blocks)  # the last read sequence was promoted
    await store.close()


async def test_a_full_last_tier_on_disk_deletes_its_victims_files(tmp_path: Path) -> None:
    # DRAM demotes into an NVMe tier that is full itself: NVMe, the last tier, deletes leaves, and a deletion
    # there is awaited (file I/O), unlike one from memory (Placement.delete_block_now hands it back).
    store = await make_store(tmp_path, dram_blocks=4, nvme_blocks=8)
    seqs = [tokens(3 * BLOCK_TOKENS, seed=s) for s in range(8)]
    kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
    for t, kv in zip(seqs, kvs, strict=True):
        await put_seq(store, t, kv)
    dram, nvme = store.tiers
    assert store.counters.tiers["nvme"].evictions > 0
    assert nvme.used_bytes <= nvme.capacity_bytes
    assert len(block_files(tmp_path)) == len(nvme)  # a deleted block's file is gone with it
    assert all(m.locations for m in store.index)  # every indexed block has a copy somewhere
    on_disk = {m.key for m in store.index if "nvme" in m.locations}
    assert {p.stem for p in block_files(tmp_path)} == {k.hex() for k in on_disk}
    found = sum(len(store.lookup(NS, SPEC.fingerprint, t).blocks) for t in seqs)
    assert found == len(store.index)  # prefix closure: every block kept is reachable from its root
    await store.close()


async def test_write_through_puts_every_block_on_disk(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    t = tokens(4 * BLOCK_TOKENS + 3)
    await put_seq(store, t, random_kv(SPEC, len(t)))
    assert len(block_files(tmp_path)) == 5
    assert all(m.locations == ["dram", "nvme"] for m in store.index)
    await store.close()


async def test_every_directory_a_durable_block_lies_in_is_itself_synced(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's file is fsynced, and so is the directory it is renamed into; a directory made for it (the tier's
    own at start, a fan-out directory on its first block) is only there after a power loss if its parent was
    synced after it was made."""
    synced: list[Path] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    root = tmp_path / "nvme"
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    assert {tmp_path, root} <= set(synced)  # the tier's directories, made at start
    t = tokens(BLOCK_TOKENS)
    await put_seq(store, t, random_kv(SPEC, len(t)))
    [path] = block_files(root)
    assert {path.parent, root / "blocks"} <= set(synced)  # its fan-out directory, made for it, and blocks/
    await store.close()


def _record_journal_syncs(monkeypatch: pytest.MonkeyPatch) -> dict[Path, int]:
    """From now on, each journal file's size at its last fsync: what a power loss keeps of it."""
    synced: dict[Path, int] = {}
    fsync = os.fsync

    def recording(fd: int) -> None:
        fsync(fd)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name.startswith("journal."):
            synced[path] = os.fstat(fd).st_size

    monkeypatch.setattr(os, "fsync", recording)
    return synced


@pytest.mark.parametrize("gone_by", ["eviction", "check --fix"])
async def test_a_block_written_again_with_other_bytes_survives_losing_the_journals_unsynced_tail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gone_by: str) -> None:
    """A block is deleted (evicted, or its corrupt file removed by an online check --fix), then put again with
    other bytes under the same key (a recompute that is not bit-identical). A power loss keeps the journal up to
    its last fsync, and any part of what follows: at every such cut, recovery serves the new file (had the old
    add survived without the remove, it would trust the old header for the new file and drop it at its first
    read: the check's remove was not synced before the new file was published, an audit)."""
    synced = _record_journal_syncs(monkeypatch)
    root = tmp_path / "nvme"
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    t = tokens(BLOCK_TOKENS, seed=9)
    [key] = await put_seq(store, t, random_kv(SPEC, len(t), seed=1))
    meta = store.index.get(key)
    assert meta is not None
    if gone_by == "eviction":
        await store.placement.delete_block(meta)
    else:
        await store.placement.drop_copy(meta, "dram")  # on disk only, then corrupt there
        _flip(store.tiers[1].path_of(key), -5)  # type: ignore[attr-defined]
        assert not (await store.check(fix=True)).ok and key not in store.index
    new = random_kv(SPEC, len(t), seed=2)
    assert await put_seq(store, t, new) == [key]
    journal = max((root / "index").glob("journal.*"), key=lambda p: int(p.name.split(".")[1]))
    cuts = [JOURNAL_HEAD_LEN]
    for _, body in parse_entries(journal.read_bytes())[0]:
        cuts.append(cuts[-1] + 13 + len(body))  # u32 length, u8 kind, body, u64 checksum
    assert len(cuts) >= 3  # the remove and the add at least
    for cut in [c for c in cuts if c >= synced.get(journal, 0)]:
        image = tmp_path / f"power-loss-{cut}"
        shutil.copytree(root, image, ignore=shutil.ignore_patterns("engram.lock"))
        os.truncate(image / "index" / journal.name, cut)
        recovered = await build_store(load_config(env={}, overrides={
            "tiers.nvme.path": str(image), "tiers.dram.capacity": 64 * BLOCK}))
        n, got = await get_seq(recovered, t)
        assert n == len(t) and got is not None and torch.equal(got, new), f"journal cut at {cut} of {cuts}"
        await recovered.close()
    await store.close()


async def test_a_write_cancelled_while_it_waits_for_the_journal_gives_its_room_back(tmp_path: Path) -> None:
    """Write-through: a block is evicted (its remove not yet synced to the journal) and put again; the client
    cancels the put while the NVMe write waits for that sync. The room the write had set aside is given back:
    it was not (the wait ran outside the write's give-back), so each such cancel lost a block's room until a
    restart, and a tier of 0 blocks came to refuse every put as full (an audit, session 44)."""
    store = await make_store(tmp_path / "nvme", dram_blocks=64, write_policy="write-through")
    nvme = store.tiers[1]
    t = tokens(BLOCK_TOKENS, seed=40)
    kv = random_kv(SPEC, len(t), seed=40)
    [key] = await put_seq(store, t, kv)
    meta = store.index.get(key)
    assert meta is not None
    await store.placement.delete_block(meta)
    assert nvme.used_bytes == 0 and key in nvme._removed  # type: ignore[attr-defined]
    gate = threading.Event()
    journal = nvme._journal  # type: ignore[attr-defined]
    sync = journal.sync

    def held_sync() -> None:
        gate.wait(30)
        sync()

    journal.sync = held_sync
    put = asyncio.create_task(put_seq(store, t, kv))
    for _ in range(1000):
        if nvme.used_bytes:
            break
        await asyncio.sleep(0.001)
    assert nvme.used_bytes > 0  # room set aside, the write waiting for the remove's sync
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    gate.set()
    journal.sync = sync
    assert nvme.used_bytes == 0 and not block_files(tmp_path / "nvme")
    assert await put_seq(store, t, kv) == [key]  # and the tier takes it again
    assert nvme.used_bytes == sum(p.stat().st_size for p in block_files(tmp_path / "nvme"))
    await store.close()


async def test_a_journaled_block_whose_file_is_gone_at_start_survives_being_written_again_and_a_power_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block the snapshot records whose file is gone at start (an offline check --fix removed it, or a power
    loss kept its unlink but not its remove) was dropped without a remove in the journal: put again with other
    bytes, its add not synced yet, a power loss made the next start trust the old header for the new file and
    drop the acknowledged block at its first read. Now the start journals the remove, synced before a file of
    the key is published."""
    root = tmp_path / "nvme"
    await _store_on_disk(root)  # blocks the next starts trust (none to trust writes a snapshot at once)
    t = tokens(BLOCK_TOKENS, seed=9)
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    [key] = await put_seq(store, t, random_kv(SPEC, len(t), seed=1))
    path = store.tiers[1].path_of(key)  # type: ignore[attr-defined]
    await store.close()  # the snapshot holds the block's first header
    path.unlink()
    synced = _record_journal_syncs(monkeypatch)
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    assert key not in store.index
    new = random_kv(SPEC, len(t), seed=2)
    assert await put_seq(store, t, new) == [key]
    journal = _newest_journal(root / "index")
    image = tmp_path / "power-loss"
    shutil.copytree(root, image, ignore=shutil.ignore_patterns("engram.lock"))
    await store.close()
    os.truncate(image / "index" / journal.name, synced.get(journal, 0))  # what was appended since, lost
    recovered = await make_store(image, dram_blocks=64)
    n, got = await get_seq(recovered, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    await recovered.close()


async def test_check_reports_progress_per_file(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    t = tokens(4 * BLOCK_TOKENS + 3)
    await put_seq(store, t, random_kv(SPEC, len(t)))
    await store.close()
    (tmp_path / "blocks" / "stray.txt").write_text("not a block")  # counted too: every entry is looked at
    calls: list[tuple[int, int]] = []
    offline = NvmeTier(tmp_path, 1 << 40)
    report = await offline.check(fix=False, progress=lambda done, total: calls.append((done, total)))
    await offline.close()
    assert calls == [(i, 6) for i in range(1, 7)] and report.scanned == 6 and report.valid == 5


async def test_restart_recovers_every_committed_block(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    seqs = [tokens(2 * BLOCK_TOKENS + s, seed=s) for s in range(4)]
    kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
    for t, kv in zip(seqs, kvs, strict=True):
        await put_seq(store, t, kv)
    await store.close()

    store2 = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(tmp_path), "tiers.dram.capacity": 64 * BLOCK}))
    assert SPEC.fingerprint in store2.registry  # the model came back from its file
    assert len(store2.index) == sum(-(-len(t) // BLOCK_TOKENS) for t in seqs)
    for t, kv in zip(seqs, kvs, strict=True):
        n, got = await get_seq(store2, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    assert (await store2.check(fix=False)).ok
    await store2.close()


async def test_model_file_lost_keeps_blocks_until_registered(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    t = tokens(2 * BLOCK_TOKENS)
    kv = random_kv(SPEC, len(t))
    await put_seq(store, t, kv)
    await store.close()
    for f in (tmp_path / "models").iterdir():
        f.unlink()
    store2 = await build_store(load_config(env={}, overrides={"tiers.nvme.path": str(tmp_path),
                                                              "tiers.dram.capacity": "64MiB"}))
    assert len(store2.index) == 2
    with pytest.raises(errors.NotFound, match="RegisterModel"):
        store2.lookup(NS, SPEC.fingerprint, t)
    store2.registry.register(SPEC)
    n, got = await get_seq(store2, t)
    assert n == len(t) and got is not None and torch.equal(got, kv)
    await store2.close()


def _flip(path: Path, offset: int, mask: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


async def _second_block_on_disk(root: Path) -> tuple[list[np.ndarray], list[torch.Tensor], bytes, Path]:
    """`_store_on_disk`'s blocks, the daemon stopped: (sequences, KV, the first sequence's second block's key,
    its file)."""
    seqs, kvs = await _store_on_disk(root)
    store = await make_store(root, dram_blocks=64)
    victim = store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks[1].key
    path: Path = store.tiers[1].path_of(victim)  # type: ignore[attr-defined]
    await store.close()
    return seqs, kvs, victim, path


async def _store_on_disk(root: Path, n_seqs: int = 3) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    seqs = [tokens(2 * BLOCK_TOKENS, seed=s) for s in range(n_seqs)]
    kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
    for t, kv in zip(seqs, kvs, strict=True):
        await put_seq(store, t, kv)
    await store.close()
    return seqs, kvs


async def settle(store: BlockStore) -> None:
    """Wait for the background check of the files recovery trusted from the NVMe tier's journal."""
    await asyncio.gather(*store.background)


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
@pytest.mark.parametrize("mayhem", ["truncate", "payload_flip", "header_flip", "delete", "wrong_name"])
async def test_broken_files_are_detected_at_restart_and_never_served(tmp_path: Path, mayhem: str,
                                                                     journal: bool) -> None:
    # With its journal, the tier trusts the files it lists at restart and checks their headers in the
    # background (settle); without (a directory from before the journal), recovery reads every header.
    seqs, kvs = await _store_on_disk(tmp_path)
    store = await make_store(tmp_path, dram_blocks=64)
    victim_key = store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks[1].key  # the second block of seq 0
    path = store.tiers[1].path_of(victim_key)  # type: ignore[attr-defined]
    await store.close()
    if mayhem == "truncate":
        os.truncate(path, path.stat().st_size - 7)
    elif mayhem == "payload_flip":
        _flip(path, path.stat().st_size - 100)
    elif mayhem == "header_flip":
        _flip(path, 60)
    elif mayhem == "delete":
        path.unlink()
    else:
        path.rename(path.with_name("00" * 16 + ".blk"))
    if not journal:
        shutil.rmtree(tmp_path / "index")

    # An offline check reports the damage (a deleted file leaves nothing to report offline).
    offline = NvmeTier(tmp_path, 1 << 40)
    report = await offline.check(fix=False)
    await offline.close()
    assert (len(report.findings) == 1) == (mayhem != "delete"), report.findings

    store = await make_store(tmp_path, dram_blocks=64)
    await settle(store)
    if mayhem == "payload_flip":
        # Recovery reads headers only; the flip is caught on the first read, and the copy dropped.
        assert store.lookup(NS, SPEC.fingerprint, seqs[0]).matched_tokens == len(seqs[0])
        with pytest.raises(errors.DataLoss, match="checksum"):
            await get_seq(store, seqs[0])
        assert store.counters.corrupt_blocks == 1
    n, got = await get_seq(store, seqs[0])
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, kvs[0][:, :, :BLOCK_TOKENS])
    for t, kv in zip(seqs[1:], kvs[1:], strict=True):
        n2, got2 = await get_seq(store, t)
        assert n2 == len(t) and got2 is not None and torch.equal(got2, kv)
    assert (await store.check(fix=False)).ok  # recovery (and the failed read) removed the broken file
    await store.close()


async def test_stray_files_and_torn_writes_are_removed_at_start(tmp_path: Path) -> None:
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=1)
    (tmp_path / "tmp" / "abc.1234.tmp").write_bytes(b"half a block")
    (tmp_path / "blocks" / "notes.txt").write_text("stray")
    (tmp_path / "blocks" / "zz").mkdir()
    (tmp_path / "blocks" / "zz" / "garbage.blk").write_bytes(os.urandom(300))
    store = await make_store(tmp_path, dram_blocks=64)
    n, got = await get_seq(store, seqs[0])
    assert n == len(seqs[0]) and got is not None and torch.equal(got, kvs[0])
    assert not (tmp_path / "tmp" / "abc.1234.tmp").exists()
    assert not (tmp_path / "blocks" / "notes.txt").exists()
    assert not (tmp_path / "blocks" / "zz" / "garbage.blk").exists()
    assert (await store.check(fix=False)).ok
    await store.close()


async def test_orphans_are_dropped_at_recovery(tmp_path: Path) -> None:
    seqs, _ = await _store_on_disk(tmp_path, n_seqs=1)
    store = await make_store(tmp_path)
    root_block = store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks[0]
    path = store.tiers[1].path_of(root_block.key)  # type: ignore[attr-defined]
    await store.close()
    path.unlink()
    store = await make_store(tmp_path)
    assert len(store.index) == 0 and block_files(tmp_path) == []  # the child was unreachable
    await store.close()


async def test_online_check_finds_and_fixes_a_corrupted_file(tmp_path: Path) -> None:
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=1)
    store = await make_store(tmp_path, dram_blocks=1)  # at most one block in DRAM: reads hit the disk
    key = store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks[1].key
    _flip(store.tiers[1].path_of(key), -5)  # type: ignore[attr-defined]
    report = await store.check(fix=False)
    assert not report.ok and any("checksum" in p for _, p, _ in report.findings)
    assert key in store.index  # a check without --fix changes nothing
    report = await store.check(fix=True)
    assert key not in store.index and (await store.check(fix=False)).ok
    n, got = await get_seq(store, seqs[0])
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, kvs[0][:, :, :BLOCK_TOKENS])
    await store.close()


async def test_online_check_leaves_a_write_that_starts_while_it_lists_temp_files(tmp_path: Path,
                                                                                   monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The race CI caught once under load: a write that registers its temp file after the check began (and
    whose file exists when the check lists the temp directory) was taken for a torn write and deleted under
    the writer. Here the race is forced: the check's listing waits until such a write's temp file exists."""
    store = await make_store(tmp_path, dram_blocks=8, write_policy="write-through")
    nvme = store.tiers[1]
    loop = asyncio.get_running_loop()
    synced, release = threading.Event(), threading.Event()
    real_fsync, temps = os.fsync, str(nvme.tmp_dir)  # type: ignore[attr-defined]

    def held_fsync(fd: int) -> None:  # the file write itself is real; only its fsync waits for the test
        if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{temps}/"):  # a block's temp file, not the journal's
            synced.set()
            release.wait(10)
        real_fsync(fd)

    t = tokens(BLOCK_TOKENS, seed=7)
    kv = random_kv(SPEC, BLOCK_TOKENS, seed=7)
    put: list[asyncio.Future] = []  # type: ignore[type-arg]

    class ListsDuringAWrite(type(nvme.tmp_dir)):  # type: ignore[misc]
        def iterdir(self):  # type: ignore[no-untyped-def]
            if not put:  # the first listing: start a write now, and list once its temp file exists
                monkeypatch.setattr("engram.tiers.nvme.os.fsync", held_fsync)
                put.append(asyncio.run_coroutine_threadsafe(put_seq(store, t, kv), loop))
                assert synced.wait(10), "the write never reached its fsync"
            return super().iterdir()

    nvme.tmp_dir = ListsDuringAWrite(nvme.tmp_dir)  # type: ignore[attr-defined]
    check = asyncio.ensure_future(store.check(fix=True))
    while not put or not synced.is_set():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the check lists the temp directory now, with the write's file in it
    release.set()
    report = await check
    keys = await asyncio.wrap_future(put[0])
    assert report.ok, report.findings  # the write in flight is not a torn one
    assert nvme.path_of(keys[0]).exists()  # type: ignore[attr-defined]
    n, got = await get_seq(store, t)
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, kv)
    await store.close()


async def test_lz4_is_used_only_when_it_pays(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through", **{"nvme.compression": True})
    t = tokens(2 * BLOCK_TOKENS)
    random_block = random_kv(SPEC, BLOCK_TOKENS)
    zero_block = torch.zeros_like(random_block)
    kv = torch.cat([random_block, zero_block], dim=2)
    keys = await put_seq(store, t, kv)
    nvme = store.tiers[1]
    sizes = [nvme.path_of(k).stat().st_size for k in keys]  # type: ignore[attr-defined]
    assert sizes[0] > BLOCK  # random bf16: stored raw
    assert sizes[1] < BLOCK // 4  # zeros: compressed
    await store.close()
    store = await make_store(tmp_path, dram_blocks=1)
    n, got = await get_seq(store, t)
    assert n == len(t) and got is not None and torch.equal(got, kv)
    await store.close()


def _fill_until_full(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


async def _exercise_disk_full(store: BlockStore, free_space) -> None:  # type: ignore[no-untyped-def]
    seqs = [tokens(2 * BLOCK_TOKENS, seed=s) for s in range(8)]
    kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
    for t, kv in zip(seqs, kvs, strict=True):
        await put_seq(store, t, kv)  # DRAM holds 4 blocks: demotions start and meet a full disk
    health = store.health["nvme"]
    assert health.state == "degraded" and "no space" in health.reason
    assert store.counters.tiers["nvme"].enospc >= 1
    n, got = await get_seq(store, seqs[-1])  # DRAM-only service continues
    assert n == len(seqs[-1]) and got is not None and torch.equal(got, kvs[-1])
    free_space()
    await asyncio.sleep(0.1)  # past retry_s
    for s in range(8, 12):
        t = tokens(2 * BLOCK_TOKENS, seed=s)
        await put_seq(store, t, random_kv(SPEC, len(t), seed=s))
    assert health.state == "ok" and len(store.tiers[1]) > 0
    for meta in list(store.index):  # everything still indexed is readable and intact
        store.acquire([meta])
        try:
            assert checksum(await store.read(meta, promote=False)) == meta.checksum
        finally:
            store.release([meta])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root; the injected-ENOSPC test covers the logic")
async def test_disk_full_on_a_real_small_filesystem_degrades_and_recovers(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small") as mnt:
        store = await make_store(mnt, dram_blocks=4, nvme_blocks=1000)  # the budget is not the limit: the disk is
        filler = _fill_until_full(mnt)
        await _exercise_disk_full(store, lambda: filler.unlink())
        await store.close()


async def test_disk_full_injected_at_the_io_boundary(tmp_path: Path) -> None:
    # The same scenario with ENOSPC raised by the tier's I/O boundary (fault_hook) instead of a real disk.
    store = await make_store(tmp_path, dram_blocks=4)
    full = {"on": True}

    def hook(op: str, path: Path) -> None:
        if op == "write" and full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")

    store.tiers[1].fault_hook = hook  # type: ignore[attr-defined]
    await _exercise_disk_full(store, lambda: full.update(on=False))
    await store.close()


def _journal_writes_fail(monkeypatch: pytest.MonkeyPatch, full: dict[str, bool], *, short: bool = False) -> None:
    """While full["on"], every write into an index journal file fails with ENOSPC, or with `short` writes half
    its bytes (what the kernel returns when the disk fills mid-write); block files are written as usual."""
    write = os.write

    def failing(fd: int, data: bytes) -> int:
        if full["on"] and Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith("journal."):
            if short:
                return write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", failing)


async def _exercise_a_full_disk_at_start(root: Path, start, free_space, *,  # type: ignore[no-untyped-def]
                                        with_index: bool = True) -> None:
    """A restart on a full disk: the tier cannot create its journal, so it serves its block files without one,
    degraded (DRAM evicts leaves instead of demoting), leaves no journal file behind and keeps the snapshot (the
    record of the pins: deleting it lost them); once the disk has room, a write opens a journal again, and the
    next start trusts it. Without `with_index`, the directory has no index/ (a release before
    the journal wrote it): this start would be the journal's first, and cannot even make its directory."""
    seqs, kvs = await _store_on_disk(root)
    index = root / "index"
    if not with_index:
        shutil.rmtree(index)

    def listing() -> list[str] | None:
        return sorted(p.name for p in index.iterdir()) if index.exists() else None

    before = listing()
    store = await start()  # the disk is full now
    health = store.health["nvme"]
    assert health.state == "degraded" and "no space" in health.reason and "journal" in health.reason
    assert listing() == before
    for t, kv in zip(seqs, kvs, strict=True):
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    free_space()
    await asyncio.sleep(0.1)  # past retry_s
    more = [tokens(2 * BLOCK_TOKENS, seed=s) for s in range(3, 8)]
    more_kvs = [random_kv(SPEC, len(t), seed=s) for s, t in zip(range(3, 8), more, strict=True)]
    for t, kv in zip(more, more_kvs, strict=True):
        await put_seq(store, t, kv)  # DRAM holds 4 blocks: demotions to NVMe, which opens a journal first
    assert health.state == "ok"
    on_nvme = set(store.tiers[1].keys())  # type: ignore[attr-defined]
    assert len(on_nvme) > 6
    await store.close()
    store = await make_store(root, dram_blocks=64)
    nvme = store.tiers[1]
    assert set(nvme.keys()) == on_nvme and nvme.unverified == on_nvme  # type: ignore[attr-defined]  # journaled
    assert {m.key for m in store.index} == on_nvme  # (blocks only DRAM held at the stop are gone: write-back)
    for t, kv in zip(seqs, kvs, strict=True):
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    await store.close()


async def test_a_restart_on_a_full_disk_serves_without_a_journal_degraded_and_journals_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ENOSPC injected into the journal's writes (its file is created, its head is not written) and, through the
    # fault hook, into block writes; the next test does it with a real full filesystem.
    full = {"on": False}
    _journal_writes_fail(monkeypatch, full)

    def hook(op: str, path: Path) -> None:
        if op == "write" and full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")

    async def start() -> BlockStore:
        full["on"] = True
        store = await make_store(tmp_path, dram_blocks=4)
        store.tiers[1].fault_hook = hook  # type: ignore[attr-defined]
        return store

    await _exercise_a_full_disk_at_start(tmp_path, start, lambda: full.update(on=False))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root; the injected-ENOSPC test covers the logic")
async def test_a_restart_on_a_real_full_filesystem_serves_degraded_and_journals_again(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small") as mnt:
        filler: list[Path] = []

        async def start() -> BlockStore:
            filler.append(_fill_until_full(mnt))
            return await make_store(mnt, dram_blocks=4, nvme_blocks=1000)

        await _exercise_a_full_disk_at_start(mnt, start, lambda: filler[0].unlink())


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_first_start_on_a_real_full_filesystem_without_an_index_directory_serves_degraded_and_journals_again(
        tmp_path: Path) -> None:
    # Directories take no pages on tmpfs: its inodes are filled too, so that making index/ fails (ENOSPC), as
    # it does on a full ext4. It stopped the start (the tier made index/ before anything else).
    with small_tmpfs(tmp_path / "small", inodes=256) as mnt:
        fillers: list[Path] = []

        async def start() -> BlockStore:
            fillers.append(_fill_until_full(mnt))
            fillers.append(mnt / "inodes")
            fillers[-1].mkdir()
            with contextlib.suppress(OSError):
                for n in range(10_000):
                    (fillers[-1] / str(n)).touch()
            with pytest.raises(OSError):
                (mnt / "index").mkdir()
            return await make_store(mnt, dram_blocks=4, nvme_blocks=1000)

        def free_space() -> None:
            fillers[0].unlink()
            shutil.rmtree(fillers[1])

        await _exercise_a_full_disk_at_start(mnt, start, free_space, with_index=False)


async def test_a_journal_append_that_fails_loses_no_block_written_again_with_other_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal append cut short by a full disk mid-run (a block's remove, torn: the entries after it are never
    read): the tier goes on without its journal, and the next write opens a new one, appending the remove again
    (and syncing it) before a file of the key is published, so a crash never trusts the old header for a block
    written again under its key with other bytes (it dropped that block at its first read)."""
    root = tmp_path / "nvme"
    t = tokens(BLOCK_TOKENS, seed=9)
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    [key] = await put_seq(store, t, random_kv(SPEC, len(t), seed=1))
    await store.close()  # the snapshot holds the block's first header
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    full = {"on": True}
    _journal_writes_fail(monkeypatch, full, short=True)
    meta = store.index.get(key)
    assert meta is not None
    await store.placement.delete_block(meta)  # evicted: its remove is torn (the unlink frees room)
    full["on"] = False
    new = random_kv(SPEC, len(t), seed=2)
    assert await put_seq(store, t, new) == [key]
    crash = tmp_path / "crash"  # the directory as a crash leaves it now
    shutil.copytree(root, crash, ignore=shutil.ignore_patterns("engram.lock"))
    recovered = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(crash), "tiers.dram.capacity": 64 * BLOCK}))
    n, got = await get_seq(recovered, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    await recovered.close()
    await store.close()
    assert len(parse_entries((root / "index" / "snapshot").read_bytes())[0]) == 1  # journaled again


async def test_a_dropped_journals_kept_snapshot_recovers_what_changed_since_after_a_crash_meanwhile_or_after(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A journal dropped by a full disk keeps its snapshot and journals (deleting the snapshot lost every pin at
    the next start), and stays correct for what changed since: a crash while it is dropped finds a block removed
    meanwhile gone (its file unlinked, its remove not journaled), the others and their pins as recorded; once it
    opens again, the removes and pin changes made meanwhile are journaled first, and a crash then recovers a block
    written again under a removed key with other bytes, a new block the snapshot does not list, and the pins as
    they are, trusting no stale record."""
    root = tmp_path / "nvme"
    seqs = [tokens(2 * BLOCK_TOKENS, seed=s) for s in range(4)]
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    keys = [await put_seq(store, t, random_kv(SPEC, len(t), seed=s), pin=s == 1) for s, t in enumerate(seqs[:3])]
    await store.close()  # the snapshot: chains 0-2, chain 1 pinned
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    nvme = store.tiers[1]
    full = {"on": True}

    def hook(op: str, path: Path) -> None:
        if full["on"] and op in ("journal", "snapshot"):
            raise OSError(errno.ENOSPC, "No space left on device")

    nvme.fault_hook = hook  # type: ignore[attr-defined]
    fp = SPEC.fingerprint
    store.pin(NS, fp, keys[2])  # its entry fails: the journal is dropped
    for meta in reversed(store.find(NS, fp, keys[0])):
        await store.placement.delete_block(meta)  # removed meanwhile: files unlinked, no remove journaled
    assert nvme.trouble is not None and (root / "index" / "snapshot").exists()  # type: ignore[attr-defined]

    def crash_copy(name: str) -> Path:
        where = tmp_path / name
        shutil.copytree(root, where, ignore=shutil.ignore_patterns("engram.lock"))
        return where

    meanwhile = crash_copy("meanwhile")
    full["on"] = False
    again = random_kv(SPEC, len(seqs[0]), seed=10)
    assert await put_seq(store, seqs[0], again) == keys[0]  # opens a journal: what changed is recorded first
    new = await put_seq(store, seqs[3], random_kv(SPEC, len(seqs[3]), seed=3))
    assert nvme.trouble is None  # type: ignore[attr-defined]
    after = crash_copy("after")
    await store.close()
    caplog.clear()
    for where, want_pins in ((meanwhile, {1: 1, 2: 0}), (after, {1: 1, 2: 1}), (root, {1: 1, 2: 1})):
        recovered = await make_store(where, dram_blocks=64)
        pins = {m.key: m.pins for m in recovered.blocks(NS)}
        assert {k: pins[k] for i in want_pins for k in keys[i]} == {
            k: n for i, n in want_pins.items() for k in keys[i]}, where
        for s in (1, 2):
            n, got = await get_seq(recovered, seqs[s])
            assert n == len(seqs[s]) and got is not None and torch.equal(got, random_kv(SPEC, len(seqs[s]), seed=s))
        n, got = await get_seq(recovered, seqs[0])
        if where == meanwhile:
            assert n == 0 and not any(k in pins for k in keys[0])
        else:
            assert n == len(seqs[0]) and got is not None and torch.equal(got, again)
            assert all(k in pins for k in new)
        await recovered.close()
    assert "record was stale" not in caplog.text and "not trusted" not in caplog.text


def test_a_journal_append_cut_short_by_the_file_size_limit_is_reported_as_that_not_a_full_disk(tmp_path: Path) -> None:
    """A process whose file size limit (RLIMIT_FSIZE, `ulimit -f`) a journal append reaches: the kernel writes
    what fits and the rest fails EFBIG; the journal is dropped naming that cause, "File too large". Every
    short write was reported as "a short write (the disk is full)" (an audit, session 46: a daemon under
    `ulimit -f` on a disk with room). In a process of its own: the limit is the process's."""
    script = (
        "import logging, resource, sys\n"
        "from pathlib import Path\n"
        "from engram.tiers.journal import IndexJournal\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s', stream=sys.stdout)\n"
        "journal = IndexJournal(Path(sys.argv[1]), fsync=False)\n"
        "journal.open()\n"
        "[(_, path)] = journal.journals()\n"
        "hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, hard))  # 10 bytes of an entry fit\n"
        "journal.remove(bytes(32))\n"
        "print('errno', journal.error.errno if journal.error else None)\n"
    )
    out = subprocess.run([*ENGRAM[:1], "-c", script, str(tmp_path)], capture_output=True, text=True,
                         cwd=NEUTRAL_CWD, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"errno {errno.EFBIG}" in out.stdout
    assert "File too large; the tier goes on without it" in out.stdout and "disk is full" not in out.stdout


async def test_a_stray_journal_of_a_generation_past_a_u64_is_reported_and_ignored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # No journal can be numbered after it: it stopped every start (struct.error), each leaving another file.
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=1)
    stray = tmp_path / "index" / f"journal.{2**64 - 1}"
    stray.write_bytes(b"")
    for _ in range(2):
        caplog.clear()
        store = await make_store(tmp_path, dram_blocks=64)
        assert [r.getMessage() for r in caplog.records if "generation" in r.getMessage()] == [
            f"recovery: {stray}: journal generation out of range (not below 2^64-1): ignored"]
        n, got = await get_seq(store, seqs[0])
        assert n == len(seqs[0]) and got is not None and torch.equal(got, kvs[0])
        await store.close()
    journals = [int(p.name.split(".")[1]) for p in (tmp_path / "index").glob("journal.*")]
    assert sorted(journals)[-1] == 2**64 - 1 and sorted(journals)[-2] < 100
    offline = NvmeTier(tmp_path, 1 << 40)
    report = await offline.check(fix=False)
    await offline.close()
    assert [(f.path, f.fixed) for f in report.findings] == [(str(stray), False)]


async def test_check_fix_removes_stray_journals_past_a_u64_and_a_second_check_is_clean(tmp_path: Path) -> None:
    """`engram check --fix` reported a journal file numbered past the u64 range and could not clear it: every
    check after it still found it (exit 1). The fix removes such files (no daemon reads them); a directory so
    named is reported and left, as in blocks/. The journal itself and every block stay."""
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=2)
    index = tmp_path / "index"
    strays = [index / f"journal.{2**64 - 1}", index / f"journal.{2**70}"]
    for stray in strays:
        stray.write_bytes(encode_head(JOURNAL_MAGIC, 7))

    def check(*args: str) -> tuple[int, list[tuple[str, bool]]]:
        got = subprocess.run([*ENGRAM, "check", "--dir", str(tmp_path), "--json", *args], capture_output=True,
                             text=True, timeout=120, cwd=NEUTRAL_CWD)
        return got.returncode, sorted((f["path"], f["fixed"]) for f in json.loads(got.stdout)["findings"])

    assert check() == (1, sorted((str(p), False) for p in strays))
    assert check("--fix") == (1, sorted((str(p), True) for p in strays))
    assert not any(p.exists() for p in strays)
    assert check() == (0, [])
    store = await make_store(tmp_path, dram_blocks=64)
    nvme = store.tiers[1]
    assert nvme.unverified == set(nvme.keys()) and len(nvme) == 4  # type: ignore[attr-defined]  # journal kept
    for t, kv in zip(seqs, kvs, strict=True):
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    strays[0].write_bytes(b"")  # and through a running daemon's check
    (index / f"journal.{2**65}").mkdir()
    report = await store.check(fix=True)
    assert sorted((Path(p).name, fixed) for p, _, fixed in report.findings) == [
        (f"journal.{2**64 - 1}", True), (f"journal.{2**65}", False)]
    assert not strays[0].exists() and (index / f"journal.{2**65}").is_dir()
    await store.close()


async def test_a_stray_journal_numbered_just_below_the_u64_limit_is_renumbered_away(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The next generation after journal.<2^64-2> does not fit its u64 field: the tier served without a journal,
    # degraded, at every start until someone removed the file. Now it renumbers its journals.
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=1)
    stray = tmp_path / "index" / f"journal.{2**64 - 2}"
    stray.write_bytes(b"")
    store = await make_store(tmp_path, dram_blocks=64)
    assert store.health["nvme"].state == "ok"
    assert any("renumbered" in r.getMessage() and str(2**64 - 1) in r.getMessage() for r in caplog.records)
    n, got = await get_seq(store, seqs[0])
    assert n == len(seqs[0]) and got is not None and torch.equal(got, kvs[0])
    keys = set(store.tiers[1].keys())  # type: ignore[attr-defined]
    await store.close()
    assert not stray.exists()
    assert max(int(p.name.split(".")[1]) for p in (tmp_path / "index").glob("journal.*")) < 100
    store = await make_store(tmp_path, dram_blocks=64)
    assert store.tiers[1].unverified == keys  # type: ignore[attr-defined]  # trusted from the new snapshot
    n, got = await get_seq(store, seqs[0])
    assert n == len(seqs[0]) and got is not None and torch.equal(got, kvs[0])
    await store.close()


OTHER = tokens(BLOCK_TOKENS, seed=10)


async def _a_block_written_again_at_a_crash(tmp_path: Path, *, another_first: bool = False,
                                            ) -> tuple[Path, np.ndarray, torch.Tensor]:
    """A directory as a crash leaves it: blocks in the snapshot, and one of them deleted and written again with
    other bytes since (its remove and new add in the newest journal; with `another_first`, after the add of
    another block, OTHER). Trusting the snapshot without that journal would trust the old header for the new
    file, and drop the block at its first read."""
    root = tmp_path / "nvme"
    await _store_on_disk(root)
    t = tokens(BLOCK_TOKENS, seed=9)
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    [key] = await put_seq(store, t, random_kv(SPEC, len(t), seed=1))
    await store.close()  # the snapshot holds the block's first header
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    if another_first:
        await put_seq(store, OTHER, random_kv(SPEC, len(OTHER), seed=10))
    meta = store.index.get(key)
    assert meta is not None
    await store.placement.delete_block(meta)
    new = random_kv(SPEC, len(t), seed=2)
    assert await put_seq(store, t, new) == [key]
    crash = tmp_path / "crash"
    shutil.copytree(root, crash, ignore=shutil.ignore_patterns("engram.lock"))
    await store.close()
    return crash, t, new


@pytest.mark.parametrize(("name", "offset"), [("snapshot", 16), ("snapshot", 23), ("journal", 0), ("journal", 16)],
                         ids=["snapshot-generation-low-byte", "snapshot-generation-high-byte", "journal-magic",
                              "journal-generation"])
async def test_a_flipped_byte_in_an_index_file_head_keeps_every_acknowledged_block_and_serves_none_wrong(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, offset: int) -> None:
    """A head that fails its checksum (or its magic) is not trusted: with a wrong snapshot generation, recovery
    skipped the journal since (every journal looked older), trusted the rewritten block's old header and
    dropped the block at its first read. Now it reads every block file, and says so."""
    crash, t, new = await _a_block_written_again_at_a_crash(tmp_path)
    index = crash / "index"
    path = index / "snapshot" if name == "snapshot" else max(
        index.glob("journal.*"), key=lambda p: int(p.name.split(".")[1]))
    _flip(path, offset, 0xFF)
    store = await make_store(crash, dram_blocks=64)
    n, got = await get_seq(store, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    for s in range(3):  # the blocks of _store_on_disk
        seq = tokens(2 * BLOCK_TOKENS, seed=s)
        n, got = await get_seq(store, seq)
        assert n == len(seq) and got is not None and torch.equal(got, random_kv(SPEC, len(seq), seed=s))
    assert (await store.check(fix=False)).ok
    assert any(f"{path} is not trusted" in r.getMessage() and "reads every block file" in r.getMessage()
               for r in caplog.records)
    assert not store.tiers[1].unverified  # type: ignore[attr-defined]  # every file read, none trusted
    await store.close()
    assert struct.unpack_from("<H", (index / "snapshot").read_bytes(), 8) == (2,)  # a new snapshot, trusted again


def _newest_journal(index: Path) -> Path:
    return max(index.glob("journal.*"), key=lambda p: int(p.name.split(".")[1]))


def _a_later_journal_opened(index: Path) -> None:
    """What a start that opened the next journal and crashed leaves: the newest journal is the last no more."""
    gen = int(_newest_journal(index).name.split(".")[1]) + 1
    (index / f"journal.{gen}").write_bytes(encode_head(JOURNAL_MAGIC, gen))


async def _every_block_served_right(store: BlockStore, t: np.ndarray, new: torch.Tensor) -> None:
    n, got = await get_seq(store, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    n, got = await get_seq(store, OTHER)
    assert n == len(OTHER) and got is not None and torch.equal(got, random_kv(SPEC, len(OTHER), seed=10))
    for s in range(3):  # the blocks of _store_on_disk
        seq = tokens(2 * BLOCK_TOKENS, seed=s)
        n, got = await get_seq(store, seq)
        assert n == len(seq) and got is not None and torch.equal(got, random_kv(SPEC, len(seq), seed=s))
    await settle(store)
    assert (await store.check(fix=False)).ok


@pytest.mark.parametrize(("field", "offset"), [("body", 5 + 60), ("length", 3), ("kind", 4)])
async def test_a_corrupt_entry_inside_a_journal_keeps_every_acknowledged_block_and_serves_none_wrong(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, offset: int) -> None:
    """Bit rot in an entry with entries after it (a block's remove, and its add with other bytes), in a journal
    that is not the last: reading stopped there as at a crash's torn tail, so recovery trusted the block's old
    header for the file written again and dropped the acknowledged block at its first read. A whole entry that
    fails its checksum, or an impossible head (a length past the end that its block header contradicts, a kind),
    with bytes after it is damage: the start reads every block file, and says so."""
    crash, t, new = await _a_block_written_again_at_a_crash(tmp_path, another_first=True)
    path = _newest_journal(crash / "index")
    data = bytearray(path.read_bytes())
    assert [kind for kind, _ in parse_entries(data)[0]] == [1, 2, 1]  # OTHER's add, the remove, the new add
    data[JOURNAL_HEAD_LEN + offset] ^= 0x40  # in OTHER's add
    path.write_bytes(bytes(data))
    _a_later_journal_opened(crash / "index")
    store = await make_store(crash, dram_blocks=64)
    n, got = await get_seq(store, t)  # its old header trusted, it was dropped here: DataLoss
    assert n == len(t) and got is not None and torch.equal(got, new)
    assert not store.tiers[1].unverified  # type: ignore[attr-defined]  # every file read, none trusted
    assert any(f"{path} is not trusted" in r.getMessage() and "reads every block file" in r.getMessage()
               for r in caplog.records)
    await _every_block_served_right(store, t, new)
    await store.close()


@pytest.mark.parametrize("tear", ["in-its-head", "in-its-body", "checksum-at-the-end", "zeros"])
async def test_a_journal_whose_last_entry_a_crash_tore_is_still_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, tear: str) -> None:
    """A crash tears at most a journal's last entry (fewer bytes left than its head, its length past the end,
    a checksum that fails with nothing after it, or zeros where the file grew before its bytes landed): no
    damage, so the start still trusts the snapshot and journals, even when a later journal follows; the block
    whose add was torn is read from its file."""
    crash, t, new = await _a_block_written_again_at_a_crash(tmp_path, another_first=True)
    path = _newest_journal(crash / "index")
    data = path.read_bytes()
    entries = parse_entries(data)[0]
    last = JOURNAL_HEAD_LEN + sum(13 + len(body) for _, body in entries[:-1])  # the new add
    torn = {"in-its-head": data[: last + 3], "in-its-body": data[: last + 40],
            "checksum-at-the-end": data[:-1] + bytes([data[-1] ^ 0x40]),
            "zeros": data[:last] + bytes(len(data) - last + 100)}[tear]
    path.write_bytes(torn)
    _a_later_journal_opened(crash / "index")
    store = await make_store(crash, dram_blocks=64)
    nvme = store.tiers[1]
    key = store.lookup(NS, SPEC.fingerprint, t).blocks[0].key
    assert nvme.unverified == set(nvme.keys()) - {key} and len(nvme) == 8  # type: ignore[attr-defined]
    assert not any("is not trusted" in r.getMessage() for r in caplog.records)
    await _every_block_served_right(store, t, new)
    await store.close()


def _to_version_1(index: Path) -> None:
    """Version 1 (earlier releases): the same head without its checksum (24 bytes)."""
    for path in index.iterdir():
        data = path.read_bytes()
        if struct.unpack_from("<H", data, 8) == (2,):
            path.write_bytes(data[:8] + struct.pack("<H", 1) + data[10:24] + data[32:])


async def test_a_snapshot_and_journals_with_the_version_1_head_of_earlier_releases_still_load(tmp_path: Path) -> None:
    crash, t, new = await _a_block_written_again_at_a_crash(tmp_path)
    _to_version_1(crash / "index")
    store = await make_store(crash, dram_blocks=64)
    nvme = store.tiers[1]
    assert nvme.unverified == set(nvme.keys()) and len(nvme) == 7  # type: ignore[attr-defined]  # all trusted
    n, got = await get_seq(store, t)  # its header from the version 1 journal, not the version 1 snapshot
    assert n == len(t) and got is not None and torch.equal(got, new)
    await settle(store)
    assert (await store.check(fix=False)).ok
    await store.close()


async def test_a_version_1_snapshot_read_at_start_is_removed_before_a_version_2_journal_records_a_rewrite(
        tmp_path: Path) -> None:
    """Roll-back safety: an earlier release reads a version-1 snapshot but skips version-2 journals, so a
    version-1 snapshot left beside a version-2 journal recording a block's remove and new add made a roll-back
    after a crash trust the old header and drop the acknowledged block (reproduced with fffc273's daemon). The
    new daemon deletes such a snapshot once read: the earlier release then reads every block file."""
    root = tmp_path / "nvme"
    t = tokens(BLOCK_TOKENS, seed=9)
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    [key] = await put_seq(store, t, random_kv(SPEC, len(t), seed=1))
    await store.close()
    for path in (root / "index").iterdir():  # the directory as an earlier release left it
        data = path.read_bytes()
        path.write_bytes(data[:8] + struct.pack("<H", 1) + data[10:24] + data[32:])
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    assert store.tiers[1].unverified == {key}  # type: ignore[attr-defined]  # the version-1 snapshot was read
    meta = store.index.get(key)
    assert meta is not None
    await store.placement.delete_block(meta)
    new = random_kv(SPEC, len(t), seed=2)
    assert await put_seq(store, t, new) == [key]
    heads = {p.name: struct.unpack_from("<H", p.read_bytes(), 8)[0] for p in (root / "index").iterdir()}
    assert heads.get("snapshot", 2) == 2, heads  # none, or one this release wrote
    await store.close()
    store = await make_store(root, dram_blocks=64)
    n, got = await get_seq(store, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    await store.close()


@pytest.mark.parametrize("offset", [16, 23], ids=["generation-low-byte", "generation-high-byte"])
async def test_a_version_1_snapshot_whose_generation_names_no_journal_is_not_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, offset: int) -> None:
    """A version 1 snapshot (earlier releases: no head checksum) with a flipped generation was trusted: the
    journal since looked older and was skipped, the rewritten block's old header trusted, and the block dropped
    at its first read. A snapshot is written just after the journal of its generation is created, which outlives
    it (journal.py): one whose generation names no journal file is not trusted, and the start reads every file."""
    crash, t, new = await _a_block_written_again_at_a_crash(tmp_path)
    _to_version_1(crash / "index")
    snapshot = crash / "index" / "snapshot"
    _flip(snapshot, offset, 0xFF)
    store = await make_store(crash, dram_blocks=64)
    n, got = await get_seq(store, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    assert not store.tiers[1].unverified  # type: ignore[attr-defined]  # every file read, none trusted
    assert any(f"{snapshot} is not trusted" in r.getMessage() and "names no journal" in r.getMessage()
               for r in caplog.records)
    assert (await store.check(fix=False)).ok
    await store.close()


@pytest.mark.parametrize("version", [1, 2])
async def test_a_snapshot_whose_journal_a_power_loss_left_empty_is_still_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, version: int) -> None:
    # The journal a snapshot names is created just before it, its head not synced: still a true snapshot.
    crash, t, new = await _a_block_written_again_at_a_crash(tmp_path)
    if version == 1:
        _to_version_1(crash / "index")
    gen = struct.unpack_from("<Q", (crash / "index" / "snapshot").read_bytes(), 16)[0]
    (crash / "index" / f"journal.{gen}").write_bytes(b"")
    store = await make_store(crash, dram_blocks=64)
    nvme = store.tiers[1]
    assert nvme.unverified == set(nvme.keys()) and len(nvme) == 7  # type: ignore[attr-defined]  # all trusted
    assert not any("is not trusted" in r.getMessage() for r in caplog.records)
    n, got = await get_seq(store, t)
    assert n == len(t) and got is not None and torch.equal(got, new)
    await settle(store)
    assert (await store.check(fix=False)).ok
    await store.close()


async def test_journals_left_by_restarts_after_crashes_are_compacted_at_a_start(tmp_path: Path) -> None:
    """Every start opens a journal generation, and a start that trusts the journal wrote no snapshot: after
    each crash (a copy of the directory as a SIGKILL leaves it) one more journal file stayed, without bound (an
    audit counted 13 after 14 kill-restarts). A start finding more than MAX_JOURNALS writes a snapshot."""
    from engram.tiers.nvme import MAX_JOURNALS

    root = tmp_path / "run0"
    seqs = []
    for i in range(MAX_JOURNALS + 6):
        store = await make_store(root, dram_blocks=64, write_policy="write-through")
        seqs.append(tokens(BLOCK_TOKENS, seed=100 + i))
        await put_seq(store, seqs[-1], random_kv(SPEC, BLOCK_TOKENS, seed=i))
        await settle(store)
        crash = tmp_path / f"run{i + 1}"
        shutil.copytree(root, crash, ignore=shutil.ignore_patterns("engram.lock"))
        await store.close()
        root = crash
    store = await make_store(root, dram_blocks=64)
    await settle(store)
    assert len(list((root / "index").glob("journal.*"))) <= MAX_JOURNALS + 1
    for i, t in enumerate(seqs):  # and nothing acknowledged lost on the way
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, random_kv(SPEC, BLOCK_TOKENS, seed=i))
    await store.close()


async def test_a_snapshot_that_cannot_be_written_piles_up_no_journals_and_is_written_once_it_can(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A snapshot the tier cannot publish (a directory at index/snapshot): every change rotated a new journal
    for another failed try and logged it (an audit counted 106 journal files after 33 puts and gets). A failed
    snapshot is tried again after a back-off, in the generation it opened; once the obstacle is gone it is
    written, the journals before it go, and a crash at any point loses no acknowledged block."""
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=1)
    index = tmp_path / "index"
    (index / "snapshot").unlink()
    (index / "snapshot").mkdir()
    store = await make_store(tmp_path, dram_blocks=128, nvme_blocks=128, write_policy="write-through")

    async def put_one() -> None:
        seqs.append(tokens(BLOCK_TOKENS, seed=300 + len(seqs)))
        kvs.append(random_kv(SPEC, BLOCK_TOKENS, seed=len(seqs)))
        await put_seq(store, seqs[-1], kvs[-1])

    async def every_block_after_a_crash(crash: Path) -> set[bytes]:
        shutil.copytree(tmp_path, crash, ignore=shutil.ignore_patterns("engram.lock"))
        recovered = await make_store(crash, dram_blocks=128, nvme_blocks=128)
        trusted = set(recovered.tiers[1].unverified)  # type: ignore[attr-defined]  # (before reads verify them)
        for t, kv in zip(seqs, kvs, strict=True):
            n, got = await get_seq(recovered, t)
            assert n == len(t) and got is not None and torch.equal(got, kv)
        await recovered.close()
        return trusted

    for _ in range(50):
        await put_one()
        assert len(list(index.glob("journal.*"))) <= 3
    failures = [r for r in caplog.records if "could not write a snapshot" in r.getMessage()]
    assert 1 <= len(failures) <= 8  # once per back-off (1 s, doubling), not once per write
    assert await every_block_after_a_crash(tmp_path / "crash1") == set()  # no snapshot: every file read
    (index / "snapshot").rmdir()
    for _ in range(600):  # the next change past the back-off writes it
        await asyncio.sleep(0.1)
        await put_one()
        if (index / "snapshot").is_file():
            break
    assert (index / "snapshot").is_file()
    await asyncio.sleep(0.2)  # its journals removed just after it was published
    snapshot_gen = struct.unpack_from("<Q", (index / "snapshot").read_bytes(), 16)[0]
    assert sorted(int(p.name.split(".")[1]) for p in index.glob("journal.*")) == [snapshot_gen]
    nvme_keys = set(store.tiers[1].keys())  # type: ignore[attr-defined]
    assert await every_block_after_a_crash(tmp_path / "crash2") == nvme_keys  # trusted from the journal
    await store.close()


def test_registering_a_model_on_a_full_disk_is_storage_full_and_leaves_nothing(tmp_path: Path) -> None:
    """RegisterModel writes the model's file first: on a full disk (a real tmpfs) that failed INTERNAL with a
    traceback in the log, its temp file left behind (an audit). Now StorageFull (RESOURCE_EXHAUSTED), nothing
    left, and the same call works once there is room."""
    from engram.registry import ModelRegistry

    with small_tmpfs(tmp_path / "small", "64k") as mnt:
        registry = ModelRegistry(mnt / "models")
        filler = _fill_until_full(mnt)
        with pytest.raises(errors.StorageFull, match="the disk is full"):
            registry.register(SPEC)
        assert list((mnt / "models").iterdir()) == []
        filler.unlink()
        fp = registry.register(SPEC)
        assert ModelRegistry(mnt / "models").get(fp) == registry.get(fp)  # persisted


async def test_io_error_on_one_block_fails_that_block_only(tmp_path: Path) -> None:
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=2)
    store = await make_store(tmp_path, dram_blocks=1)
    bad = store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks[0].key
    bad_path = store.tiers[1].path_of(bad)  # type: ignore[attr-defined]

    def hook(op: str, path: Path) -> None:
        if op == "read" and path == bad_path:
            raise OSError(errno.EIO, "Input/output error")

    store.tiers[1].fault_hook = hook  # type: ignore[attr-defined]
    with pytest.raises(errors.DataLoss):
        await get_seq(store, seqs[0])
    assert store.counters.tiers["nvme"].io_errors == 1
    n, got = await get_seq(store, seqs[1])
    assert n == len(seqs[1]) and got is not None and torch.equal(got, kvs[1])
    await store.close()


async def test_a_block_leased_while_it_is_demoted_keeps_its_pool_copy(tmp_path: Path) -> None:
    """A victim is being copied down to NVMe when a reader leases it and reads its pool slot in place (a data
    channel Get's view): the copy above stays until the read ends, so the slot is not freed and reused for
    the block whose put made the room (the reader would send that block's bytes)."""
    store = await make_store(tmp_path / "nvme", dram_blocks=4, eviction="lru", **{"dram.pool": "shared"})
    pool = store.tiers[0]
    seqs = [tokens(BLOCK_TOKENS, seed=s) for s in range(5)]
    kvs = [random_kv(SPEC, BLOCK_TOKENS, seed=s) for s in range(5)]
    for t, kv in zip(seqs[:4], kvs[:4], strict=True):
        await put_seq(store, t, kv)
    gate, stuck = threading.Event(), threading.Event()

    def slow(op: str, path: Path) -> None:
        if op == "write":
            stuck.set()
            gate.wait(30)

    store.tiers[1].fault_hook = slow  # type: ignore[attr-defined]
    try:
        put = asyncio.create_task(put_seq(store, seqs[4], kvs[4]))  # demotes the least recently used block
        await asyncio.to_thread(stuck.wait, 30)
        [victim] = [m for m in store.index if m.moving]
        store.acquire([victim])  # a reader, mid-demotion
        view = pool.view(victim.key)
        assert view is not None
        before = bytes(view)
    finally:
        gate.set()
    await put
    assert victim.locations == ["dram", "nvme"] and pool.view(victim.key) is not None
    assert bytes(view) == before  # the slot the reader sends from still holds its block
    store.release([victim])
    n, got = await get_seq(store, seqs[4])
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, kvs[4])
    await store.close()


async def test_promotion_and_demotion_under_concurrent_load(tmp_path: Path) -> None:
    store = await make_store(tmp_path, dram_blocks=6, nvme_blocks=200)
    seqs = [tokens(3 * BLOCK_TOKENS + (s % 4), seed=s) for s in range(16)]
    kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]

    async def worker(w: int) -> int:
        rng = random.Random(w)
        checked = 0
        for _ in range(40):
            i = rng.randrange(len(seqs))
            if rng.random() < 0.5:
                # A parent evicted mid-chain by another worker is FailedPrecondition: a client retries whole.
                with contextlib.suppress(errors.FailedPrecondition):
                    await put_seq(store, seqs[i], kvs[i])
            else:
                n, got = await get_seq(store, seqs[i])
                if got is not None:
                    assert torch.equal(got, kvs[i][:, :, :n])
                    checked += 1
        return checked

    checked = await asyncio.gather(*(worker(w) for w in range(8)))
    assert sum(checked) > 0
    for t, kv in zip(seqs, kvs, strict=True):
        await put_seq(store, t, kv)
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    c = store.counters.tiers
    assert c["dram"].demotions > 0 and c["dram"].promotions > 0
    assert store.tiers[0].used_bytes <= 6 * BLOCK
    assert (await store.check(fix=False)).ok
    await store.close()


async def test_daemon_with_nvme_over_grpc(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.dram.capacity": 3 * BLOCK, "tiers.nvme.path": str(tmp_path / "nvme")})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        seqs = [tokens(2 * BLOCK_TOKENS, seed=s) for s in range(4)]
        kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
        for t, kv in zip(seqs, kvs, strict=True):
            await client.put(fp, t, kv)
        for t, kv in zip(seqs, kvs, strict=True):
            n, got = await client.get_prefix(fp, t)
            assert n == len(t) and got is not None and torch.equal(got, kv)
        stats = await client.stats()
        names = [t.name for t in stats.tiers]
        assert names == ["dram", "nvme"] and stats.tiers[1].state == "ok" and stats.tiers[0].demotions > 0
        check = await client.check()
        assert check.scanned >= 8 and not check.findings


async def test_pinned_blocks_that_fill_dram_move_down_keeping_their_pins(server_factory,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    """One tenant pinned its blocks until DRAM was full, and every other tenant's put failed RESOURCE_EXHAUSTED
    while NVMe had room (an audit): a pin keeps a block stored, not in DRAM. Unpinned blocks still go down first."""
    srv = await server_factory(**{"tiers.dram.capacity": 4 * BLOCK, "tiers.nvme.path": str(tmp_path / "nvme")})
    async with EngramClient(srv.address, namespace="pins") as a, EngramClient(srv.address, namespace="other") as b:
        fp = await a.register_model(SPEC)
        await b.register_model(SPEC)
        plain = tokens(BLOCK_TOKENS, seed=9)
        await a.put(fp, plain, random_kv(SPEC, len(plain), seed=9))  # unpinned: the first to move down
        pinned = tokens(4 * BLOCK_TOKENS, seed=1)
        kv = random_kv(SPEC, len(pinned), seed=1)
        keys = list((await a.put(fp, pinned, kv, pin=True)).keys)
        assert {x.tier for x in (await a.lookup(fp, plain)).blocks} == {"nvme"}
        assert {x.tier for x in (await a.lookup(fp, pinned)).blocks} == {"dram"}  # DRAM holds pinned blocks only
        for seed in (2, 3):  # another tenant's puts: before, "every block in it is pinned"
            t = tokens(2 * BLOCK_TOKENS, seed=seed)
            await b.put(fp, t, random_kv(SPEC, len(t), seed=seed))
        tiers = [x.tier for x in (await a.lookup(fp, pinned)).blocks]
        assert len(tiers) == 4 and tiers[0] == "nvme"  # the least recently used pinned block moved down first
        assert [d.pins for d in (await a.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks] == [1] * 4
        n, got = await a.get_prefix(fp, pinned)
        assert n == len(pinned) and got is not None and torch.equal(got, kv)
        with pytest.raises(errors.FailedPrecondition, match="pinned"):  # still pinned: refused without force
            await a.evict(key_prefixes=[keys[0].hex()])


@pytest.mark.parametrize("journal", [True, False])
async def test_a_directory_named_as_a_block_file_is_reported_and_left_alone(tmp_path: Path, journal: bool) -> None:
    """A directory where a block file of a valid name could be (an operator's copy, a mount): it was taken for a
    block file, "unreadable", and its unlink raised: `check --fix` and the online Check died (INTERNAL), and a
    start without the journal failed. It is a stray entry, reported, never removed, and the blocks load."""
    seqs, kvs = await _store_on_disk(tmp_path, n_seqs=1)
    store = await make_store(tmp_path)
    odd = store.tiers[1].path_of(bytes(range(16)))  # type: ignore[attr-defined]
    await store.close()
    odd.parent.mkdir(parents=True, exist_ok=True)
    odd.mkdir()
    (odd / "inside").write_text("someone's file")
    if not journal:
        shutil.rmtree(tmp_path / "index")
    store = await make_store(tmp_path, dram_blocks=64)
    n, got = await get_seq(store, seqs[0])
    assert n == len(seqs[0]) and got is not None and torch.equal(got, kvs[0])
    report = await store.check(fix=True)
    assert report.findings == [(str(odd), "stray entry (not a block file)", False)]
    assert (odd / "inside").read_text() == "someone's file"
    await store.close()


async def test_a_block_left_unreachable_while_it_was_read_is_dropped_by_the_next_check(tmp_path: Path) -> None:
    """A block that extends a dropped one but was being read at the drop stays indexed (reported, "left until a
    restart"); no later `check --fix` dropped it either, since nothing it extended was found broken again (CI
    saw it too: the background check of trusted files and `check --fix` dropped one block at once, one of
    them while the other read a descendant). A check with fix now drops every block a lookup cannot reach."""
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    toks = tokens(4 * BLOCK_TOKENS, seed=42)
    await put_seq(store, toks, random_kv(SPEC, len(toks), seed=42))
    chain = store.lookup(NS, SPEC.fingerprint, toks).blocks
    await store.placement.drop_copy(chain[1], "dram")  # its only copy now the file, then corrupt there
    _flip(store.tiers[1].path_of(chain[1].key), -5)  # type: ignore[attr-defined]
    store.acquire([chain[3]])  # being read
    report = await store.check(fix=True)
    assert [m.key for m in chain if m.key in store.index] == [chain[0].key, chain[2].key, chain[3].key]
    assert (chain[3].key.hex(), "unreachable: a block it extends was dropped (being read: left until a restart)",
            False) in report.findings
    store.release([chain[3]])
    report = await store.check(fix=True)
    assert [m.key for m in chain if m.key in store.index] == [chain[0].key]
    assert report.findings == [(m.key.hex(), "unreachable: a block it extends was dropped", True)
                               for m in (chain[3], chain[2])]
    assert len(block_files(tmp_path)) == 1
    await store.close()


async def test_an_online_check_that_drops_a_block_drops_what_extends_it(tmp_path: Path) -> None:
    """`check --fix` drops a middle block whose file is corrupt: the blocks that extend it can no longer be
    reached (a lookup stops at the dropped one), so they go too, files and all, and are reported; before, they
    stayed indexed (counted by ls and stats, `show` printing wrong start tokens) until a restart dropped them."""
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    toks = tokens(4 * BLOCK_TOKENS, seed=41)
    kv = random_kv(SPEC, len(toks), seed=41)
    await put_seq(store, toks, kv)
    await store.close()
    seqs, kvs = [toks], [kv]
    store = await make_store(tmp_path, dram_blocks=1)
    await settle(store)  # the background check of trusted files is done: the report is the check's alone
    chain = [m.key for m in store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks]
    assert len(chain) == 4
    _flip(store.tiers[1].path_of(chain[1]), -5)  # type: ignore[attr-defined]
    report = await store.check(fix=True)
    assert [k for k in chain if k in store.index] == chain[:1]
    unreachable = {k for k, problem, fixed in report.findings if problem.startswith("unreachable") and fixed}
    assert unreachable == {k.hex() for k in chain[2:]}
    assert len(block_files(tmp_path)) == 1
    assert (await store.check(fix=False)).ok
    n, got = await get_seq(store, seqs[0])
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, kvs[0][:, :, :BLOCK_TOKENS])
    await store.close()


async def test_a_read_that_finds_a_blocks_last_copy_corrupt_drops_what_extends_it(tmp_path: Path) -> None:
    """A read drops a block whose every copy fails its checksum; the blocks that extend it go with it (no lookup
    could reach them), unless a reader holds them: those are left to a restart."""
    store = await make_store(tmp_path, dram_blocks=64, write_policy="write-through")
    toks = tokens(4 * BLOCK_TOKENS, seed=43)
    await put_seq(store, toks, random_kv(SPEC, len(toks), seed=43))
    await store.close()
    store = await make_store(tmp_path, dram_blocks=1)
    chain = list(store.lookup(NS, SPEC.fingerprint, toks).blocks)
    await settle(store)
    _flip(store.tiers[1].path_of(chain[1].key), -5)  # type: ignore[attr-defined]
    with pytest.raises(errors.DataLoss, match="no tier holds a valid copy"):
        await store.read(chain[1])
    assert [m.key in store.index for m in chain] == [True, False, False, False]
    assert len(block_files(tmp_path)) == 1
    await store.close()


# ---- version skew: files of a newer Engram, and block files an earlier one wrote again (docs/FORMAT.md) ----


def _as_a_newer_engram_wrote_it(path: Path, version: int = 2) -> bytes:
    """A block file of a later format version, otherwise the same bytes with a valid meta checksum (no such
    release exists yet: /work/scratch/s44/upgrade/future_version.py simulated it so too). Returns its header."""
    import xxhash

    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 8, version)
    (meta_len,) = struct.unpack_from("<I", data, 12)
    struct.pack_into("<Q", data, 40, xxhash.xxh3_64_intdigest(bytes(data[:40]) + bytes(data[48 : 48 + meta_len])))
    path.write_bytes(bytes(data))
    return bytes(data[: 48 + meta_len])


def _index_file_of_version(path: Path, version: int) -> None:
    import xxhash

    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 8, version)
    struct.pack_into("<Q", data, 24, xxhash.xxh3_64_intdigest(bytes(data[:24])))
    path.write_bytes(bytes(data))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under the directory and its bytes (the lock file aside: each opener writes its pid)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "engram.lock"}


async def _a_directory_a_newer_engram_wrote_in(root: Path, where: str) -> Path:
    """Blocks on disk, one of them (seq 0's second) then written by a newer Engram, recorded as `where` says; a
    torn temp file and a stray file beside it, which a start of this build would remove."""
    seqs, _ = await _store_on_disk(root)
    store = await make_store(root, dram_blocks=64)
    path: Path = store.tiers[1].path_of(store.lookup(NS, SPEC.fingerprint, seqs[0]).blocks[1].key)  # type: ignore[attr-defined]
    await store.close()
    if where != "snapshot version" and where != "journal version":
        header = _as_a_newer_engram_wrote_it(path)
    if where == "no journal":
        shutil.rmtree(root / "index")
    elif where == "journal entry":  # the newer build's journal records the header it wrote
        with open(_newest_journal(root / "index"), "ab") as fh:
            fh.write(encode_entry(1, header))
    elif where == "snapshot version":
        _index_file_of_version(root / "index" / "snapshot", 3)
    elif where == "journal version":
        _index_file_of_version(_newest_journal(root / "index"), 3)
    (root / "tmp" / "abc.1234.tmp").write_bytes(b"half a block")
    (root / "blocks" / "notes.txt").write_text("stray")
    return path


@pytest.mark.parametrize("where", ["no journal", "journal entry", "snapshot version", "journal version"])
async def test_a_directory_holding_a_newer_engrams_files_is_refused_at_start_and_left_as_it_is(
        tmp_path: Path, where: str) -> None:
    """A block file (or index snapshot, or journal) of a later format version is a newer Engram's, not damage:
    a start deleted such block files as broken, one WARNING each ('N problems fixed'), and a user who tried a
    newer build and rolled back lost every block it wrote (an audit, session 44). Now the start refuses the
    directory, naming the file and both versions, and changes nothing in it: not even the torn temp file and
    stray file a start would otherwise remove."""
    root = tmp_path / "nvme"
    await _a_directory_a_newer_engram_wrote_in(root, where)
    before = _tree(root)
    with pytest.raises(errors.NewerFormat, match=r"written by a newer Engram; .*start that version, or move the "
                                                 r"directory away"):
        await make_store(root, dram_blocks=64)
    assert _tree(root) == before
    offline = NvmeTier(root, 1 << 40)  # the refused start let the directory go
    report = await offline.check(fix=True)  # an offline check --fix reports, and fixes nothing
    await offline.close()
    assert _tree(root) == before
    assert not any(f.fixed for f in report.findings)
    assert any("written by a newer Engram; left as it is" in f.problem for f in report.findings), report.findings


def test_engram_serve_on_a_newer_engrams_directory_exits_9_naming_the_file(tmp_path: Path) -> None:
    """`engram serve` on it: one line, exit 9 (a file it cannot use), the file, both versions and what to do."""
    root = tmp_path / "nvme"
    path = asyncio.run(_a_directory_a_newer_engram_wrote_in(root, "no journal"))
    before = _tree(root)
    shm = tmp_path / "shm"
    shm.mkdir()
    out = subprocess.run([*ENGRAM, "serve", "--port", "0", "--dram-capacity", "64MiB", "--set",
                          f"tiers.dram.shm_dir={shm}", "--set", f"tiers.nvme.path={root}"],
                         capture_output=True, text=True, timeout=120, cwd=NEUTRAL_CWD)
    assert out.returncode == 9, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot start: {path.name}: block file format version 2, this Engram reads "
                           "version 1 at most: written by a newer Engram; start that version, or move the directory "
                           f"away (tiers.nvme.path {root}; nothing in it was changed)"), out.stderr
    assert "Traceback" not in out.stderr and list(shm.iterdir()) == []
    assert _tree(root) == before


@pytest.mark.parametrize("found_by", ["a read", "the check of trusted files", "check --fix"])
async def test_a_newer_engrams_block_file_behind_a_stale_journal_record_is_never_served_nor_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found_by: str) -> None:
    """The journal still records the block's old header, so the start trusts the file without reading it; a read
    or the background check of trusted files then finds a newer Engram's file. It was deleted as damaged; now it
    is left on disk (never served, nor written over) and counted in the tier's bytes, an online check --fix
    leaves it too, and the next start, which reads it (the snapshot no longer records it), refuses the
    directory."""
    root = tmp_path / "nvme"
    seqs, kvs, victim, path = await _second_block_on_disk(root)
    _as_a_newer_engram_wrote_it(path)
    newer = path.read_bytes()
    read_first = asyncio.Event()
    if found_by != "the check of trusted files":  # the background check waits: the read or check --fix comes first
        verify_trusted = NvmeTier.verify_trusted

        async def after_the_read(tier: NvmeTier) -> list[tuple[bytes, str | errors.DataLoss]]:
            await read_first.wait()
            return await verify_trusted(tier)

        monkeypatch.setattr(NvmeTier, "verify_trusted", after_the_read)
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    if found_by == "a read":
        with pytest.raises(errors.DataLoss, match="written by a newer Engram"):
            await get_seq(store, seqs[0])
    elif found_by == "check --fix":
        assert [f[2] for f in (await store.check(fix=True)).findings if f[0] == str(path)] == [False]
    read_first.set()
    await settle(store)
    n, got = await get_seq(store, seqs[0])
    assert n == BLOCK_TOKENS and got is not None and torch.equal(got, kvs[0][:, :, :BLOCK_TOKENS])
    for t, kv in zip(seqs[1:], kvs[1:], strict=True):
        n, got = await get_seq(store, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)
    report = await store.check(fix=True)
    assert [(f[1], f[2]) for f in report.findings if f[0] == str(path)] == [
        ("block file format version 2, this Engram reads version 1 at most: written by a newer Engram; left as it "
         "is", False)]
    assert store.tiers[1].used_bytes == sum(p.stat().st_size for p in block_files(root))  # its bytes counted
    with pytest.raises(errors.Unavailable, match="written by a newer Engram"):  # never renamed over
        await put_seq(store, seqs[0], kvs[0])
    await store.close()
    assert path.read_bytes() == newer
    before = _tree(root)
    with pytest.raises(errors.NewerFormat, match=path.name):
        await make_store(root, dram_blocks=64)
    assert _tree(root) == before


async def test_a_key_whose_newer_file_was_set_aside_does_not_hold_up_the_write_back_flusher(tmp_path: Path,
                                                                                         monkeypatch: pytest.MonkeyPatch
                                                                                         ) -> None:
    """Write-back: a newer Engram's file is set aside at its first read, and its key put again: that block cannot be
    written to NVMe (never renamed over the newer file), so it stays pending. It headed the flusher's queue, which
    retried it for ever: every block put after it, by anyone, stayed in memory only, past the loss window, until
    the window's byte bound refused every put (an audit of session 44's changes). The others are flushed now."""
    root = tmp_path / "nvme"
    seqs, kvs, victim, path = await _second_block_on_disk(root)
    _as_a_newer_engram_wrote_it(path)
    read_first = asyncio.Event()
    verify_trusted = NvmeTier.verify_trusted

    async def after_the_read(tier: NvmeTier) -> list[tuple[bytes, str | errors.DataLoss]]:
        await read_first.wait()
        return await verify_trusted(tier)

    monkeypatch.setattr(NvmeTier, "verify_trusted", after_the_read)
    store = await make_store(root, dram_blocks=64, write_policy="write-back", write_back_window_s=0.1)
    try:
        with pytest.raises(errors.DataLoss, match="written by a newer Engram"):
            await get_seq(store, seqs[0])
        read_first.set()
        await put_seq(store, seqs[0], kvs[0])  # the set-aside key again: in DRAM, pending
        meta = store.index.get(victim)
        assert meta is not None and "nvme" not in meta.locations
        later = [tokens(2 * BLOCK_TOKENS, seed=50 + i) for i in range(3)]
        keys = [k for t in later for k in await put_seq(store, t, random_kv(SPEC, len(t), seed=50))]
        for _ in range(200):
            if all("nvme" in store.index.get(k).locations for k in keys):  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.05)
        assert [store.index.get(k).locations for k in keys] == [["dram", "nvme"]] * len(keys)  # type: ignore[union-attr]
        assert "nvme" not in meta.locations and store.write_back_pending().blocks == 1
        # A crash now (the directory as it is, no final snapshot): the next start refuses it, as the log says,
        # where it trusted the set-aside file's old journal record and served on.
        image = tmp_path / "crashed"
        shutil.copytree(root, image, ignore=shutil.ignore_patterns("engram.lock"))
        with pytest.raises(errors.NewerFormat, match=path.name):
            await make_store(image, dram_blocks=64)
    finally:
        await store.close()


def _written_again_by_an_earlier_build(path: Path, kv: torch.Tensor) -> None:
    """What a build from before the journal did when it stored a block again under its key (another prefill of
    the same tokens): a whole, valid file of other bytes, renamed over the old one, its journal not told."""
    from engram.tiers.blockfile import decode_header
    from engram.tiers.blockfile import encode as encode_file

    rec, _ = decode_header(path.read_bytes(), path.name)
    payload = encode(kv, RAW)
    header, stored = encode_file(rec._replace(checksum=checksum(payload)), payload, compress=False)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(header + bytes(stored))
    tmp.replace(path)


@pytest.mark.parametrize("found_by", ["a read", "the check of trusted files"])
async def test_a_block_file_an_earlier_build_wrote_again_under_a_stale_journal_record_is_served_from_the_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, found_by: str) -> None:
    """A block written again by an earlier build (one from before the journal: /work/scratch/s44/upgrade/
    rewrite.py) under its key with other bytes: the journal's record of it is stale. The first read dropped the
    block and its chain (DATA_LOSS, nothing logged). The file names the same block (key, parent, tokens,
    model) and verifies against its own header: another prefill of the same prefix, which that build
    acknowledged. It is now re-indexed from the file, served, logged, and journaled, so the next start trusts
    the file's header."""
    root = tmp_path / "nvme"
    seqs, kvs, victim, path = await _second_block_on_disk(root)
    other = random_kv(SPEC, len(seqs[0]), seed=77)
    _written_again_by_an_earlier_build(path, other[:, :, BLOCK_TOKENS:])
    want = torch.cat([kvs[0][:, :, :BLOCK_TOKENS], other[:, :, BLOCK_TOKENS:]], dim=2)
    store = await make_store(root, dram_blocks=64)
    if found_by == "the check of trusted files":
        await settle(store)
    n, got = await get_seq(store, seqs[0])
    assert n == len(seqs[0]) and got is not None and torch.equal(got, want)
    await settle(store)
    assert (await store.check(fix=False)).ok
    assert store.counters.corrupt_blocks == 0
    stale = [r for r in caplog.records if r.levelname == "WARNING" and victim.hex() in r.getMessage()]
    assert len(stale) == 1 and "stale" in stale[0].getMessage() and "nvme" in stale[0].getMessage(), stale
    await store.close()
    caplog.clear()
    store = await make_store(root, dram_blocks=64)  # the file's header is the journal's record now
    await settle(store)
    n, got = await get_seq(store, seqs[0])
    assert n == len(seqs[0]) and got is not None and torch.equal(got, want)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    await store.close()


async def test_a_copy_dropped_as_damaged_on_a_read_is_logged_with_its_key_tier_and_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A read that finds a block's last copy corrupt drops it and the blocks that extend it, and answers
    DATA_LOSS; the daemon's log said nothing of it (an audit, session 44). Now one WARNING names the block, the
    tier, why, and that the block left the store."""
    seqs, _, victim, path = await _second_block_on_disk(tmp_path)
    _flip(path, path.stat().st_size - 100)
    store = await make_store(tmp_path, dram_blocks=64)
    with pytest.raises(errors.DataLoss):
        await get_seq(store, seqs[0])
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and victim.hex() in r.getMessage()]
    assert len(lines) == 1, lines
    assert "its nvme copy was dropped on a read" in lines[0] and "checksum" in lines[0], lines
    assert "the block left the store" in lines[0], lines
    await store.close()


def _without_pins(index_dir: Path) -> None:
    """The index files as a build from before pins were journaled wrote them: the same, less the pins entries."""
    for path in index_dir.iterdir():
        data = path.read_bytes()
        entries, end = parse_entries(data)
        assert end == len(data)
        path.write_bytes(data[:JOURNAL_HEAD_LEN] + b"".join(encode_entry(k, b) for k, b in entries if k != PINS))


async def test_pins_come_back_from_the_journal_and_the_snapshot_and_index_files_without_pins_still_load(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, crash = tmp_path / "nvme", tmp_path / "crash"
    store = await make_store(root, dram_blocks=64, write_policy="write-through")
    fp = SPEC.fingerprint
    chains = [tokens(3 * BLOCK_TOKENS, seed=s) for s in range(4)]
    pinned = await put_seq(store, chains[0], random_kv(SPEC, len(chains[0])), pin=True)
    held = await put_seq(store, chains[1], random_kv(SPEC, len(chains[1])))
    store.pin(NS, fp, held[-1:])
    store.pin(NS, fp, held[-1:])
    lifted = await put_seq(store, chains[2], random_kv(SPEC, len(chains[2])), pin=True)
    store.pin(NS, fp, lifted, unpin=True)
    evicted = await put_seq(store, chains[3], random_kv(SPEC, len(chains[3])), pin=True)
    for meta in reversed(store.find(NS, fp, evicted)):  # a forced evict: the blocks leave with their pins
        store.lift_pins(meta)
        await store.remove(meta)
    want = {**dict.fromkeys(pinned, 1), **dict.fromkeys(held, 0), held[-1]: 2, **dict.fromkeys(lifted, 0)}
    shutil.copytree(root, crash, ignore=shutil.ignore_patterns("engram.lock"))  # a SIGKILL's: journal, no snapshot
    await store.close()
    for where in (crash, root):  # the journal replayed; the snapshot of the stop read
        store = await make_store(where, dram_blocks=64)
        assert {m.key: m.pins for m in store.blocks(NS)} == want, where
        assert all(m.operator_pins == m.pins for m in store.blocks(NS))  # tenancy off: the operator's
        await store.close()
    _without_pins(crash / "index")
    caplog.clear()
    store = await make_store(crash, dram_blocks=64)
    assert {m.key: m.pins for m in store.blocks(NS)} == dict.fromkeys(want, 0)  # every block, none pinned
    assert store.tiers[1].unverified == set(want)  # type: ignore[attr-defined]  # trusted: the journal was read
    assert "not trusted" not in caplog.text
    await store.close()


def test_owned_pins_entries_load_torn_by_a_crash_they_are_a_torn_tail_and_whole_but_inconsistent_damage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each tenant pin's owner is journaled (an owned pins entry, kind 4) and in the snapshot, and comes back as
    recorded; a block of no owned pin keeps the pins entry of earlier builds. The last entry torn by a crash is
    left out (the journal still trusted); one whole, its checksum right, that says more owners' pins than tenant
    pins, with an entry after it, is damage: the start reads every block file."""
    snap, alice_bob, operators, torn = bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16, bytes([4]) * 16
    journal = IndexJournal(tmp_path, fsync=False)
    journal.open()
    journal.pins(snap, Pins(1, 0, (("alice", 1),)))
    gen = journal.rotate()
    assert gen is not None
    assert journal.write_snapshot([], gen, fsync=False, pins=[(snap, Pins(2, 1, (("alice", 1), ("bob", 1))))])
    journal.pins(alice_bob, Pins(4, 1, (("alice", 1), ("bøb", 2))))  # the rest: of no recorded owner
    journal.pins(operators, Pins(0, 2))
    journal.close()
    path = tmp_path / "index" / f"journal.{gen}"
    kinds = [kind for kind, _ in parse_entries(path.read_bytes())[0]]
    assert kinds == [OWNED_PINS, PINS]  # a block of no owned pin: byte for byte what an earlier build wrote
    want = {snap: Pins(2, 1, (("alice", 1), ("bob", 1))), alice_bob: Pins(4, 1, (("alice", 1), ("bøb", 2))),
            operators: Pins(0, 2)}
    loaded = IndexJournal(tmp_path, create=False).load()
    assert loaded is not None and loaded.pins == want and not loaded.torn_tail
    with open(path, "ab") as fh:  # a crash mid-append: the entry's first bytes only
        fh.write(encode_pins(torn, Pins(1, 0, (("carol", 1),)))[:20])
    loaded = IndexJournal(tmp_path, create=False).load()
    assert loaded is not None and loaded.pins == want and loaded.torn_tail
    data = path.read_bytes()
    inconsistent = encode_pins(torn, Pins(1, 0, (("carol", 2),)))  # 2 of carol's in 1 tenant pin
    path.write_bytes(data[: len(data) - 20] + inconsistent + encode_pins(operators, Pins(0, 0)))
    caplog.clear()
    assert IndexJournal(tmp_path, create=False).load() is None
    assert "is not trusted" in caplog.text and "pass its tenant pins" in caplog.text


async def test_a_write_cancelled_twice_while_its_batch_publishes_holds_its_key_until_its_file_is_unlinked(
        tmp_path: Path) -> None:
    """A write of key K is cancelled while its batch waits to publish (behind another key's batch, its directory
    sync held); it waits for that batch, then unlinks the file it published (no block's copy), and only then lets
    the next write of K go (one write of a key at a time). A second cancel during that wait (a handler cancelled
    again, a shutdown beside a client's cancel) ended the first write's turn at once: the next write of K rode in
    the same batch, its file renamed over the first's, and the first's unlink took it, the tier recording a file
    that was gone (its read: DataLoss, "missing"). A real tier, real files; the directory sync held as a disk
    would hold it."""
    tier = NvmeTier(tmp_path / "n", 1 << 30, journal=False)
    await tier.recover()
    committer = tier._committer  # type: ignore[attr-defined]
    entered, go = threading.Event(), threading.Event()
    sync_dir = committer._fsync_dir

    def held_sync(path: Path) -> None:  # (in the tier's I/O thread)
        if not entered.is_set():
            entered.set()
            go.wait(30)
        sync_dir(path)

    committer._fsync_dir = held_sync

    def record(key: bytes, payload: bytes) -> BlockRecord:
        return BlockRecord(key, b"p" * 16, b"f" * 16, "ns", DType.BF16, True, (len(payload) // 2,), b"\1\0\0\0",
                           len(payload), checksum(payload))

    async def write(key: bytes, payload: bytes) -> None:
        rec = record(key, payload)
        assert tier.reserve(tier.space_for(rec))
        await tier.write(rec, payload, tier.space_for(rec))

    other, key = b"o" * 16, b"k" * 16
    first, second = os.urandom(4096), os.urandom(4096)
    holding = asyncio.create_task(write(other, os.urandom(4096)))  # its batch's directory sync held
    writing = second_write = None
    try:
        assert await asyncio.to_thread(entered.wait, 30), "the other key's batch never synced its directory"
        writing = asyncio.create_task(write(key, first))
        for _ in range(3000):  # written and queued behind the held batch
            if committer._queue:
                break
            await asyncio.sleep(0.001)
        assert committer._queue, "the first write of K never reached its batch"
        writing.cancel()
        for _ in range(10):
            await asyncio.sleep(0)  # into its wait for the batch, to unlink the file it publishes
        writing.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        second_write = asyncio.create_task(write(key, second))  # K again: waits for the first write's turn to end
        for _ in range(300):  # (before the fix: written and queued in the same batch as the first)
            if len(committer._queue) > 1:
                break
            await asyncio.sleep(0.001)
    finally:
        go.set()
    await holding
    with pytest.raises(asyncio.CancelledError):
        await writing
    await second_write
    assert await tier.read(key) == second  # the second write's file, acknowledged: there
    await tier.close()
