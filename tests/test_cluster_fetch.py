"""What a Get of keys another daemon holds costs, with a real redis-server and real daemons: daemon B copies a
chain it lacks from daemon A in a few FetchBlocks calls, parents first, each block stored as it arrives (its
memory does not grow with the chain), within cluster.max_fetch_blocks (past it: NOT_FOUND at once, nothing
copied), and stops when the data-channel client that asked has gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from engram import errors
from engram.client import EngramClient
from engram.config import load_config
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import RunningServer, start_server
from engram.trust import ClusterTrust
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire.channel import open_channel, stub_for

from helpers import (
    BLOCK_TOKENS,
    ENGRAM,
    LEAST_ROOM,
    NEUTRAL_CWD,
    free_port,
    long_block_model,
    random_kv,
    rpcs_served,
    tiny_model,
    tokens,
    until,
    wait_for,
)

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

CLUSTER = {"cluster.heartbeat_s": 0.2, "cluster.ttl_s": 10.0, "cluster.secret": "cluster-secret"}


async def daemon(redis_port: int, name: str, **overrides: Any) -> RunningServer:
    cfg = load_config(env={}, overrides={"server.port": 0, "tiers.dram.capacity": "64MiB", "server.metrics_port": -1,
                                         "cluster.redis_url": f"redis://127.0.0.1:{redis_port}/0",
                                         "cluster.node_id": name, **CLUSTER, **overrides})
    return await start_server(cfg)


@contextlib.asynccontextmanager
async def daemons(redis_port: int, **b_overrides: Any) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    a = await daemon(redis_port, "a")
    try:
        b = await daemon(redis_port, "b", **b_overrides)
        try:
            yield a, b
        finally:
            await b.stop(0)
    finally:
        await a.stop(0)


@contextlib.contextmanager
def daemon_process(redis_port: int, name: str, **sets: Any) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A real `engram serve` subprocess in the cluster (its memory is its own to measure, its process to stop)."""
    port = free_port()
    settings = {"server.host": "127.0.0.1", "server.port": port, "tiers.dram.prefault": "false",
                "tiers.dram.pin": "false", "cluster.redis_url": f"redis://127.0.0.1:{redis_port}/0",
                "cluster.node_id": name, **CLUSTER, **sets}
    args = [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]
    proc = subprocess.Popen([*ENGRAM, "serve", "--log-level", "warning", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=NEUTRAL_CWD)
    address = f"127.0.0.1:{port}"
    try:
        wait_for(address, proc, timeout=60)
        yield address, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def data_gets(srv: RunningServer, code: str) -> float:
    assert srv.metrics is not None
    return srv.metrics.registry.get_sample_value("engram_data_requests_total", {"op": "get", "code": code}) or 0.0


async def joined(*clients: EngramClient) -> None:
    async def ok() -> bool:
        return all([(await c.stats()).cluster.live_nodes == len(clients) for c in clients])

    await until(ok, "the daemons joined the cluster")


async def _a_chain_b_lacks(redis_port: int, a: EngramClient, b: EngramClient, spec: Any, *, seed: int,
                           n_blocks: int = 300) -> tuple[bytes, Any, Any, list[bytes]]:
    """Both daemons joined and knowing the model; a chain of n_blocks put through A and published:
    (fingerprint, tokens, KV, keys)."""
    fp = await a.register_model(spec)
    await b.register_model(spec)
    await joined(a, b)
    toks = tokens(n_blocks * spec.layout.block_tokens, seed=seed)
    kv = random_kv(spec, len(toks), seed=seed)
    keys = list((await a.put(fp, toks, kv)).keys)
    await until(lambda: _held_in_redis(redis_port, keys[-1]), "A's last block published")
    return fp, toks, kv, keys


async def b_copied_the_chain(a: EngramClient, b: EngramClient, fp: bytes, keys: list[bytes]) -> None:
    """B's Get of the chain's last four blocks (300 that only A held) answers A's bytes, every block copied from A and
    none failed."""
    got = await b.get(fp, keys[-4:])
    assert all(torch.equal(x, y) for x, y in zip(got, await a.get(fp, keys[-4:]), strict=True))
    stats = (await b.stats()).cluster
    assert stats.remote_hits == 300 and stats.remote_failures == 0


async def test_a_get_of_keys_deep_in_a_peers_chain_copies_the_chain_once_in_a_few_calls(redis_port: int) -> None:
    """Main fetched every key's ancestors one FetchBlocks at a time, up to 256, then dropped them all when the
    chain was deeper: a Get of 4 keys 300 blocks deep made ~1,024 calls and answered NOT_FOUND."""
    async with daemons(redis_port) as (a_srv, b_srv):
        spec = tiny_model()
        async with EngramClient(a_srv.address, namespace="ns") as a, \
                EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
            fp, toks, kv, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=1)
            before = rpcs_served(a_srv, "FetchBlocks")
            got = await b.get(fp, keys[-4:])
            calls = rpcs_served(a_srv, "FetchBlocks") - before
            assert all(torch.equal(x, y) for x, y in zip(got, await a.get(fp, keys[-4:]), strict=True))
            # One call lists the ancestors B lacks, then ceil(300 / 128) calls copy them: not one per block.
            assert calls <= 6, calls
            assert (await b.stats()).cluster.remote_hits == 300
            assert len(await b.get(fp, keys)) == 300  # the whole chain is B's now: no more calls
            assert rpcs_served(a_srv, "FetchBlocks") - before == calls
            n, prefix = await b.get_prefix(fp, toks)
            assert n == len(toks) and prefix is not None and torch.equal(prefix, kv)


async def test_a_get_of_a_chain_deeper_than_the_holders_request_limit_lists_its_ancestors_in_several_calls(
        redis_port: int) -> None:
    """The holder's server.max_blocks_per_request (200) is below the chain's depth (300): its answer to the ancestors
    of the Get's deepest key stopped at 200, and B took the 200th for the root's child, the chain's first key failing
    its hash under the root: the Get was NOT_FOUND "no live peer of the cluster supplied it", and A was counted as a
    failed peer (an audit, session 52). A holder's list cut by its own limit says so, and B asks on from its end."""
    a_srv = await daemon(redis_port, "a", **{"server.max_blocks_per_request": 200})
    try:
        b_srv = await daemon(redis_port, "b")
        try:
            spec = tiny_model()
            async with EngramClient(a_srv.address, namespace="ns") as a, \
                    EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
                fp, toks, kv, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=5)
                await b_copied_the_chain(a, b, fp, keys)
                n, prefix = await b.get_prefix(fp, toks)
                assert n == len(toks) and prefix is not None and torch.equal(prefix, kv)
        finally:
            await b_srv.stop(0)
    finally:
        await a_srv.stop(0)


async def test_a_get_copies_a_chain_from_a_holder_whose_request_limit_is_below_the_fetch_batch(
        redis_port: int) -> None:
    """The holder's server.max_blocks_per_request (50) is below the 128 keys B asked for a call: A refused each copy
    (RESOURCE_EXHAUSTED, counted as A's failure) and B's Get was NOT_FOUND. The holder's answer to the ancestors
    says its limit, and B asks for no more keys a call than that: ceil(300 / 50) copies, not one per block."""
    a_srv = await daemon(redis_port, "a", **{"server.max_blocks_per_request": 50})
    try:
        b_srv = await daemon(redis_port, "b")
        try:
            spec = tiny_model()
            async with EngramClient(a_srv.address, namespace="ns") as a, \
                    EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
                fp, toks, kv, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=6)
                before = rpcs_served(a_srv, "FetchBlocks")
                got = await b.get(fp, keys[-4:])
                calls = rpcs_served(a_srv, "FetchBlocks") - before
                assert all(torch.equal(x, y) for x, y in zip(got, await a.get(fp, keys[-4:]), strict=True))
                stats = (await b.stats()).cluster
                assert stats.remote_hits == 300 and stats.remote_failures == 0
                assert calls <= 6 + 6, calls  # 6 lists of at most 50 ancestors, 6 copies of at most 50 blocks
                n, prefix = await b.get_prefix(fp, toks)
                assert n == len(toks) and prefix is not None and torch.equal(prefix, kv)
        finally:
            await b_srv.stop(0)
    finally:
        await a_srv.stop(0)


def fetches_refused(srv: RunningServer) -> float:
    """FetchBlocks calls the daemon refused RESOURCE_EXHAUSTED (a request over its server.max_blocks_per_request)."""
    assert srv.metrics is not None
    return srv.metrics.registry.get_sample_value("engram_rpcs_total", {"method": "FetchBlocks",
                                                                       "code": "RESOURCE_EXHAUSTED"}) or 0.0


async def test_a_get_copies_a_chain_from_an_older_holder_whose_limit_is_below_the_fetch_batch_and_unsaid(
        redis_port: int) -> None:
    """An older holder (before session 53) whose server.max_blocks_per_request (50) is below the 128 keys B asks for
    a call does not say its limit (FetchBlocksResponse.max_keys, field 8): B asked it for 128 keys at every copy, was
    refused every time (RESOURCE_EXHAUSTED) and the Get was NOT_FOUND. B now halves a call's keys while the holder
    refuses one for its size (128, 64, then 32 taken), and asks for no more than that from then on.

    A stands for the older daemon: its answer to the ancestors listing is the one it sends today less max_keys, as
    an Engram from before max_keys sent it (ancestors and ancestors_cut alone), and it refuses a copy of more keys
    than its limit as every Engram has (the same request check, RESOURCE_EXHAUSTED "split the request")."""
    a_srv = await daemon(redis_port, "a", **{"server.max_blocks_per_request": 50})
    try:
        b_srv = await daemon(redis_port, "b")
        try:
            assert a_srv.service is not None
            says_its_limit = a_srv.service._ancestors_answer

            def older(ancestors: list[bytes], cut: bool) -> pb.FetchBlocksResponse:
                answer = says_its_limit(ancestors, cut)
                answer.ClearField("max_keys")
                return answer

            a_srv.service._ancestors_answer = older  # type: ignore[method-assign]
            spec = tiny_model()
            async with EngramClient(a_srv.address, namespace="ns") as a, \
                    EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
                fp, toks, kv, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=16)
                await b_copied_the_chain(a, b, fp, keys)
                assert fetches_refused(a_srv) == 2  # 128 and 64 keys; 32 taken
                n, prefix = await b.get_prefix(fp, toks)
                assert n == len(toks) and prefix is not None and torch.equal(prefix, kv)
                # A second chain: asked for the 32 keys A took, none refused
                toks2 = tokens(100 * spec.layout.block_tokens, seed=17)
                keys2 = list((await a.put(fp, toks2, random_kv(spec, len(toks2), seed=17))).keys)
                await until(lambda: _held_in_redis(redis_port, keys2[-1]), "A's second chain published")
                before = rpcs_served(a_srv, "FetchBlocks")
                assert len(await b.get(fp, keys2[-1:])) == 1
                assert fetches_refused(a_srv) == 2
                assert rpcs_served(a_srv, "FetchBlocks") - before == 2 + 4  # 2 lists of 50 ancestors, 4 copies
        finally:
            await b_srv.stop(0)
    finally:
        await a_srv.stop(0)


async def test_a_peers_fetch_of_blocks_whose_header_passes_the_slack_stays_under_the_message_limit(
        redis_port: int) -> None:
    """Two daemons whose server.max_message_bytes is server.chunk_bytes + 4 KiB (as config allows), B getting a
    chain of A's whose BlockHeaders (4096 tokens) are larger than that 4 KiB: A's first FetchBlocks message of each
    block, chunk_bytes of payload beside the header and the peer's fields, was over its send limit and B's Get
    failed. Each message now stays under the limit and B gets the blocks whole."""
    a_srv = await daemon(redis_port, "a", **LEAST_ROOM)
    try:
        b_srv = await daemon(redis_port, "b", **LEAST_ROOM)
        try:
            spec = long_block_model()
            async with EngramClient(a_srv.address, namespace="ns") as a, \
                    EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
                fp, toks, kv, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=7, n_blocks=2)
                before = rpcs_served(a_srv, "FetchBlocks")
                got = await b.get(fp, keys)
                assert rpcs_served(a_srv, "FetchBlocks") > before  # copied from A, not found at B
                assert torch.equal(torch.cat(got, dim=2), kv)
        finally:
            await b_srv.stop(0)
    finally:
        await a_srv.stop(0)


async def test_a_get_deeper_than_max_fetch_blocks_is_a_quick_not_found_that_copies_nothing(redis_port: int) -> None:
    async with daemons(redis_port, **{"cluster.max_fetch_blocks": 64}) as (a_srv, b_srv):
        spec = tiny_model()
        async with EngramClient(a_srv.address, namespace="ns") as a, \
                EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
            fp, _, _, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=2)
            before = rpcs_served(a_srv, "FetchBlocks")
            with pytest.raises(errors.NotFound, match=r"cluster\.max_fetch_blocks = 64"):
                await b.get(fp, keys[-16:])
            assert rpcs_served(a_srv, "FetchBlocks") - before <= 1  # only the list of ancestors
            assert (await b.stats()).cluster.remote_hits == 0
            await b.get(fp, keys[40:50])  # 50 blocks from the root: within the bound, served
            assert (await b.stats()).cluster.remote_hits == 50


async def test_blocks_a_failed_holder_copied_count_against_the_gets_max_fetch_blocks(redis_port: int) -> None:
    """A and C both hold chains X and Y (60 blocks each); B (cluster.max_fetch_blocks = 100) gets the last key of
    each. Y's first holder has Y's 31st block damaged: it serves 30 blocks and fails, the other holder serves the 30
    left. Main charged only the second holder's 30 against the bound, so X's 60 fit in the 70 it thought left and
    B copied 120 blocks. All 60 of Y count: X is past the bound, NOT_FOUND, nothing of it copied."""
    async with daemons(redis_port, **{"cluster.max_fetch_blocks": 100}) as (a_srv, b_srv):
        c_srv = await daemon(redis_port, "c")
        try:
            spec = tiny_model()
            async with EngramClient(a_srv.address, namespace="ns") as a, \
                    EngramClient(b_srv.address, namespace="ns", data_channel=False) as b, \
                    EngramClient(c_srv.address, namespace="ns") as c:
                fp = await a.register_model(spec)
                await b.register_model(spec)
                await c.register_model(spec)
                await joined(a, b, c)
                chains = []
                for seed in (30, 31):
                    toks = tokens(60 * BLOCK_TOKENS, seed=seed)
                    kv = random_kv(spec, len(toks), seed=seed)
                    keys = list((await a.put(fp, toks, kv)).keys)
                    assert list((await c.put(fp, toks, kv)).keys) == keys
                    await until(lambda k=keys[-1]: _held_in_redis(redis_port, k, holders=2), "A's and C's published")
                    chains.append(keys)
                x, y = chains
                first = {"a": a_srv, "c": c_srv}[await _first_holder(redis_port, y[-1])]
                first.store.placement.tiers[0].view(y[30])[-1] ^= 0x40
                with pytest.raises(errors.NotFound, match=r"cluster\.max_fetch_blocks"):
                    await b.get(fp, [x[-1], y[-1]])
                stats = (await b.stats()).cluster
                assert stats.remote_failures == 1  # Y's first holder
                assert stats.remote_hits == 60, stats.remote_hits  # all of Y, none of X
        finally:
            await c_srv.stop(0)


def _peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))


def mib_model() -> ModelSpec:
    """4 global layers of 8 heads x 128, 64 tokens a block, bf16: 1 MiB a block."""
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=64)
    return ModelSpec(name="mib", weights_id="w", layout=layout, codec="raw")


async def test_a_get_of_a_long_chain_does_not_hold_the_chain_in_memory(redis_port: int) -> None:
    """Main downloaded the whole chain (up to 256 blocks) into memory before storing any of it: 3 Gets of a
    150-block chain of 1 MiB blocks took a daemon with a 32 MiB pool from ~265 to ~751 MiB."""
    a_srv = await daemon(redis_port, "a", **{"tiers.dram.capacity": "200MiB"})
    try:
        with daemon_process(redis_port, "b", **{"tiers.dram.capacity": "32MiB"}) as (b_address, b_proc):
            spec = mib_model()
            async with EngramClient(a_srv.address, namespace="ns", data_channel=False) as a, \
                    EngramClient(b_address, namespace="ns", data_channel=False) as b:
                fp = await a.register_model(spec)
                await b.register_model(spec)
                await joined(a, b)
                toks = tokens(150 * 64, seed=3)
                keys = list((await a.put(fp, toks, random_kv(spec, len(toks), seed=3))).keys)
                await until(lambda: _held_in_redis(redis_port, keys[-1]), "A's last block published")
                rss = _peak_rss_mib(b_proc.pid)

                async def get(key: bytes) -> str:
                    try:
                        await b.get(fp, [key])
                    except errors.EngramError as exc:
                        return type(exc).__name__
                    return "ok"

                outcomes = await asyncio.gather(*(get(keys[-1 - i]) for i in range(3)))
                grown = _peak_rss_mib(b_proc.pid) - rss
                # The chain cannot fit B's pool: NOT_FOUND, with at most a few blocks in flight at a time
                # (gRPC's buffers included), not 3 x 150 MiB.
                assert outcomes == ["NotFound"] * 3, outcomes
                assert grown < 200, f"B's peak RSS grew {grown} MiB"
                # A full pool is not the peer's failure (main counted each such block as one, "did not verify")
                assert (await b.stats()).cluster.remote_failures == 0
    finally:
        await a_srv.stop(0)


async def test_a_peer_fetch_stops_when_the_data_channel_client_goes(redis_port: int) -> None:
    """A (a real process) is stopped (SIGSTOP), so B's copy from it waits out cluster.fetch_timeout_s (60 s); the
    client gives up after a second and closes its connection: B's Get ends then (CANCELLED), not a minute later
    (main went on fetching for the client that had gone)."""
    b_srv = await daemon(redis_port, "b", **{"server.data_channel": True, "cluster.fetch_timeout_s": 60.0})
    try:
        with daemon_process(redis_port, "a") as (a_address, a_proc):
            spec = tiny_model()
            async with EngramClient(a_address, namespace="ns", data_channel=False) as a:
                fp = await a.register_model(spec)
                b = EngramClient(b_srv.address, namespace="ns", data_channel=True, zero_copy=False)
                await b.register_model(spec)
                await joined(a, b)
                toks = tokens(8 * BLOCK_TOKENS, seed=4)
                keys = list((await a.put(fp, toks, random_kv(spec, len(toks), seed=4))).keys)
                await until(lambda: _held_in_redis(redis_port, keys[-1]), "A's last block published")
                await b.get(fp, keys[:1])  # B's channel to A is open (a new one would fail to connect at once)
                os.kill(a_proc.pid, signal.SIGSTOP)
                get = asyncio.create_task(b.get(fp, keys))
                await asyncio.sleep(1.0)
                assert not get.done()
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await get
                await b.close()

                async def ended() -> bool:
                    return data_gets(b_srv, "CANCELLED") == 1

                await until(ended, "B's Get ended when its client went", timeout=10.0)
                os.kill(a_proc.pid, signal.SIGCONT)
    finally:
        await b_srv.stop(0)


class StoppedHolder:
    """B (this process) beside A (a real process), joined: an 8-block chain put through A, its last block published
    in Redis, B holding the first block with its channel to A open (a new one would fail to connect at once); A is
    then stopped (SIGSTOP) until the rig ends. b: B's client; fp, toks, kv, keys: the chain."""

    srv: RunningServer
    b: EngramClient
    fp: bytes
    toks: Any
    kv: torch.Tensor
    keys: list[bytes]


@contextlib.asynccontextmanager
async def a_stopped_holding_a_chain(redis_port: int, seed: int, b_sets: dict[str, Any],
                                    **b_client: Any) -> AsyncIterator[StoppedHolder]:
    rig = StoppedHolder()
    rig.srv = await daemon(redis_port, "b", **b_sets)
    try:
        with daemon_process(redis_port, "a") as (a_address, a_proc):
            spec = tiny_model()
            async with EngramClient(a_address, namespace="ns", data_channel=False) as a, \
                    EngramClient(rig.srv.address, namespace="ns", **{"data_channel": False, **b_client}) as b:
                rig.b, rig.fp = b, await a.register_model(spec)
                await b.register_model(spec)
                await joined(a, b)
                rig.toks = tokens(8 * BLOCK_TOKENS, seed=seed)
                rig.kv = random_kv(spec, len(rig.toks), seed=seed)
                rig.keys = list((await a.put(rig.fp, rig.toks, rig.kv)).keys)
                await until(lambda: _held_in_redis(redis_port, rig.keys[-1]), "A's last block published")
                await b.get(rig.fp, rig.keys[:1])  # B holds the first block, and its channel to A is open
                os.kill(a_proc.pid, signal.SIGSTOP)
                try:
                    yield rig
                finally:
                    os.kill(a_proc.pid, signal.SIGCONT)
    finally:
        await rig.srv.stop(0)


async def test_a_fill_from_a_stopped_peer_ends_at_its_overall_bound_not_each_blocks(redis_port: int) -> None:
    """A (a real process) is stopped (SIGSTOP) with each block given cluster.fetch_timeout_s = 60 s: B's Get of A's
    chain waited a minute a block, up to cluster.max_fetch_blocks of them, its client cut by its own stall bound
    (10 s here) without a word of why. The copying has one bound in all, cluster.fill_timeout_s (1 s here): the Get
    is DEADLINE_EXCEEDED saying so, and a Lookup answers what B holds."""
    async with a_stopped_holding_a_chain(redis_port, 12, {"cluster.fetch_timeout_s": 60.0,
                                                          "cluster.fill_timeout_s": 1.0}, timeout_s=10.0) as rig:
        with pytest.raises(errors.DeadlineExceeded, match=r"cluster\.fill_timeout_s \(1 s\)"):
            await rig.b.get(rig.fp, rig.keys)
        assert (await rig.b.lookup(rig.fp, rig.toks)).matched_tokens == BLOCK_TOKENS  # the block B holds


@pytest.mark.parametrize("data_channel", [True, False], ids=["data_channel", "grpc"])
async def test_a_gets_fill_from_a_stopped_peer_ends_before_its_client_gives_up_and_says_why(
        redis_port: int, data_channel: bool) -> None:
    """A (a real process) is stopped (SIGSTOP); B's copying has cluster.fill_timeout_s 60 s, and B's client waits 4 s
    (its timeout_s) for a Get's answer to begin. The data channel carries no deadline, and EngramClient's gRPC Get
    sets none (its bound is a stall bound): B copied on for the client that had given up, which said only that the
    daemon seemed hung ("did not go on with the data channel's bytes"). The client now says how long it waits
    (GetRequest.answer_within_ms), and B ends its copying in time to answer DEADLINE_EXCEEDED saying why; the
    client goes on using the same channel."""
    async with a_stopped_holding_a_chain(redis_port, 18, {"server.data_channel": True, "cluster.fetch_timeout_s": 60.0,
                                                          "cluster.fill_timeout_s": 60.0},
                                         data_channel=data_channel, zero_copy=False, timeout_s=4.0) as rig:
        with pytest.raises(errors.DeadlineExceeded, match="copying of blocks it lacks from the cluster's "
                                                          "peers ran past the call's deadline"):
            await rig.b.get(rig.fp, rig.keys)
        if data_channel:
            assert data_gets(rig.srv, "DEADLINE_EXCEEDED") == 1 and data_gets(rig.srv, "CANCELLED") == 0
        assert len(await rig.b.get(rig.fp, rig.keys[:1])) == 1  # the block B holds, on the same channel


async def test_a_lookup_whose_fill_runs_to_its_callers_deadline_still_answers_what_is_held(redis_port: int) -> None:
    """A (a real process) is stopped (SIGSTOP); B's fill has cluster.fill_timeout_s 60 s, and the caller's own gRPC
    deadline (4 s: any gRPC client, the C++ and Go ones) is the sooner bound. The fill ran to that very deadline,
    so the Lookup's answer of the block B holds came after it: the caller got DEADLINE_EXCEEDED, no answer at all,
    where a shorter match is a right one (a review, session 53). The fill now ends a little before the deadline
    (ANSWER_MARGIN_S, or a quarter of the time the call has), leaving the answer its time."""
    async with a_stopped_holding_a_chain(redis_port, 14, {"cluster.fetch_timeout_s": 60.0,
                                                          "cluster.fill_timeout_s": 60.0}) as rig:
        channel = open_channel(rig.srv.address)
        try:
            req = pb.LookupRequest(namespace="ns", model_fingerprint=rig.fp, tokens=convert.tokens_to_pb(rig.toks))
            answer = await stub_for(channel).Lookup(req, timeout=4.0)
            assert answer.matched_tokens == BLOCK_TOKENS
        finally:
            await channel.close()


@pytest.mark.parametrize("call", ["lookup", "get_prefix"])
async def test_an_engram_clients_lookup_and_load_whose_fill_waits_on_a_stopped_peer_answer_what_is_held_in_time(
        redis_port: int, call: str) -> None:
    """A (a real process) is stopped (SIGSTOP); B's fill has cluster.fill_timeout_s 60 s, and B's EngramClient waits
    4 s (its timeout_s). A raw gRPC caller's deadline bounds B's fill (the test above), but EngramClient sent none
    with its unary calls (its bound was its own, and a GetPrefix's gRPC deadline is its grant's, far past it): B
    filled on for 60 s and the client gave up first, DeadlineExceeded, where B would have answered the block it
    holds. The client's Lookup now carries its timeout_s as its gRPC deadline, and its GetPrefix says it
    (GetPrefixRequest.answer_within_ms): each answers B's one block before the client gives up."""
    async with a_stopped_holding_a_chain(redis_port, 15, {"cluster.fetch_timeout_s": 60.0,
                                                          "cluster.fill_timeout_s": 60.0}, timeout_s=4.0) as rig:
        if call == "lookup":  # the outer bound only keeps a hang from holding the test
            assert (await asyncio.wait_for(rig.b.lookup(rig.fp, rig.toks), 30)).matched_tokens == BLOCK_TOKENS
        else:
            n, got = await asyncio.wait_for(rig.b.get_prefix(rig.fp, rig.toks), 30)
            assert n == BLOCK_TOKENS and torch.equal(got, rig.kv[:, :, :BLOCK_TOKENS])


async def test_a_lookup_cancelled_by_its_client_stops_copying_its_prefix_from_peers(redis_port: int) -> None:
    """B's Lookups of 300-block prefixes only A holds (a fill copies one block a call, each after a Redis read of
    its holders), each cancelled by its client once B has copied a few of its blocks: B's Lookup ends there. A
    cancel that lands as redis-py sends a command is dropped (it sends under asyncio.wait_for, which on Python 3.11
    returns the send's result instead: CPython gh-86296): main's fill went on for the client that had left, to the
    prefix's last block (about half the cancels here, each then copying all 300)."""
    async with daemons(redis_port) as (a_srv, b_srv):
        spec = tiny_model()
        async with EngramClient(a_srv.address, namespace="ns") as a, \
                EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
            fp = await a.register_model(spec)
            await b.register_model(spec)
            await joined(a, b)
            for attempt, after in enumerate((1, 2, 3, 5, 7, 9)):
                toks = tokens(300 * BLOCK_TOKENS, seed=40 + attempt)
                keys = list((await a.put(fp, toks, random_kv(spec, len(toks), seed=40 + attempt))).keys)
                await until(lambda k=keys[-1]: _held_in_redis(redis_port, k), "A's last block published")
                held, lookups = len(b_srv.store.index), rpcs_served(b_srv, "Lookup")
                lookup = asyncio.create_task(b.lookup(fp, toks))
                while len(b_srv.store.index) < held + after and not lookup.done():
                    await asyncio.sleep(0.001)
                lookup.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await lookup

                async def ended(lookups: float = lookups) -> bool:
                    return rpcs_served(b_srv, "Lookup") > lookups

                await until(ended, "B's Lookup ended")
                copied = len(b_srv.store.index) - held
                assert copied < 150, f"cancelled once B had copied {after}, B's Lookup copied {copied} of 300 blocks"


async def test_long_lookups_waiting_on_a_frozen_peer_wait_together_not_in_turn(redis_port: int) -> None:
    """B's Lookups of two long prefixes (300 blocks: past a slice, so each takes its tenant's turn for its walk,
    engram/loopturns.py) whose blocks only A holds, A stopped (SIGSTOP): each waits cluster.fetch_timeout_s (4 s)
    for A. They wait together: the turn is for the walk's Python work, not the peer's answer. Holding it across
    the fetch (a review, session 48) ended them one timeout apart (4 calls: 5, 10, 15, 15 s); with tenancy off
    every caller's long calls share one turn."""
    b_srv = await daemon(redis_port, "b", **{"cluster.fetch_timeout_s": 4.0})
    try:
        with daemon_process(redis_port, "a") as (a_address, a_proc):
            spec = tiny_model()
            async with EngramClient(a_address, namespace="ns", data_channel=False) as a, \
                    EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
                fp = await a.register_model(spec)
                await b.register_model(spec)
                await joined(a, b)
                chains = [tokens(300 * BLOCK_TOKENS, seed=20 + i) for i in range(2)]
                keys = [list((await a.put(fp, t, random_kv(spec, len(t), seed=20 + i))).keys)
                        for i, t in enumerate(chains)]
                for k in keys:
                    await until(lambda k=k: _held_in_redis(redis_port, k[-1]), "A's last block published")
                await b.get(fp, keys[0][:1])  # B's channel to A is open (a new one would fail to connect at once)
                os.kill(a_proc.pid, signal.SIGSTOP)
                loop = asyncio.get_running_loop()

                async def lookup(t: Any) -> float:
                    await b.lookup(fp, t)
                    return loop.time()

                ended = sorted(await asyncio.gather(*(lookup(t) for t in chains)))
                os.kill(a_proc.pid, signal.SIGCONT)
                assert ended[1] - ended[0] < 2.0, f"the second ended {ended[1] - ended[0]:.1f} s after the first"
    finally:
        await b_srv.stop(0)


async def _held_in_redis(port: int, key: bytes, holders: int = 1) -> bool:
    proc = await asyncio.create_subprocess_exec("redis-cli", "-p", str(port), "hlen", "engram:block:{" + key.hex() + "}",
                                                stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.strip() == str(holders).encode()


async def _first_holder(port: int, key: bytes) -> str:
    """The node whose entry a reader of `key`'s holders meets first (the hash's order), so asks first."""
    proc = await asyncio.create_subprocess_exec("redis-cli", "-p", str(port), "hkeys", "engram:block:{" + key.hex() + "}",
                                                stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.split()[0].decode()


def _as_an_older_daemon_wrote_them(port: int, node: str, keys: list[bytes]) -> None:
    """Rewrite `node`'s holder entries of `keys` as a daemon from before namespace tags writes them (`tier@boot`,
    signed, no tag): a rolling upgrade's not yet upgraded holder."""
    import redis

    trust = ClusterTrust(CLUSTER["cluster.secret"].encode())
    r = redis.Redis(port=port)
    try:
        for key in keys:
            name = "engram:block:{" + key.hex() + "}"
            entry = trust.holder_entry(key, node, r.hget(name, node).decode())
            assert entry is not None and entry.tag is not None
            r.hset(name, node, trust.holder_record(key, node, entry.tier, entry.size, entry.checksum, entry.boot))
    finally:
        r.close()


async def test_without_tenancy_a_get_copies_blocks_only_an_older_daemon_holds(redis_port: int) -> None:
    """A rolling upgrade: A's entries as a daemon from before namespace tags writes them. A Get through B skipped
    untagged entries and missed (NOT_FOUND) until A was upgraded: such an entry may be another namespace's, and
    asking its holder tells a tenant by the time that the key exists there. Without tenancy every caller may name
    any namespace and Get the key there itself, so B reads them; A's FetchBlocks serves only the namespace asked
    for (another's key is absent, and the MAC binds the namespace). With tenancy a Get still skips them
    (test_cluster_trust.py, ARCHITECTURE.md)."""
    async with daemons(redis_port) as (a_srv, b_srv):
        spec = tiny_model()
        async with EngramClient(a_srv.address, namespace="ns") as a, \
                EngramClient(b_srv.address, namespace="ns", data_channel=False) as b:
            fp, _, _, keys = await _a_chain_b_lacks(redis_port, a, b, spec, seed=11, n_blocks=4)
            _as_an_older_daemon_wrote_them(redis_port, "a", keys)
            with pytest.raises(errors.NotFound):  # another namespace's Get of them: A has none there
                await b.get(fp, keys[-2:], namespace="other")
            got = await b.get(fp, keys[-2:])
            assert all(torch.equal(x, y) for x, y in zip(got, await a.get(fp, keys[-2:]), strict=True))
            assert (await b.stats()).cluster.remote_hits == 4  # the chain, parents first


async def test_a_lookups_fill_hashes_only_the_blocks_after_its_local_walk(redis_port: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """B holds the first 600 blocks of a prefix (three slices of its walk), A all 604. B's Lookup walks the 600
    here, then fills the other 4 from A. The fill hashed the whole prefix again, in one go on the event loop
    (~140 ms at a million tokens, every other call held meanwhile); it goes on from the walk's last key, hashing
    only the blocks it asks peers for (each, and each block checked as it arrives: 8 keys here, where the whole
    prefix was 608). The answer is the same: the whole prefix, the bytes A and B stored."""
    import engram.keys
    import engram.server.peers

    hashed = 0
    real = engram.keys.block_key

    def counted(parent: bytes, toks: Any) -> bytes:
        nonlocal hashed
        hashed += 1
        return real(parent, toks)

    async with daemons(redis_port) as (a_srv, b_srv):
        spec = tiny_model()
        toks = tokens(604 * BLOCK_TOKENS, seed=30)
        kv = random_kv(spec, len(toks), seed=30)
        local = 600 * BLOCK_TOKENS
        async with EngramClient(a_srv.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b:
            fp = await a.register_model(spec)
            await b.register_model(spec)
            await joined(a, b)
            await b.put(fp, toks[:local], kv[:, :, :local].contiguous())  # first: its put would fill from A
            keys = list((await a.put(fp, toks, kv)).keys)
            await until(lambda: _held_in_redis(redis_port, keys[-1]), "A's last block published")
            monkeypatch.setattr(engram.keys, "block_key", counted)  # what chain_keys calls
            monkeypatch.setattr(engram.server.peers, "block_key", counted)
            assert (await b.lookup(fp, toks)).matched_tokens == len(toks)
            monkeypatch.undo()
            assert hashed <= 8
            n, got = await b.get_prefix(fp, toks)
            assert n == len(toks) and got is not None and torch.equal(got, kv)
            assert (await b.stats()).cluster.remote_hits == 4


async def test_a_lookup_whose_local_match_ends_in_a_sibling_fills_the_querys_own_block(redis_port: int) -> None:
    """B holds blocks 0-3 of A's prefix and, as block 4, a sibling sharing its first half with the query's (a full
    block that matches in part: the walk keeps it at the end of its answer). B's Lookup fills the query's own block
    4, and the rest, from A. The fill counted the sibling as a block held: it skipped block 4 and asked A for
    block 5, whose parent B does not hold (copied, then dropped), and the Lookup matched 4.5 blocks."""
    async with daemons(redis_port) as (a_srv, b_srv):
        spec = tiny_model()
        toks = tokens(8 * BLOCK_TOKENS, seed=31)
        kv = random_kv(spec, len(toks), seed=31)
        sibling = toks[: 5 * BLOCK_TOKENS].copy()
        sibling[-BLOCK_TOKENS // 2 :] += 1
        async with EngramClient(a_srv.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b:
            fp = await a.register_model(spec)
            await b.register_model(spec)
            await joined(a, b)
            await b.put(fp, sibling, kv[:, :, : len(sibling)].contiguous())  # first: its put would fill from A
            keys = list((await a.put(fp, toks, kv)).keys)
            await until(lambda: _held_in_redis(redis_port, keys[-1]), "A's last block published")
            assert (await b.lookup(fp, toks)).matched_tokens == len(toks)
            n, got = await b.get_prefix(fp, toks)
            assert n == len(toks) and got is not None and torch.equal(got, kv)
            assert (await b.stats()).cluster.remote_hits == 4
