"""The hit path on the CPU against a real daemon (same host: the shared DRAM pool is mapped): load_prefix_into
writes exactly what the bytes path returns into every destination layout and codec, in one round trip; a slot
reused while it is copied (its lease expired) is detected and fetched again; blocks on NVMe only come as bytes
in the same call; a worker in another process gets the same tensors. The GPU version of these tests is in
tests/test_gpu_data_path.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engram.client import EngramClient
from engram.destinations import LayerKV, PagedKV
from engram.loader import PrefixLoader

from helpers import BLOCK_TOKENS, engram_daemon, random_kv, tiny_model, tokens

CODECS = ["raw", "nvfp4", "mxfp4", "fp8_e4m3"]
# The same tests on a GPU (the H200): the staged pipeline, the batched kernels and the registered mapping.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the H200)")])]


async def bytes_path(c: EngramClient, fp: bytes, toks: Any) -> torch.Tensor:
    """The prefix's KV as the bytes path returns it (no descriptors, nothing mapped)."""
    hit = await c.lookup(fp, toks)
    blocks = await c.get(fp, [b.key for b in hit.blocks], zero_copy=False)
    return torch.cat(blocks, dim=2)[:, :, : hit.matched_tokens]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS)
async def test_every_destination_gets_what_the_bytes_path_returns(server_factory, codec: str, device: str) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = tiny_model(codec=codec)
    lay = spec.layout
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(5 * BLOCK_TOKENS + 7)
        await c.put(fp, toks, random_kv(spec, len(toks)))
        want = await bytes_path(c, fp, toks)
        served = (await c.stats()).blocks_served
        n = len(toks)
        L, H, D = lay.persisted_layers, lay.num_kv_heads, lay.head_dim

        want = want.to(device)
        contiguous = torch.full(lay.block_shape(n), float("nan"), dtype=torch.bfloat16, device=device)
        got = await c.load_prefix_into(fp, toks, contiguous)
        assert (got.matched_tokens, got.loaded_tokens, got.mapped_blocks, got.bytes_blocks) == (n, n, 6, 0)
        assert torch.equal(contiguous, want)
        assert (await c.stats()).blocks_served == served + 6  # counted like any hit

        # Hugging Face keeps (batch, heads, tokens, head_dim) per layer: hand it transposed views.
        hf = [torch.full((2, 1, H, n + 9, D), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(L)]
        await c.load_prefix_into(fp, toks, LayerKV([t[0, 0].transpose(0, 1) for t in hf],
                                                   [t[1, 0].transpose(0, 1) for t in hf]))
        for layer, t in enumerate(hf):
            assert torch.equal(t[:, 0, :, :n].transpose(1, 2), want[layer])
            assert t[:, 0, :, n:].isnan().all()  # nothing written past the prefix

        # vLLM-style pages of 4 tokens, the request's pages scattered over the pool in reverse.
        pages = -(-n // 4)
        table = list(range(3 * pages, 3 * pages - 2 * pages, -2))[:pages]
        kp = [torch.full((3 * pages + 1, 4, H, D), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(L)]
        vp = [torch.full((3 * pages + 1, 4, H, D), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(L)]
        await c.load_prefix_into(fp, toks, PagedKV(kp, vp, table))
        for layer in range(L):
            for stream, paged in enumerate((kp, vp)):
                flat = paged[layer][table].reshape(pages * 4, H, D)
                assert torch.equal(flat[:n], want[layer, stream])


@pytest.mark.parametrize("device", DEVICES)
async def test_a_query_diverging_inside_a_block_and_a_small_destination(server_factory, device: str) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = tiny_model(codec="nvfp4")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(4 * BLOCK_TOKENS)
        await c.put(fp, toks, random_kv(spec, len(toks)))
        want = await bytes_path(c, fp, toks)
        diverged = toks.copy()
        diverged[2 * BLOCK_TOKENS + 5] += 1  # the query leaves the cached chain inside block 2
        want = want.to(device)
        n, got = await c.get_prefix(fp, diverged, device=device)
        assert n == 2 * BLOCK_TOKENS + 5 and torch.equal(got, want[:, :, :n])
        small = torch.zeros(spec.layout.block_shape(BLOCK_TOKENS + 3), dtype=torch.bfloat16, device=device)
        res = await c.load_prefix_into(fp, toks, small)
        assert (res.matched_tokens, res.loaded_tokens) == (4 * BLOCK_TOKENS, BLOCK_TOKENS + 3)
        assert torch.equal(small, want[:, :, : BLOCK_TOKENS + 3])
        n, empty = await c.get_prefix(fp, tokens(40, seed=5), device=device)  # a miss: the documented shape
        assert n == 0 and empty.shape == spec.layout.block_shape(0)


async def test_concurrent_loads_of_the_same_nvme_blocks_bring_each_up_once(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Several workers asking at once for a prefix that lies on NVMe, with room in the pool for it twice over:
    each GetPrefix copies up only what no other is already moving, so one copy of each block lands and every
    load gets the right KV (the soak found two GetPrefix calls writing the same key into the pool: INTERNAL)."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 16 * block, "tiers.dram.page_bytes": 256,
                                  "tiers.nvme.path": str(tmp_path / "nvme")})
    a = tokens(8 * BLOCK_TOKENS, seed=1)
    kv_a = random_kv(spec, len(a), seed=1)

    async def push_a_down(c: EngramClient) -> None:  # other blocks push a out to NVMe, then go: the pool is empty
        for seed in (2, 3):
            toks = tokens(8 * BLOCK_TOKENS, seed=seed)
            await c.put(fp, toks, random_kv(spec, len(toks), seed=seed), namespace="other")
        await c.evict(whole_namespace=True, force=True, namespace="other")
        assert {x.tier for x in (await c.lookup(fp, a)).blocks} == {"nvme"}

    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        await c.put(fp, a, kv_a)
        await push_a_down(c)
        before = (await c.stats()).tier("dram").promotions
        # Two GetPrefix calls' copy_up in the same loop iteration (what concurrent requests do): the second
        # must see the first's blocks as moving, before the first's copies have started.
        metas = srv.store.match("t", fp, a).blocks
        assert await asyncio.gather(srv.store.copy_up(metas, "dram"), srv.store.copy_up(metas, "dram")) == [8, 0]
        await push_a_down(c)
        clients = [EngramClient(srv.address, namespace="t") for _ in range(4)]
        try:
            for w in clients:
                await w.register_model(spec)
            dests = [torch.zeros_like(kv_a) for _ in clients]
            results = await asyncio.gather(*(w.load_prefix_into(fp, a, d) for w, d in zip(clients, dests, strict=True)))
        finally:
            for w in clients:
                await w.close()
        assert all(r.loaded_tokens == len(a) for r in results)
        assert all(torch.equal(d, kv_a) for d in dests)
        assert (await c.stats()).tier("dram").promotions - before == 16  # each block brought up once a round
        assert (await c.check()).findings == ()


@pytest.mark.parametrize("device", DEVICES)
async def test_blocks_on_nvme_are_promoted_into_the_pool_or_else_come_as_bytes(server_factory, tmp_path: Path,
                                                                               device: str) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 8 * block, "tiers.dram.page_bytes": 256,
                                  "tiers.nvme.path": str(tmp_path / "nvme")})
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        a, b = tokens(8 * BLOCK_TOKENS, seed=1), tokens(8 * BLOCK_TOKENS, seed=2)
        kv_a, kv_b = random_kv(spec, len(a), seed=1), random_kv(spec, len(b), seed=2)
        await c.put(fp, a, kv_a)
        await c.put(fp, b, kv_b)  # a goes down to NVMe
        assert {x.tier for x in (await c.lookup(fp, a)).blocks} == {"nvme"}
        before = (await c.stats()).tier("dram").promotions
        dest = torch.zeros_like(kv_a, device=device)
        res = await c.load_prefix_into(fp, a, dest)  # one batch up into the pool (b is demoted), then mapped
        assert (res.mapped_blocks, res.bytes_blocks) == (8, 0)
        assert (await c.stats()).tier("dram").promotions - before == 8
        assert torch.equal(dest.cpu(), kv_a)
        # Now b is on NVMe and a fills the pool pinned: nothing can make room, so b comes as bytes.
        await c.pin(fp, [x.key for x in (await c.lookup(fp, a)).blocks])
        dest = torch.zeros_like(kv_b, device=device)
        res = await c.load_prefix_into(fp, b, dest)
        assert (res.mapped_blocks, res.bytes_blocks) == (0, 8)
        assert torch.equal(dest.cpu(), kv_b)


@pytest.mark.parametrize("call", ["load_prefix_into", "get_prefix"])
async def test_a_first_hit_on_a_damaged_nvme_block_answers_the_sound_prefix_before_it(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                      call: str) -> None:
    """A chain of four blocks held on NVMe alone, block 1's file corrupt (a byte flipped). The first hit brings
    the chain up into the pool, finds block 1 damaged and drops it with the blocks that extend it: the answer is
    block 0, the sound prefix that remains. GetPrefix had described the chain as looked up before the copy, so the
    dropped blocks went out with empty descriptors, the client asked for them by Get and the call raised NotFound
    (the docs audit, session 48); the next call returned block 0."""
    spec = tiny_model()
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(4 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        put = await c.put(fp, toks, kv)
        for key in put.keys:
            await srv.store.keep_only_in(srv.store.block(key), "nvme")
        path = srv.store.tiers[-1].path_of(put.keys[1])
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
        if call == "load_prefix_into":
            dest = torch.zeros_like(kv)
            res = await c.load_prefix_into(fp, toks, dest)
            assert (res.matched_tokens, res.loaded_tokens) == (BLOCK_TOKENS, BLOCK_TOKENS)
            assert torch.equal(dest[:, :, :BLOCK_TOKENS], kv[:, :, :BLOCK_TOKENS])
            assert not dest[:, :, BLOCK_TOKENS:].any()  # nothing written past the sound prefix
        else:
            n, got = await c.get_prefix(fp, toks)
            assert n == BLOCK_TOKENS and torch.equal(got, kv[:, :, :BLOCK_TOKENS])
        assert (await c.lookup(fp, toks)).matched_tokens == BLOCK_TOKENS
        assert (await c.stats()).corrupt_blocks == 1
        assert (await c.check()).findings == ()


@pytest.mark.parametrize("device", DEVICES)
async def test_a_slot_reused_while_it_is_copied_is_detected_and_fetched_again(server_factory, tmp_path: Path,
                                                                               monkeypatch, device: str) -> None:  # type: ignore[no-untyped-def]
    """The lease expires mid-load (lease_s 0.2 s, the loader held up after its first block), new puts evict
    the prefix to NVMe and reuse its DRAM slots: the loader finds the generations changed and those blocks come
    again as bytes (from NVMe), so the destination holds the right KV, not the new blocks' bytes."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 4 * block, "tiers.dram.page_bytes": 256,
                                  "tiers.nvme.path": str(tmp_path / "nvme"), "server.lease_s": 0.2})
    first_written, go_on = threading.Event(), threading.Event()
    write = PrefixLoader._write

    def held_up(self, run, *args, **kwargs):  # type: ignore[no-untyped-def]
        write(self, run, *args, **kwargs)
        if not first_written.is_set():
            first_written.set()
            assert go_on.wait(30)

    monkeypatch.setattr(PrefixLoader, "_write", held_up)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(4 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        await c.put(fp, toks, kv)
        assert all(b.tier == "dram" for b in (await c.lookup(fp, toks)).blocks)
        dest = torch.zeros_like(kv, device=device)
        load = asyncio.ensure_future(c.load_prefix_into(fp, toks, dest))
        while not first_written.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.4)  # the lease has expired
        for s in range(3):  # other prefixes push this one out of DRAM and take its slots
            other = tokens(4 * BLOCK_TOKENS, seed=10 + s)
            await c.put(fp, other, random_kv(spec, len(other), seed=10 + s))
        go_on.set()
        res = await load
    assert res.refetched_blocks >= 1 and res.mapped_blocks + res.refetched_blocks == 4
    assert torch.equal(dest.cpu(), kv)


async def _damage_in_pool(address: str, fp: bytes, toks: Any) -> int:
    """Damage the pool copies of a prefix's blocks 1 and 2 in the daemon's /dev/shm segment, as a stray writer
    would: block 1's first K group scale set to the NVFP4 NaN code (0x7F), a byte of block 2's (a partial
    block's) body flipped. Returns how many blocks the prefix has."""
    import mmap
    import os

    import grpc

    from engram.codec.blockformat import HEADER_LEN
    from engram.segment import HEADER, SegmentLayout
    from engram.v1 import engram_pb2 as pb
    from engram.v1 import engram_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.EngramStub(ch)
        h = await stub.GetPrefix(pb.GetPrefixRequest(namespace="t", model_fingerprint=fp, tokens=toks.tolist(),
                                                     zero_copy=True))
        await stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="t", lease_ids=[h.lease_id]))
    one, two = h.descriptors[1], h.descriptors[2]
    fd = os.open(one.segment_path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as mm:
            base = SegmentLayout.unpack(mm[: HEADER.size], one.segment_path).data_offset
            mm[base + one.offset + HEADER_LEN + 4] = 0x7F  # after K's tensor scale (4 bytes): its first group scale
            mm[base + two.offset + two.header.payload_nbytes - 1] ^= 0x40
    finally:
        os.close(fd)
    return len(h.descriptors)


@pytest.mark.parametrize("nvme", [False, True], ids=["dram-only", "dram-and-nvme"])
async def test_pool_blocks_that_do_not_decode_are_fetched_as_bytes_and_their_copies_dropped(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path, nvme: bool) -> None:
    """Blocks damaged in the shared pool so that they do not decode (an FP4 scale that is NaN, a v1 body that
    fails its checksum) made every load of the prefix raise the codec's bare ValueError (or InvalidArgument),
    the daemon never told (an audit, session 43). The loader fetches them as bytes instead: the daemon verifies
    them, drops the damaged copies (counted corrupt) and serves their NVMe copies; without one, DATA_LOSS, and the
    damaged blocks are gone (a Get with zero_copy did so already)."""
    from engram import errors

    spec = tiny_model(codec="nvfp4")
    srv = await server_factory(**({"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_back_window_s": 0.05}
                                  if nvme else {}))
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS + 5)
        await c.put(fp, toks, random_kv(spec, len(toks)))
        while nvme and (await c.stats()).write_back_pending_blocks:
            await asyncio.sleep(0.02)
        want = await bytes_path(c, fp, toks)
        assert await _damage_in_pool(srv.address, fp, toks) == 3
        if nvme:
            n, got = await c.get_prefix(fp, toks)
            assert n == len(toks) and torch.equal(got, want)
            dest = torch.zeros_like(want)
            res = await c.load_prefix_into(fp, toks, dest)  # the pool holds good copies again (from NVMe)
            assert res.matched_tokens == len(toks) and torch.equal(dest, want)
        else:
            with pytest.raises(errors.DataLoss):
                await c.get_prefix(fp, toks)
            assert (await c.lookup(fp, toks)).matched_tokens == BLOCK_TOKENS  # block 0 stays, sound
            n, got = await c.get_prefix(fp, toks)
            assert n == BLOCK_TOKENS and torch.equal(got, want[:, :, :BLOCK_TOKENS])
        assert (await c.stats()).corrupt_blocks == (2 if nvme else 1)


WORKER = """
import asyncio, sys, torch
sys.path.insert(0, {tests!r})
from engram.client import EngramClient
from helpers import tiny_model, tokens, BLOCK_TOKENS

async def main():
    spec = tiny_model(codec="nvfp4")
    async with EngramClient({address!r}, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(3 * BLOCK_TOKENS + 2)
        dest = torch.zeros(spec.layout.block_shape(len(toks)), dtype=torch.bfloat16)
        res = await c.load_prefix_into(fp, toks, dest)
        print(res.mapped_blocks, res.bytes_blocks, dest.view(torch.int16).to(torch.int64).sum().item())

asyncio.run(main())
"""


async def test_a_worker_in_another_process_loads_the_same_tensors(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = tiny_model(codec="nvfp4")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(3 * BLOCK_TOKENS + 2)
        await c.put(fp, toks, random_kv(spec, len(toks)))
        want = await bytes_path(c, fp, toks)
    code = WORKER.format(tests=str(Path(__file__).parent), address=srv.address)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    mapped, sent, total = map(int, out.split())
    assert (mapped, sent) == (4, 0)  # every block copied out of the mapped pool, none over the socket
    assert total == want.view(torch.int16).to(torch.int64).sum().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_hbm_blocks_load_through_cuda_ipc_into_the_worker(tmp_path: Path, codec: str) -> None:
    """Blocks in the daemon's HBM pool (a daemon process on the same GPU) are decoded where they lie, the pool
    opened by CUDA IPC in the worker (a process cannot open its own allocation so)."""
    spec = tiny_model(codec=codec)
    with engram_daemon(tmp_path, "--set", "tiers.hbm.capacity=64MiB", "--set", "tiers.hbm.device=cuda") as (addr, _):
        async with EngramClient(addr, namespace="t", zero_copy=False) as putter:  # a Put lands in HBM
            fp = await putter.register_model(spec)
            toks = tokens(4 * BLOCK_TOKENS + 3)
            await putter.put(fp, toks, random_kv(spec, len(toks)))
            want = await bytes_path(putter, fp, toks)
        async with EngramClient(addr, namespace="t") as c:
            await c.register_model(spec)
            assert all(b.tier == "hbm" for b in (await c.lookup(fp, toks)).blocks)
            dest = torch.zeros(spec.layout.block_shape(len(toks)), dtype=torch.bfloat16, device="cuda")
            res = await c.load_prefix_into(fp, toks, dest)
            assert (res.mapped_blocks, res.bytes_blocks) == (5, 0)
            assert torch.equal(dest.cpu(), want)
            # A prefix put in place lands in DRAM; the first hit of a worker on this GPU promotes it to HBM in
            # the background (one batched DMA), and the next hit reads it device to device.
            other = tokens(3 * BLOCK_TOKENS, seed=9)
            kv = random_kv(spec, len(other), seed=9).cuda()
            await c.put(fp, other, kv)
            assert {b.tier for b in (await c.lookup(fp, other)).blocks} == {"dram"}
            got = torch.zeros_like(kv)
            await c.load_prefix_into(fp, other, got)
            for _ in range(100):
                if {b.tier for b in (await c.lookup(fp, other)).blocks} == {"hbm"}:
                    break
                await asyncio.sleep(0.05)
            assert {b.tier for b in (await c.lookup(fp, other)).blocks} == {"hbm"}
            got.zero_()
            res = await c.load_prefix_into(fp, other, got)
            assert res.mapped_blocks == 3
            assert torch.equal(got.cpu(), await bytes_path(c, fp, other))


async def _two_blocks_stored(c: EngramClient) -> tuple[bytes, Any, torch.Tensor]:
    """The tiny model registered and a two-block prefix of its KV put: (fingerprint, tokens, KV)."""
    spec = tiny_model()
    fp = await c.register_model(spec)
    toks = tokens(2 * BLOCK_TOKENS)
    kv = random_kv(spec, len(toks))
    await c.put(fp, toks, kv)
    return fp, toks, kv


@pytest.mark.parametrize("zero_copy", [True, False])
async def test_a_destination_not_shaped_as_the_models_kv_is_refused(server_factory, zero_copy: bool) -> None:  # type: ignore[no-untyped-def]
    """A destination with kv_heads and head_dim swapped holds as many elements, and was filled in another order
    without a word; one with other layers failed in torch's reshape. Both are InvalidArgument naming the model's
    shape, on the mapped path and the bytes path, for a tensor and for per-layer tensors; the right shape loads."""
    from engram import errors

    srv = await server_factory()
    async with EngramClient(srv.address, namespace="t", zero_copy=zero_copy) as c:
        fp, toks, kv = await _two_blocks_stored(c)
        layers, _, n, heads, dim = kv.shape
        assert heads != dim
        for wrong in ((layers, 2, n, dim, heads), (layers + 1, 2, n, heads, dim)):
            with pytest.raises(errors.InvalidArgument, match="kv_heads, head_dim"):
                await c.load_prefix_into(fp, toks, torch.zeros(wrong, dtype=kv.dtype))
        swapped = [torch.zeros(n, dim, heads, dtype=kv.dtype) for _ in range(layers)]
        with pytest.raises(errors.InvalidArgument, match="kv_heads, head_dim"):
            await c.load_prefix_into(fp, toks, LayerKV(swapped, [t.clone() for t in swapped]))
        right = torch.zeros_like(kv)
        assert (await c.load_prefix_into(fp, toks, right)).loaded_tokens == n
        assert torch.equal(right, kv)


@pytest.mark.parametrize("zero_copy", [True, False])
async def test_a_destination_of_another_dtype_than_the_models_kv_is_refused(server_factory, zero_copy: bool) -> None:  # type: ignore[no-untyped-def]
    """A tensor or per-layer tensors of another dtype took the bfloat16 KV cast (int32: truncated to integers,
    reported loaded), while pages of another dtype failed in torch's index_copy_ (a RuntimeError, not an
    EngramError). All are InvalidArgument naming the dtype to allocate; the daemon serves the right one after."""
    from engram import errors

    srv = await server_factory()
    async with EngramClient(srv.address, namespace="t", zero_copy=zero_copy) as c:
        fp, toks, kv = await _two_blocks_stored(c)
        layers, _, n, heads, dim = kv.shape
        for dtype in (torch.int32, torch.float16, torch.float32):
            per_layer = [torch.zeros(n, heads, dim, dtype=dtype) for _ in range(layers)]
            pages = [torch.zeros(n // 4, 4, heads, dim, dtype=dtype) for _ in range(layers)]
            for dest in (torch.zeros(kv.shape, dtype=dtype), LayerKV(per_layer, [t.clone() for t in per_layer]),
                         PagedKV(pages, [t.clone() for t in pages], range(n // 4))):
                with pytest.raises(errors.InvalidArgument, match=r"allocate it as torch\.bfloat16"):
                    await c.load_prefix_into(fp, toks, dest)
        right = torch.zeros_like(kv)
        assert (await c.load_prefix_into(fp, toks, right)).loaded_tokens == n
        assert torch.equal(right, kv)


async def test_a_destination_the_models_kv_does_not_fit_is_refused_on_a_miss_too(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A destination of another dtype or shape was refused only when a block was written: on a miss (a worker's
    first requests, a cold daemon) the load answered 0 tokens without a word, so a misconfigured worker never got
    a hit and never saw why. It is checked against the model's layout before the request: the same
    InvalidArgument on a miss as on a hit; a destination that fits misses quietly."""
    from engram import errors

    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS)
        layers, _, n, heads, dim = spec.layout.block_shape(len(toks))
        for dtype in (torch.int32, torch.float32):
            per_layer = [torch.zeros(n, heads, dim, dtype=dtype) for _ in range(layers)]
            pages = [torch.zeros(n // 4, 4, heads, dim, dtype=dtype) for _ in range(layers)]
            for dest in (torch.zeros(layers, 2, n, heads, dim, dtype=dtype),
                         LayerKV(per_layer, [t.clone() for t in per_layer]),
                         PagedKV(pages, [t.clone() for t in pages], range(n // 4))):
                with pytest.raises(errors.InvalidArgument, match=r"allocate it as torch\.bfloat16"):
                    await c.load_prefix_into(fp, toks, dest)
        swapped = [torch.zeros(n, dim, heads, dtype=torch.bfloat16) for _ in range(layers)]
        more = [torch.zeros(n // 4, 4, heads, dim, dtype=torch.bfloat16) for _ in range(layers + 1)]
        odd = [torch.zeros(n // 3, 3, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
        for dest, match in ((torch.zeros(layers, 2, n, dim, heads, dtype=torch.bfloat16), "kv_heads, head_dim"),
                            (LayerKV(swapped, [t.clone() for t in swapped]), "kv_heads, head_dim"),
                            (PagedKV(more, [t.clone() for t in more], range(n // 4)), "stores 2 layers"),
                            (PagedKV(odd, [t.clone() for t in odd], range(n // 3)), "page_tokens=3 must divide")):
            with pytest.raises(errors.InvalidArgument, match=match):
                await c.load_prefix_into(fp, toks, dest)
        right = torch.zeros(layers, 2, n, heads, dim, dtype=torch.bfloat16)
        assert (await c.load_prefix_into(fp, toks, right)).loaded_tokens == 0  # a miss, no error


def test_a_block_table_naming_one_page_twice_is_refused() -> None:
    """Two logical pages on one physical page: the later write won, the earlier page's tokens read back wrong
    through the table, and all were reported loaded. The repeated id is named."""
    from engram import errors

    k = [torch.zeros(8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(errors.InvalidArgument, match=r"page 4 more than once \(logical pages \[0, 1\]\)"):
        PagedKV(k, [t.clone() for t in k], [4, 4, 1, 6, 2])
    assert PagedKV(k, [t.clone() for t in k], [4, 3, 1, 6, 2]).capacity_tokens == 20


async def test_one_tensor_given_for_two_of_a_destinations_places_is_refused(server_factory) -> None:  # type: ignore[no-untyped-def]
    """PagedKV(k, k, table) was accepted, and a load wrote V over K: both read back V. The same tensor given for K
    and V, or for two layers, is refused naming both places. K and V as views of one buffer that do not share an
    element (vLLM's (2, pages, ...) cache and FlashInfer's (pages, 2, ...)) are two places, and load as such."""
    from engram import errors

    spec = tiny_model()
    lay = spec.layout
    L, H, D = lay.persisted_layers, lay.num_kv_heads, lay.head_dim
    k = [torch.zeros(8, 4, H, D, dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(errors.InvalidArgument, match=r"K of layer 0 and V of layer 0 are one tensor"):
        PagedKV(k, k, range(4))
    with pytest.raises(errors.InvalidArgument, match=r"K of layer 0 and K of layer 1 are one tensor"):
        PagedKV([k[0], k[0]], [t.clone() for t in k], range(4))
    t = [torch.zeros(16, H, D, dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(errors.InvalidArgument, match=r"K of layer 1 and V of layer 1 are one tensor"):
        LayerKV([t[0], t[1]], [t[0].clone(), t[1]])

    srv = await server_factory()
    async with EngramClient(srv.address) as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS)
        n = len(toks)
        want = random_kv(spec, n)
        await c.put(fp, toks, want)
        vllm = [torch.full((2, n // 4, 4, H, D), float("nan"), dtype=torch.bfloat16) for _ in range(L)]
        flashinfer = [torch.full((n // 4, 2, 4, H, D), float("nan"), dtype=torch.bfloat16) for _ in range(L)]
        for dest, k_of, v_of in ((vllm, lambda x: x[0], lambda x: x[1]),
                                 (flashinfer, lambda x: x[:, 0], lambda x: x[:, 1])):
            got = await c.load_prefix_into(fp, toks, PagedKV([k_of(x) for x in dest], [v_of(x) for x in dest],
                                                             range(n // 4)))
            assert got.loaded_tokens == n
            for layer, x in enumerate(dest):
                assert torch.equal(k_of(x).reshape(n, H, D), want[layer, 0])
                assert torch.equal(v_of(x).reshape(n, H, D), want[layer, 1])


async def test_a_bytes_load_keeps_what_its_answer_named_until_the_bytes_came(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A worker off the daemon's host loads a prefix in two calls: GetPrefix names the blocks, a Get brings their
    bytes. An eviction between the two (here another client's Evict, run at that moment by a stand-in for the
    client's fetch that then calls the real one) skips the blocks the answer named, as being read, and the load
    gets all of them (it failed NOT_FOUND); once the load's lease ends they may go."""
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="e", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="e") as other:
        fp = await c.register_model(spec)
        await other.register_model(spec)
        toks = tokens(4 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        keys = (await c.put(fp, toks, kv)).keys
        fetch = c._fetch_bytes
        skipped: list[bytes] = []

        async def evicted_first(fingerprint: bytes, ks: Any, namespace: Any, release: Any = ()) -> Any:
            skipped.extend((await other.evict(key_prefixes=[keys[2].hex()])).skipped)
            return await fetch(fingerprint, ks, namespace, release)

        c._fetch_bytes = evicted_first  # type: ignore[method-assign]
        dest = torch.zeros_like(kv)
        loaded = await c.load_prefix_into(fp, toks, dest)
        c._fetch_bytes = fetch  # type: ignore[method-assign]
        assert loaded.loaded_tokens == len(toks) and loaded.bytes_blocks == 4
        assert torch.equal(dest, kv)
        assert set(skipped) == {keys[2], keys[3]}
        await asyncio.sleep(0.5)  # the load's lease ends RELEASE_AFTER_S after it (no next load to end it)
        assert set((await other.evict(key_prefixes=[keys[2].hex()])).evicted) == {keys[2], keys[3]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_concurrent_loads_of_one_client_each_get_their_own_prefix(server_factory, device: str,  # type: ignore[no-untyped-def]
                                                                       codec: str) -> None:
    """Loads of one client run in threads of their own. On a GPU they shared the loader's staging buffers without
    ordering between them: one load's copy into a buffer could land before another's decode of it had run, and
    that load's destination got the other prefix's KV. Eight prefixes loaded at once, over and over, each into
    its own destination, must each equal what the bytes path returns for it."""
    srv = await server_factory()
    spec = tiny_model(codec=codec)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        prompts = [tokens(8 * BLOCK_TOKENS, seed=100 + i) for i in range(8)]
        for i, toks in enumerate(prompts):
            await c.put(fp, toks, random_kv(spec, len(toks), seed=100 + i))
        want = [(await bytes_path(c, fp, toks)).to(device) for toks in prompts]
        for _ in range(10):
            dests = [torch.zeros_like(w) for w in want]
            await asyncio.gather(*(c.load_prefix_into(fp, toks, d) for toks, d in zip(prompts, dests, strict=True)))
            if device == "cuda":
                torch.cuda.synchronize()
            for i, (got, w) in enumerate(zip(dests, want, strict=True)):
                assert torch.equal(got, w), f"prefix {i} got other KV"


async def test_a_bytes_get_prefix_has_its_lease_ended_by_the_get_that_fetched_its_blocks(server_factory) -> None:  # type: ignore[no-untyped-def]
    """get_prefix off the daemon's host: GetPrefix leases the blocks it names, the Get that brings their bytes
    ends that lease as it is answered (GetRequest.release_lease_ids), so when get_prefix returns the daemon
    holds none: no ReleaseLeases round trip, and no lease left to a background task while the worker's next
    request (its put) makes room."""
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        toks = tokens(3 * BLOCK_TOKENS, seed=17)
        kv = random_kv(spec, len(toks), seed=17)
        keys = (await c.put(fp, toks, kv)).keys
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)
        assert len(srv.service.leases) == 0 and all(srv.store.index.get(k).leases == 0 for k in keys)


async def test_getprefix_leases_undescribed_blocks_only_for_a_caller_that_will_get_them(server_factory) -> None:  # type: ignore[no-untyped-def]
    """GetPrefix leases the blocks it describes; the others only when the caller says it will Get them as bytes
    (hold_for_get, which EngramClient sends): a client of another language that knows nothing of it is not left
    holding every block it hit, unevictable, for lease_s."""
    import grpc

    from engram.v1 import engram_pb2 as pb
    from engram.v1 import engram_pb2_grpc as pb_grpc
    from engram.wire import convert

    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS, seed=18)
        keys = (await c.put(fp, toks, random_kv(spec, len(toks), seed=18))).keys
    async with grpc.aio.insecure_channel(srv.address.removeprefix("tcp:")) as ch:
        stub = pb_grpc.EngramStub(ch)
        req = pb.GetPrefixRequest(namespace="t", model_fingerprint=fp, tokens=convert.tokens_to_pb(toks))
        plain = await stub.GetPrefix(req)
        assert plain.matched_tokens == len(toks) and plain.lease_id == 0
        assert all(srv.store.index.get(k).leases == 0 for k in keys)
        req.hold_for_get = True
        held = await stub.GetPrefix(req)
        assert held.lease_id and all(srv.store.index.get(k).leases == 1 for k in keys)
        await stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="t", lease_ids=[held.lease_id]))
        assert all(srv.store.index.get(k).leases == 0 for k in keys)


async def test_a_large_hit_is_verified_off_the_event_loop_and_a_damaged_one_still_raises_data_loss(  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    """A hit of CHECKSUM_OFF_LOOP_BYTES or more is hashed in a worker thread, not on the event loop (whose other
    calls waited 2-3 ms per 16 MiB hit: benchmarks/RESULTS.md put_get session 50), and that check still catches a
    damaged copy: a byte flipped in the daemon's shared pool, copied out by a zero-copy Get, fails it, so the
    block is fetched as bytes, which the daemon finds damaged too: DataLoss, never the damaged elements. Watched
    with a profile hook on the loop's thread (the daemon is another process: its own hashing is not seen)."""
    import mmap
    import os

    import xxhash

    from engram import errors
    from engram.block import CHECKSUM_OFF_LOOP_BYTES
    from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
    from engram.segment import HEADER, SegmentLayout

    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=2048)
    spec = ModelSpec("big-blocks", "w", layout, codec="raw")
    assert layout.block_nbytes(2048) == CHECKSUM_OFF_LOOP_BYTES  # the smallest block hashed off the loop
    on_loop: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg is xxhash.xxh3_64_intdigest:
            on_loop.append(frame.f_code.co_name)

    with engram_daemon(tmp_path) as (address, _):
        async with EngramClient(address, namespace="t") as c:
            fp = await c.register_model(spec)
            toks = tokens(2048)
            kv = random_kv(spec, 2048)
            sys.setprofile(watch)
            try:
                (key,) = (await c.put(fp, toks, kv)).keys
                (got,) = await c.get(fp, [key], zero_copy=False)
                assert torch.equal(got, kv)
            finally:
                sys.setprofile(None)
            assert on_loop == []  # neither the put's checksum nor the hit's check ran on the loop
            (d,) = await _descriptors(address, fp, toks)
            fd = os.open(d.segment_path, os.O_RDWR)
            try:
                with mmap.mmap(fd, 0) as mm:
                    base = SegmentLayout.unpack(mm[: HEADER.size], d.segment_path).data_offset
                    mm[base + d.offset + 12345] ^= 0x40
            finally:
                os.close(fd)
            sys.setprofile(watch)
            try:
                with pytest.raises(errors.DataLoss):
                    await c.get(fp, [key], zero_copy=True)  # the copy fails its check: fetched as bytes, refused
            finally:
                sys.setprofile(None)
            assert on_loop == []


async def _descriptors(address: str, fp: bytes, toks: Any) -> list[Any]:
    """The pool descriptors of a prefix's blocks (their leases ended at once)."""
    import grpc

    from engram.v1 import engram_pb2 as pb
    from engram.v1 import engram_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.EngramStub(ch)
        h = await stub.GetPrefix(pb.GetPrefixRequest(namespace="t", model_fingerprint=fp, tokens=toks.tolist(),
                                                     zero_copy=True))
        await stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="t", lease_ids=[h.lease_id]))
    return list(h.descriptors)
