"""The shared DRAM pool: real segments in /dev/shm, mapped by a reader as a worker would; budgets checked
before allocating; stale segments of a dead daemon removed at start; the segment unlinked on close."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engram.block import BlockRecord
from engram.errors import ConfigError, FailedPrecondition
from engram.layout import DType
from engram.segment import SegmentReader
from engram.tiers.base import Tier
from engram.tiers.dram import shared_dram_tier
from engram.tiers.pool import PoolTier
from engram.tiers.shm import PREFIX, SUFFIX, clean_stale


def copied(reader: SegmentReader, offset: int, length: int, generation: int) -> bytes | None:
    """What a worker gets through a descriptor: the bytes, or None for a stale one."""
    out = reader.copy(offset, length, generation)
    return None if out is None else bytes(out.numpy())


def record(key: bytes, nbytes: int) -> BlockRecord:
    return BlockRecord(key, b"p", b"fp", "ns", DType.BF16, True, (nbytes,), b"", nbytes, 0)


async def put(tier: PoolTier, key: bytes, payload: bytes) -> None:
    rec = record(key, len(payload))
    need = tier.space_for(rec)
    assert tier.reserve(need)
    await tier.write(rec, payload, need)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    # A private directory on the real /dev/shm when it exists (so other daemons' segments are untouched).
    base = Path("/dev/shm")
    d = base / f"engram-test-{os.getpid()}-{tmp_path.name}" if base.is_dir() else tmp_path
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


async def test_a_worker_maps_the_segment_and_reads_blocks_in_place(shm_dir: Path) -> None:
    tier = shared_dram_tier(64 * 1024, shm_dir, 4096, pin=False)
    assert isinstance(tier, Tier)
    payloads = {bytes([i]) * 8: os.urandom(5000 + i) for i in range(5)}
    for key, payload in payloads.items():
        await put(tier, key, payload)
    seg = tier.segment
    assert seg is not None and seg.path.parent == shm_dir and seg.path.exists()
    reader = SegmentReader(seg.path, seg.layout.segment_id)
    for key, payload in payloads.items():
        slot = tier.slot(key)
        assert copied(reader, slot.offset, slot.length, slot.generation) == payload
        assert await tier.read(key) == payload
    # Deleting a block and reusing its pages makes the old descriptor stale: never the new block's bytes.
    key = next(iter(payloads))
    old = tier.slot(key)
    await tier.delete(key)
    assert copied(reader, old.offset, old.length, old.generation) is None
    await put(tier, b"new-key!", os.urandom(old.length))
    assert tier.slot(b"new-key!").offset == old.offset  # best fit reused the same pages
    assert copied(reader, old.offset, old.length, old.generation) is None
    reader.close()
    await tier.close()
    assert not seg.path.exists(), "the segment was not unlinked on close"


async def test_a_worker_copies_a_block_out_on_its_own_thread_not_on_torchs_thread_team(shm_dir: Path) -> None:
    """A zero-copy Get's copy out of the pool is one memcpy on the calling thread (the client's event loop): torch's
    copy_ split it over its OpenMP team and waited for the slowest thread, which beside busy processes held the
    loop for the scheduler (benchmarks/RESULTS.md put_get, session 50). A fresh process copies 16 MiB, and no
    thread was started for it; the bytes are the block's, and a reused slot still gives None."""
    tier = shared_dram_tier(64 * 2**20, shm_dir, pin=False)
    payload = os.urandom(16 * 2**20)
    await put(tier, b"big-key!", payload)
    seg, slot = tier.segment, tier.slot(b"big-key!")
    assert seg is not None
    script = f"""
import hashlib, os, sys, torch
from engram.segment import SegmentReader
if torch.get_num_threads() < 2 or "OpenMP" not in torch.__config__.parallel_info():
    print("skip"); sys.exit()
reader = SegmentReader({str(seg.path)!r}, {seg.layout.segment_id!r})
before = len(os.listdir("/proc/self/task"))
out = reader.copy({slot.offset}, {slot.length}, {slot.generation})
print(len(os.listdir("/proc/self/task")) - before, hashlib.sha256(out.numpy()).hexdigest())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "skip":
        pytest.skip("torch runs its CPU ops on one thread here, or without OpenMP")
    import hashlib

    assert done.stdout.split() == ["0", hashlib.sha256(payload).hexdigest()]
    reader = SegmentReader(seg.path, seg.layout.segment_id)
    await tier.delete(b"big-key!")
    await put(tier, b"new-key!", os.urandom(slot.length))
    assert tier.slot(b"new-key!").offset == slot.offset
    assert reader.copy(slot.offset, slot.length, slot.generation) is None
    reader.close()
    await tier.close()


async def test_a_reader_refuses_a_segment_that_is_not_the_one_named(shm_dir: Path) -> None:
    tier = shared_dram_tier(16 * 1024, shm_dir, pin=False)
    assert tier.segment is not None
    with pytest.raises(FailedPrecondition, match="another segment"):
        SegmentReader(tier.segment.path, b"\0" * 16)
    junk = shm_dir / "junk"
    junk.write_bytes(b"x" * 100)
    with pytest.raises(FailedPrecondition, match="not an Engram segment"):
        SegmentReader(junk, b"\0" * 16)
    await tier.close()


def test_a_budget_beyond_the_host_is_refused_before_allocating(shm_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.dram\.capacity") as exc:
        shared_dram_tier(1 << 50, shm_dir, pin=False)  # a PiB: more than any /dev/shm or MemAvailable
    assert "lower tiers.dram.capacity" in str(exc.value)
    assert not list(shm_dir.glob(f"{PREFIX}*")), "a refused pool left a segment behind"


async def test_a_stale_segment_of_a_killed_daemon_is_removed_at_start(shm_dir: Path) -> None:
    # A real process creates a pool and is killed without closing it: its segment stays behind.
    code = (f"import os, sys; from engram.tiers.dram import shared_dram_tier; "
            f"t = shared_dram_tier(8192, {str(shm_dir)!r}, pin=False); print(t.segment.path, flush=True); "
            "os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    stale = Path(out.stdout.strip())
    assert stale.exists() and stale.name.endswith(SUFFIX)
    live = shared_dram_tier(8192, shm_dir, pin=False)  # cleans at start, and must not remove itself
    assert not stale.exists()
    assert live.segment is not None and live.segment.path.exists()
    assert clean_stale(shm_dir) == []  # a live daemon's segment (locked) is never removed
    await live.close()


async def test_a_segment_another_daemon_cleans_between_its_create_and_lock_is_made_again(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two daemons starting at once on one shm_dir: the second's clean_stale can find the first's segment after
    it was created and before it was locked (nobody holds it: a dead daemon's, it seems) and unlink it, and the
    first would serve a pool no worker can map. The window is a few instructions wide, so the second daemon's
    clean is run inside it: flock is wrapped to run the real clean_stale (its own open, flock and unlink) before
    the creator's first lock."""
    from engram.tiers import shm

    real_flock = shm.fcntl.flock
    cleaned: list[list[Path]] = []

    def flock_after_another_daemons_clean(fd: int, op: int) -> None:
        if not cleaned and op == shm.fcntl.LOCK_EX:
            cleaned.append(clean_stale(shm_dir))  # the other daemon, between this one's create and its lock
        real_flock(fd, op)

    monkeypatch.setattr(shm.fcntl, "flock", flock_after_another_daemons_clean)
    tier = shared_dram_tier(8192, shm_dir, pin=False)
    monkeypatch.setattr(shm.fcntl, "flock", real_flock)
    assert tier.segment is not None and cleaned[0] == [tier.segment.path]  # it was removed once...
    assert tier.segment.path.exists()  # ...and is there again, the file this daemon maps
    assert os.stat(tier.segment.path).st_ino == os.fstat(tier.segment._fd).st_ino
    await put(tier, b"k" * 32, b"x" * 100)
    SegmentReader(str(tier.segment.path), tier.segment.layout.segment_id).close()  # a worker can map it
    assert clean_stale(shm_dir) == []
    await tier.close()


def test_config_refuses_bad_pool_settings() -> None:
    from engram.config import load_config

    with pytest.raises(ConfigError, match="power of two"):
        load_config(env={}, overrides={"tiers.dram.page_bytes": 3000})
    with pytest.raises(ConfigError, match="shared or private"):
        load_config(env={}, overrides={"tiers.dram.pool": "pinned"})


def _rss_shmem_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


async def test_the_pool_is_prefaulted_in_the_background_without_changing_its_bytes(shm_dir: Path) -> None:
    before = _rss_shmem_kib()
    tier = shared_dram_tier(64 * 2**20, shm_dir, 4096, pin=False, prefault=True)
    payload = os.urandom(1 << 20)
    await put(tier, b"early!!!", payload)  # written while the prefault may still run
    seg = tier.segment
    assert seg is not None
    assert seg.prefaulted is not None and seg.prefaulted.wait(30), "the prefault thread did not finish"
    assert _rss_shmem_kib() - before >= 64 * 1024, "the pool's pages are not resident after the prefault"
    assert await tier.read(b"early!!!") == payload
    await tier.close()
    cold = shared_dram_tier(64 * 2**20, shm_dir, 4096, pin=False)  # prefault off: nothing populated ahead
    assert cold.segment is not None and cold.segment.prefaulted is None
    await cold.close()
