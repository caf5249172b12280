"""Faults a daemon meets in operation, each with the behaviour it must keep (docs/RELIABILITY.md lists them
with the other tests that cover a fault: ENOSPC and EIO on a write-through put in test_durability.py, ENOSPC
under write-back in test_nvme_tier.py, Redis killed and restarted in test_cluster.py, SIGKILL mid-write in
test_crash_recovery.py, SIGKILL during demotion and during check --fix in test_crash_faults.py).

- EIO on a demotion (write-back): the DRAM victim is deleted instead (a leaf), counted as an I/O error; no
  other block is lost, nothing corrupt is served, the daemon goes on.
- EIO on a read: that block's copy is dropped and its Get answers DATA_LOSS; the other blocks are served.
- A slow disk: write-through puts wait for it, and only they: a Get of a block in DRAM is answered while a
  put is stuck in the disk. A block put again while its evicted file is still being unlinked keeps its new
  file, across a restart.
- A client that disconnects mid-Put: nothing of the unfinished block is stored or left reserved; the chain
  can be put again. Mid-Get: the read leases are released.
- A client that never reads its Get stream: the daemon reads ahead only as far as gRPC flow control lets it
  (a few blocks), not the whole request; cancelling releases the leases.
- Out of memory during replay: Resume answers RESOURCE_EXHAUSTED (the worker prefills instead), the daemon
  goes on, and the next Resume replays.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engram import errors
from engram.block import checksum
from engram.client import EngramClient
from engram.codec.stored import RAW, encode
from engram.config import load_config
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server.app import build_store
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import BLOCK_TOKENS, put_raw_chain, random_kv, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)
NS = "faults"


def eio(op_name: str, only: set[Path] | None = None):  # type: ignore[no-untyped-def]
    def hook(op: str, path: Path) -> None:
        if op == op_name and (only is None or path in only):
            raise OSError(errno.EIO, "Input/output error")

    return hook


async def put_chain(store, seed: int, n_blocks: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    return await put_raw_chain(store, NS, SPEC, seed, n_blocks)


async def test_eio_on_demotion_deletes_the_victim_instead_and_serves_the_rest(tmp_path: Path) -> None:
    store = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(tmp_path), "tiers.dram.capacity": 6 * BLOCK, "tiers.dram.pool": "private",
        "tiers.write_back_window_s": 0}))
    store.registry.register(SPEC)
    store.tiers[-1].fault_hook = eio("write")  # type: ignore[attr-defined]
    chains = [await put_chain(store, seed, 3) for seed in range(5)]  # 15 blocks through a 6-block DRAM
    c = store.counters.tiers["nvme"]
    assert c.io_errors >= 1 and len(store.tiers[-1]) == 0
    assert len(store) <= 6  # what could not be demoted was evicted (leaves first)
    for meta in store.blocks():  # everything still indexed is whole
        with store.reading([meta]):
            assert checksum(await store.read(meta)) == meta.checksum
    assert chains[-1][-1] in store.index  # the newest chain survived whole
    await store.close()


async def test_eio_on_read_drops_that_copy_answers_data_loss_and_serves_the_others(server_factory,  # type: ignore[no-untyped-def]
                                                                                   tmp_path: Path) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": BLOCK,
                                  "tiers.dram.pool": "private", "tiers.write_policy": "write-through"})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        a, b = tokens(2 * BLOCK_TOKENS, seed=1), tokens(2 * BLOCK_TOKENS, seed=2)
        kv_b = random_kv(SPEC, len(b), seed=2)
        await client.put(fp, a, random_kv(SPEC, len(a), seed=1))
        await client.put(fp, b, kv_b)
        bad = (await client.lookup(fp, a)).blocks[1].key
        nvme = srv.store.tiers[-1]
        nvme.fault_hook = eio("read", {nvme.path_of(bad)})
        with pytest.raises(errors.DataLoss, match="no tier holds a valid copy"):
            await client.get(fp, [bad])
        n, got = await client.get_prefix(fp, b)
        assert n == len(b) and torch.equal(got, kv_b)
        assert (await client.lookup(fp, a)).matched_tokens == BLOCK_TOKENS  # the failed block is gone
        assert (await client.stats()).tier("nvme").io_errors == 1


async def test_a_slow_disk_holds_up_write_through_puts_only(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.dram.pool": "private", "tiers.write_policy": "write-through"})
    gate = threading.Event()
    stuck = threading.Event()
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        resident = tokens(2 * BLOCK_TOKENS, seed=3)
        kv = random_kv(SPEC, len(resident), seed=3)
        await client.put(fp, resident, kv)

        def slow(op: str, path: Path) -> None:
            if op == "write":
                stuck.set()
                gate.wait(30)  # the disk takes as long as the test says

        srv.store.tiers[-1].fault_hook = slow
        other = tokens(2 * BLOCK_TOKENS, seed=4)
        put = asyncio.create_task(client.put(fp, other, random_kv(SPEC, len(other), seed=4)))
        await asyncio.to_thread(stuck.wait, 30)
        n, got = await client.get_prefix(fp, resident)  # answered while the put waits on the disk
        assert n == len(resident) and torch.equal(got, kv) and not put.done()
        gate.set()
        assert (await put).stored == 2


async def test_a_block_put_again_while_its_old_file_is_unlinked_keeps_its_new_file(server_factory,  # type: ignore[no-untyped-def]
                                                                                    tmp_path: Path) -> None:
    """An eviction unindexes a block, then unlinks its file on a thread; the worker puts the block again
    meanwhile. The new file goes under the same name: it is written only once the old one is gone, or the
    late unlink takes the new, acknowledged file (on NVMe by the daemon's account, lost at the restart)."""
    nvme_dir = tmp_path / "nvme"
    srv = await server_factory(**{"tiers.nvme.path": str(nvme_dir), "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.dram.pool": "private", "tiers.write_policy": "write-through"})
    nvme = srv.store.tiers[-1]
    toks = tokens(BLOCK_TOKENS, seed=5)
    kv = random_kv(SPEC, len(toks), seed=5)
    unlinking = threading.Event()

    def slow_unlink(op: str, path: Path) -> None:
        if op == "delete":
            unlinking.set()
            time.sleep(0.3)

    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        [key] = (await client.put(fp, toks, kv)).keys
        nvme.fault_hook = slow_unlink
        evict = asyncio.create_task(client.evict(key_prefixes=[key.hex()]))
        await asyncio.to_thread(unlinking.wait, 30)  # unindexed; its file is being unlinked
        again = await client.put(fp, toks, kv)
        assert (again.stored, again.not_durable) == (1, 0)
        assert (await evict).evicted == (key,)
        assert nvme.path_of(key).exists()
    await srv.stop(0)
    srv = await server_factory(**{"tiers.nvme.path": str(nvme_dir), "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.dram.pool": "private", "tiers.write_policy": "write-through"})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        n, got = await client.get_prefix(fp, toks)  # after the restart: from the file
        assert n == len(toks) and torch.equal(got, kv)


# ---- clients that go away or stop reading (raw stubs, to control the stream) ------------------------------


def big_model() -> ModelSpec:
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=256)  # 1 MiB blocks
    return ModelSpec(name="big", weights_id="w", layout=layout, codec="raw")


async def test_a_client_that_disconnects_mid_put_leaves_nothing_behind(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.dram.pool": "private", "tiers.write_policy": "write-through"})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
    toks = tokens(2 * BLOCK_TOKENS, seed=5)
    kv = random_kv(SPEC, len(toks), seed=5)
    first = encode(kv[:, :, :BLOCK_TOKENS], RAW)
    second = encode(kv[:, :, BLOCK_TOKENS:], RAW)
    sent = asyncio.Event()

    async def stream() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace=NS, model_fingerprint=fp))
        for i, payload in enumerate((first, second)):
            h = pb.BlockHeader(tokens=toks[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS].tolist(), dtype=pb.DTYPE_BF16,
                               shape=list(SPEC.layout.block_shape(BLOCK_TOKENS)), payload_nbytes=len(payload),
                               checksum=checksum(payload))
            if i == 0:
                yield pb.PutRequest(chunk=pb.BlockChunk(header=h, data=payload, last=True))
            else:
                yield pb.PutRequest(chunk=pb.BlockChunk(header=h, data=payload[: len(payload) // 2], last=False))
        sent.set()
        await asyncio.Event().wait()  # then the client goes away

    async with grpc.aio.insecure_channel(srv.address) as ch:
        call = pb_grpc.EngramStub(ch).Put(stream())
        await sent.wait()
        for _ in range(100):
            if len(srv.store) == 1:
                break
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    for _ in range(100):  # the handler notices the cancellation
        if not srv.store._pending:
            break
        await asyncio.sleep(0.01)
    assert len(srv.store) == 1 and not srv.store._pending and srv.store.placement.busy == 0
    assert sum(srv.store._quota_pending.values()) == 0
    assert len(list((tmp_path / "nvme" / "blocks").rglob("*.blk"))) == 1 and not list((tmp_path / "nvme" / "tmp").iterdir())
    async with EngramClient(srv.address, namespace=NS) as client:  # the whole chain goes in again
        fp = await client.register_model(SPEC)
        result = await client.put(fp, toks, kv)
        assert result.skipped + result.stored == 2
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)


async def test_a_client_that_never_reads_its_get_stream_holds_a_bounded_read_ahead(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.dram.capacity": "80MiB", "tiers.dram.pool": "private",
                                  "server.chunk_bytes": "1MiB"})
    spec = big_model()
    n_blocks = 48
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(spec)
        toks = tokens(n_blocks * 256, seed=6)
        kv = random_kv(spec, len(toks), seed=6)
        keys = (await client.put(fp, toks, kv)).keys
    async with grpc.aio.insecure_channel(srv.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        call = pb_grpc.EngramStub(ch).Get(pb.GetRequest(namespace=NS, model_fingerprint=fp, keys=list(keys)))
        first = await call.read()
        assert first.chunk.key == keys[0]
        served = []
        for _ in range(20):  # the client reads nothing more for 2 s
            await asyncio.sleep(0.1)
            served.append(srv.store.counters.blocks_served)
        assert served[-1] == served[-5], "the daemon kept reading blocks for a client that reads nothing"
        assert served[-1] <= n_blocks // 2, f"{served[-1]} of {n_blocks} 1 MiB blocks read ahead"
        assert srv.store.placement.busy == n_blocks  # the whole request is leased while it is open
        call.cancel()
    for _ in range(100):
        if srv.store.placement.busy == 0:
            break
        await asyncio.sleep(0.01)
    assert srv.store.placement.busy == 0 and all(m.leases == 0 for m in srv.store.blocks())
    _ = np


async def test_a_client_that_disconnects_mid_get_releases_its_leases(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.dram.capacity": 64 * BLOCK, "tiers.dram.pool": "private"})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        toks = tokens(8 * BLOCK_TOKENS, seed=7)
        keys = (await client.put(fp, toks, random_kv(SPEC, len(toks), seed=7))).keys
    async with grpc.aio.insecure_channel(srv.address) as ch:
        call = pb_grpc.EngramStub(ch).Get(pb.GetRequest(namespace=NS, model_fingerprint=fp, keys=list(keys)))
        await call.read()
        call.cancel()
    for _ in range(100):
        if srv.store.placement.busy == 0:
            break
        await asyncio.sleep(0.01)
    assert srv.store.placement.busy == 0 and all(m.leases == 0 for m in srv.store.blocks())


# ---- out of memory during replay (the CPU path of what the H200 run checks on the GPU) ---------------------


async def test_out_of_memory_during_replay_is_a_miss_and_the_daemon_goes_on(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern, save_decoder
    from engram.replay.runtime import model_spec_for

    model = HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=8, dtype=torch.float32, seed=3))
    path = tmp_path / "replay.safetensors"
    save_decoder(model, path)
    srv = await server_factory(**{"replay.models": str(path), "tiers.dram.capacity": "4MiB",
                                  "tiers.dram.pool": "private"})
    runtime = srv.sessions.runtime
    real = runtime.rebuild
    calls = {"n": 0}

    def oom_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            # What CUDA raises; raised inside the runtime's own handling, as a replay on the GPU would.
            def boom(*a, **k):  # type: ignore[no-untyped-def]
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            import engram.replay.runtime as rt
            saved = rt.reconstruct_swa
            rt.reconstruct_swa = boom  # type: ignore[assignment]
            try:
                return real(*args, **kwargs)
            finally:
                rt.reconstruct_swa = saved  # type: ignore[assignment]
        return real(*args, **kwargs)

    runtime.rebuild = oom_once  # type: ignore[method-assign]
    toks = np.random.default_rng(0).integers(0, 256, 40, dtype=np.int32)
    res = model.prefill(torch.as_tensor(toks, dtype=torch.long), logits=False)
    kv = torch.stack([torch.stack((k, v)) for k, v in res.global_kv])
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(model_spec_for(model, block_tokens=16, codec="raw"))
        await client.put(fp, toks, kv)
        sid = (await client.open_session(fp, mode="exact", tokens=toks)).session_id
        with pytest.raises(errors.ResourceExhausted, match="ran out of memory"):
            await client.resume_kv(fp, sid)
        r, _ = await client.resume_kv(fp, sid)  # the next one replays
        assert r.source == "replay" and r.position == len(toks)
        assert (await client.stats()).replay.replays == 1


def _fill_gpu() -> list[torch.Tensor]:
    """Take every byte of free device memory: large chunks first, then 2 MiB, then the small pool's 512-byte
    ones, until even a tiny allocation fails (the caching allocator has nothing free left to hand out)."""
    hog: list[torch.Tensor] = []
    for size in (1 << 30, 1 << 26, 1 << 21, 1 << 16, 512):
        for _ in range(1 << 16):
            try:
                hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    return hog


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
async def test_a_real_cuda_out_of_memory_during_replay_is_a_miss_and_the_daemon_goes_on(
        server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same promise as above with nothing faked: the daemon's replay model on the GPU, the device filled
    by another user of it (this test) so the replay's own allocations fail in CUDA."""
    from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern, save_decoder
    from engram.replay.runtime import model_spec_for

    model = HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=8, dtype=torch.float32, seed=3))
    path = tmp_path / "replay.safetensors"
    save_decoder(model, path)
    srv = await server_factory(**{"replay.models": str(path), "replay.device": "cuda", "tiers.dram.pool": "private"})
    toks = np.random.default_rng(0).integers(0, 256, 40, dtype=np.int32)
    res = model.prefill(torch.as_tensor(toks, dtype=torch.long), logits=False)
    kv = torch.stack([torch.stack((k, v)) for k, v in res.global_kv])
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(model_spec_for(model, block_tokens=16, codec="raw"))
        await client.put(fp, toks, kv)
        sid = (await client.open_session(fp, mode="exact", tokens=toks)).session_id
        hog = _fill_gpu()
        try:
            with pytest.raises(errors.ResourceExhausted, match="ran out of memory"):
                await client.resume_kv(fp, sid)
            assert (await client.lookup(fp, toks)).matched_tokens == len(toks)  # the daemon goes on
        finally:
            del hog
            torch.cuda.empty_cache()
        r, _ = await client.resume_kv(fp, sid)  # with memory back, the next Resume replays
        assert r.source == "replay" and r.position == len(toks)
        assert (await client.stats()).replay.replays == 1


async def test_blocks_received_and_not_stored_yet_count_against_the_quota(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Put streams that announce a block and send half of it kept those buffers outside the quota (four half-sent
    32 MiB blocks grew the daemon 160 MiB past a 40 MiB quota, an audit): a block being received holds its bytes
    of the quota until it is stored, and a stream cut midway gives them back."""
    srv = await server_factory(**{"auth.tenants.t.token": "tok", "auth.tenants.t.quota": 3 * BLOCK,
                                  "auth.salt_secret": "s"})
    async with EngramClient(srv.address, token="tok", namespace="t") as client:
        fp = await client.register_model(SPEC)
    meta = (("authorization", "Bearer tok"),)
    holding = 0

    def half_sent(seed: int) -> AsyncIterator[pb.PutRequest]:
        toks = tokens(BLOCK_TOKENS, seed=seed)
        payload = encode(random_kv(SPEC, BLOCK_TOKENS, seed=seed), RAW)

        async def stream() -> AsyncIterator[pb.PutRequest]:
            nonlocal holding
            yield pb.PutRequest(header=pb.PutHeader(namespace="t", model_fingerprint=fp))
            h = pb.BlockHeader(tokens=toks.tolist(), dtype=pb.DTYPE_BF16, payload_nbytes=len(payload),
                               shape=list(SPEC.layout.block_shape(BLOCK_TOKENS)), checksum=checksum(payload))
            yield pb.PutRequest(chunk=pb.BlockChunk(header=h, data=payload[: len(payload) // 2], last=False))
            holding += 1
            await asyncio.Event().wait()  # the rest never comes

        return stream()

    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = pb_grpc.EngramStub(ch)
        calls = [stub.Put(half_sent(seed), metadata=meta) for seed in range(3)]
        for _ in range(500):
            if holding == 3 and sum(srv.store._held.values()) >= 3 * BLOCK:
                break
            await asyncio.sleep(0.01)
        fourth = stub.Put(half_sent(3), metadata=meta)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(fourth, 10)  # (it waited for the rest of its block, unrefused)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in (refused.value.details() or "")
        for call in calls:
            call.cancel()
    for _ in range(200):  # the handlers notice the cancellations
        if not srv.store._held:
            break
        await asyncio.sleep(0.01)
    assert not srv.store._held
    async with EngramClient(srv.address, token="tok", namespace="t") as client:  # the quota is whole again
        await client.register_model(SPEC)
        toks = tokens(3 * BLOCK_TOKENS, seed=9)
        assert (await client.put(fp, toks, random_kv(SPEC, len(toks), seed=9))).stored == 3
