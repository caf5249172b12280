"""A worker stays connected while its daemon is killed and started again on the same socket (as after a crash).
Each start makes a shared pool of its own (a new file; the dead daemon's is removed), so the worker must let
go of the dead daemon's pool: kept mapped, it held a whole pool's pages (on a GPU host registered with CUDA)
per restart for as long as the worker ran (an audit: 128 MiB a restart with a 128 MiB pool)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engram.client import SyncEngramClient
from engram.loader import MappedSegment
from engram.mapped_pools import MappedPools
from engram.segment import SegmentReader
from engram.tiers.shm import PREFIX, SharedSegment

from helpers import BLOCK_TOKENS, RestartingDaemon, random_kv, tiny_model, tokens

SPEC = tiny_model()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the H200)")])]


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    # A private directory on the real /dev/shm (other daemons' pools are not this test's).
    d = Path("/dev/shm") / f"engram-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def pools_mapped(shm: Path) -> tuple[set[str], set[str]]:
    """The pool files of `shm` this process maps: (those that still exist, those deleted), from /proc/self/maps."""
    live: set[str] = set()
    deleted: set[str] = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path, gone = fields[5].removesuffix(" (deleted)"), fields[5].endswith(" (deleted)")
        if Path(path).parent == shm and Path(path).name.startswith(PREFIX):
            (deleted if gone else live).add(path)
    return live, deleted


@pytest.mark.parametrize("device", DEVICES)
def test_a_connected_client_maps_only_the_live_daemons_pool_after_each_restart(
        tmp_path: Path, shm: Path, device: str) -> None:
    """Killed and started again three times: after each start a put in place, a load and a zero-copy get (each
    maps the new pool), and the client maps no pool of a dead daemon, and keeps one mapping per use and live pool."""
    with RestartingDaemon(tmp_path, {"ENGRAM_TIERS__DRAM__SHM_DIR": str(shm)}) as daemon, \
            SyncEngramClient(daemon.address, in_place_min_bytes=0) as client:
        for start in range(4):
            if start:
                daemon.restart(client)
            fp = client.register_model(SPEC)  # the started daemon knows no model
            toks = tokens(4 * BLOCK_TOKENS + 3, seed=start)
            kv = random_kv(SPEC, len(toks), seed=start).to(device)
            put = client.put(fp, toks, kv)
            assert put.stored == 5 and put.reserve_ms > 0  # written in place: the pool mapped writable
            dest = torch.empty_like(kv)
            loaded = client.load_prefix_into(fp, toks, dest)
            assert loaded.mapped_blocks == 5 and torch.equal(dest, kv)  # copied out of the mapped pool
            got = client.get(fp, list(put.keys), device=device)  # zero-copy: descriptors into the pool
            assert torch.equal(torch.cat(got, dim=2), kv)
            pool_files = {str(p) for p in shm.glob(f"{PREFIX}*")}
            live, deleted = pools_mapped(shm)
            assert not deleted, f"after start {start} the client still maps {len(deleted)} dead daemons' pools"
            assert live and live <= pool_files
            held = client._client._pools.held()  # (use, path) of each mapping the client keeps
            assert {path for _, path in held} <= pool_files
            assert {use for use, _ in held} >= {"read", "load", "write"}  # each path above mapped the new pool


def reader(path: Path, segment_id: bytes) -> SegmentReader:  # a zero-copy Get's
    return SegmentReader(path, segment_id)


def loader(path: Path, segment_id: bytes) -> MappedSegment:  # a load's (registered with CUDA on a GPU)
    return MappedSegment(str(path), segment_id, register=torch.cuda.is_available())


def first_bytes(mapping: SegmentReader | MappedSegment) -> bytes:
    if isinstance(mapping, SegmentReader):
        return mapping.header_bytes(0, 4)
    return bytes(mapping.data[:4].numpy())


@pytest.mark.parametrize("open_", [reader, loader])
def test_a_forgotten_pool_stays_mapped_while_a_user_holds_it_and_goes_with_its_last_user(
        shm: Path, open_: Callable[[Path, bytes], SegmentReader | MappedSegment]) -> None:
    """A load in flight may still read the dead daemon's pool when the next load maps the new one: forgetting the
    old mapping must not unmap it under that load, which reads its bytes to the end; then it goes."""
    old = SharedSegment(shm, 64 * 1024, 4096, pin=False)
    old.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    pools = MappedPools()
    in_flight = pools.get("load", str(old.path), old.layout.segment_id, lambda: open_(old.path, old.layout.segment_id))
    old.close()  # the daemon goes: its file is unlinked
    new = SharedSegment(shm, 64 * 1024, 4096, pin=False)
    try:
        pools.get("load", str(new.path), new.layout.segment_id, lambda: open_(new.path, new.layout.segment_id))
        assert pools.held() == [("load", str(new.path))]  # the dead daemon's pool is forgotten
        assert pools_mapped(shm)[1] == {str(old.path)}  # and still mapped: the load holds it
        assert first_bytes(in_flight) == b"\x01\x02\x03\x04"
        del in_flight
        gc.collect()
        assert pools_mapped(shm)[1] == set()  # its last user let go: unmapped
    finally:
        pools.clear()
        new.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
def test_a_forgotten_pool_is_unregistered_from_cuda_by_its_last_holder_not_before(shm: Path) -> None:
    """A load's copies out of a pool registered with CUDA are DMAs: unregistering it under a load in flight
    would fail them. Forgotten, it stays registered while a load holds it, and is unregistered when that lets go."""
    old = SharedSegment(shm, 64 * 1024, 4096, pin=False)
    pools = MappedPools()
    in_flight = pools.get("load", str(old.path), old.layout.segment_id, lambda: loader(old.path, old.layout.segment_id))
    assert in_flight.registered
    pages = in_flight.data[:16]  # keeps the pages mapped (not the MappedSegment), to see their registration
    old.close()
    new = SharedSegment(shm, 64 * 1024, 4096, pin=False)
    try:
        pools.get("load", str(new.path), new.layout.segment_id, lambda: loader(new.path, new.layout.segment_id))
        assert pools.held() == [("load", str(new.path))]
        assert pages.is_pinned()  # the load holding it may be copying: still registered
        del in_flight
        gc.collect()
        assert not pages.is_pinned()  # unregistered with its last holder
    finally:
        pools.clear()
        new.close()
