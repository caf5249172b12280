"""Put / Lookup / Get through a real daemon over loopback TCP and over a unix socket."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
import torch

from engram import errors
from engram.client import EngramClient
from engram.layout import DType

from helpers import BLOCK_TOKENS, LEAST_ROOM, long_block_model, random_kv, rpcs_answered, tiny_model, tokens


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16, DType.FP32])
async def test_put_lookup_get_is_bit_exact(client: EngramClient, dtype: DType) -> None:
    spec = tiny_model(dtype)
    fp = await client.register_model(spec)
    toks = tokens(5 * BLOCK_TOKENS)
    kv = random_kv(spec, len(toks), seed=1)
    put = await client.put(fp, toks, kv)
    assert put.stored == 5 and put.skipped == 0
    hit = await client.lookup(fp, toks)
    assert hit.matched_tokens == len(toks)
    assert [b.key for b in hit.blocks] == list(put.keys)
    got = await client.get(fp, [b.key for b in hit.blocks])
    assert all(g.dtype == dtype.torch_dtype for g in got)
    assert torch.equal(torch.cat(got, dim=2), kv)  # bitwise: torch.equal on identical dtypes


async def test_second_session_with_shared_prefix_hits(client: EngramClient) -> None:
    spec = tiny_model()
    fp = await client.register_model(spec)
    shared = tokens(6 * BLOCK_TOKENS, seed=7)
    a = np.concatenate([shared, tokens(40, seed=1)])
    b = np.concatenate([shared, tokens(40, seed=2)])
    kv_a = random_kv(spec, len(a), seed=1)
    await client.put(fp, a, kv_a)

    n, kv_hit = await client.get_prefix(fp, b)
    assert n == len(shared)
    assert kv_hit is not None and torch.equal(kv_hit, kv_a[:, :, : len(shared)])

    kv_b = torch.cat([kv_hit, random_kv(spec, len(b) - n, seed=2)], dim=2)
    put_b = await client.put(fp, b, kv_b)
    assert put_b.skipped == 6  # the shared blocks were not sent again
    assert put_b.stored == 3  # 40 own tokens = 2 full blocks + a partial of 8
    stats = await client.stats()
    assert stats.models[0].blocks == 6 + 3 + 3


async def test_partial_last_block_round_trips_and_serves_common_prefixes(client: EngramClient) -> None:
    spec = tiny_model()
    fp = await client.register_model(spec)
    toks = tokens(2 * BLOCK_TOKENS + 5)
    kv = random_kv(spec, len(toks))
    await client.put(fp, toks, kv)

    n, got = await client.get_prefix(fp, toks)
    assert n == len(toks) and got is not None and torch.equal(got, kv)
    # A longer query whose next tokens extend the stored tail still gets the tail (its KV is causal).
    longer = np.concatenate([toks, tokens(30, seed=3)])
    assert (await client.lookup(fp, longer)).matched_tokens == len(toks)
    # A query that diverges inside the tail gets the tokens before the divergence (KV is causal).
    diverged = toks.copy()
    diverged[-1] += 1
    assert (await client.lookup(fp, diverged)).matched_tokens == 2 * BLOCK_TOKENS + 4
    n, got = await client.get_prefix(fp, diverged)
    assert n == 2 * BLOCK_TOKENS + 4 and got is not None and torch.equal(got, kv[:, :, :n])
    # The same inside a full block: a query diverging at token 20 is served tokens [0, 20).
    inside = toks.copy()
    inside[20] += 1
    n, got = await client.get_prefix(fp, inside)
    assert n == 20 and got is not None and torch.equal(got, kv[:, :, :20])
    # And a query shorter than the stored chain gets exactly its length.
    n, got = await client.get_prefix(fp, toks[:7])
    assert n == 7 and got is not None and torch.equal(got, kv[:, :, :7])


async def test_extending_a_partial_block_replaces_it(client: EngramClient) -> None:
    spec = tiny_model()
    fp = await client.register_model(spec)
    toks = tokens(3 * BLOCK_TOKENS)
    kv = random_kv(spec, len(toks))
    await client.put(fp, toks[:40], kv[:, :, :40])  # 2 full + partial of 8
    await client.put(fp, toks, kv)  # the third block is now full
    stats = await client.stats()
    assert stats.models[0].blocks == 3  # the superseded partial was dropped
    n, got = await client.get_prefix(fp, toks)
    assert n == len(toks) and got is not None and torch.equal(got, kv)


async def test_eviction_under_a_small_budget_keeps_recent_prefixes(server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block_bytes = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 8 * block_bytes})
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        seqs = [tokens(4 * BLOCK_TOKENS, seed=s) for s in range(5)]  # 20 blocks into room for 8
        kvs = [random_kv(spec, len(t), seed=s) for s, t in enumerate(seqs)]
        for t, kv in zip(seqs, kvs, strict=True):
            await client.put(fp, t, kv)
        stats = await client.stats()
        dram = stats.tiers[0]
        assert dram.used_bytes <= 8 * block_bytes
        assert dram.blocks == 8 and dram.evictions == 12
        # The two most recent sequences are whole; the oldest is gone.
        for t, kv in zip(seqs[-2:], kvs[-2:], strict=True):
            n, got = await client.get_prefix(fp, t)
            assert n == len(t) and got is not None and torch.equal(got, kv)
        assert (await client.lookup(fp, seqs[0])).matched_tokens == 0


async def test_lru_evicts_a_chain_from_its_tail(server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block_bytes = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 6 * block_bytes})
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        a = tokens(4 * BLOCK_TOKENS, seed=1)
        await client.put(fp, a, random_kv(spec, len(a)))
        b = tokens(4 * BLOCK_TOKENS, seed=2)
        await client.put(fp, b, random_kv(spec, len(b)))  # evicts 2 blocks of a
        # a lost its last two blocks, not its root: a prefix of it is still served.
        assert (await client.lookup(fp, a)).matched_tokens == 2 * BLOCK_TOKENS


async def test_a_probe_answers_as_a_lookup_but_counts_no_use_and_restarts_no_age(server_factory) -> None:  # type: ignore[no-untyped-def]
    # A client's put asks what is cached (a probe), and vLLM's scheduler asks again every step a request
    # waits: counted as uses, such questions told the eviction order of reuse that never happened.
    spec = tiny_model()
    block_bytes = spec.layout.block_nbytes(BLOCK_TOKENS)
    for probe in (True, False):
        srv = await server_factory(**{"tiers.dram.capacity": 8 * block_bytes})
        async with EngramClient(srv.address) as client:
            fp = await client.register_model(spec)
            a, b, c = (tokens(4 * BLOCK_TOKENS, seed=s) for s in (1, 2, 3))
            kv_a = random_kv(spec, len(a), seed=1)
            await client.put(fp, a, kv_a)
            await client.put(fp, b, random_kv(spec, len(b), seed=2))
            before = await client.stats()
            asked = await client.lookup(fp, a, probe=probe)
            assert asked.matched_tokens == len(a) and len(asked.blocks) == 4
            again = await client.put(fp, a, kv_a)  # its own question is a probe: a's blocks are not sent again
            assert (again.skipped, again.stored) == (4, 0)
            after = await client.stats()
            uses = 0 if probe else 4
            assert after.lookups == before.lookups + 2  # both questions are counted as lookups in the stats
            assert after.eviction.comebacks == before.eviction.comebacks + uses
            await client.put(fp, c, random_kv(spec, len(c), seed=3))  # room for 4 more: the 4 oldest go
            kept, gone = (b, a) if probe else (a, b)  # a probe left a's ages as they were: a is the oldest
            assert (await client.lookup(fp, kept, probe=True)).matched_tokens == len(kept)
            assert (await client.lookup(fp, gone, probe=True)).matched_tokens == 0


async def test_pinned_blocks_survive_eviction(server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block_bytes = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 6 * block_bytes})
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        system = tokens(2 * BLOCK_TOKENS, seed=99)
        kv_sys = random_kv(spec, len(system), seed=99)
        put = await client.put(fp, system, kv_sys, pin=True)
        for s in range(6):
            t = tokens(3 * BLOCK_TOKENS, seed=s)
            await client.put(fp, t, random_kv(spec, len(t), seed=s))
        n, got = await client.get_prefix(fp, system)
        assert n == len(system) and got is not None and torch.equal(got, kv_sys)
        stats = await client.stats()
        assert stats.tiers[0].pinned_blocks == 2

        # Unpinned, they become evictable like any block.
        assert await client.pin(fp, list(put.keys), unpin=True) == 2
        for s in range(6, 9):
            t = tokens(3 * BLOCK_TOKENS, seed=s)
            await client.put(fp, t, random_kv(spec, len(t), seed=s))
        assert (await client.lookup(fp, system)).matched_tokens == 0


@pytest.mark.parametrize("path", ["bytes", "in place"])
async def test_a_pinned_put_of_a_cached_prefix_pins_the_cached_blocks_too(server_factory, path: str) -> None:  # type: ignore[no-untyped-def]
    """A prefix put unpinned, then put again with pin: every block of it is pinned. The bytes path skipped the
    cached blocks (skip_cached, the default) without pinning them, so the caller's 'pinned' prefix was evicted like
    any other (found by session 44's pin-share fixer)."""
    spec = tiny_model()
    block_bytes = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 6 * block_bytes})
    opts = {"zero_copy": False} if path == "bytes" else {"in_place_min_bytes": 0}
    async with EngramClient(srv.address, **opts) as client:
        fp = await client.register_model(spec)
        system = tokens(2 * BLOCK_TOKENS, seed=98)
        kv_sys = random_kv(spec, len(system), seed=98)
        await client.put(fp, system, kv_sys)
        again = await client.put(fp, system, kv_sys, pin=True)
        assert (again.reserve_ms > 0) == (path == "in place")  # each put on its own path
        assert (await client.stats()).tiers[0].pinned_blocks == 2
        for s in range(6):
            t = tokens(3 * BLOCK_TOKENS, seed=s)
            await client.put(fp, t, random_kv(spec, len(t), seed=s))
        n, got = await client.get_prefix(fp, system)
        assert n == len(system) and got is not None and torch.equal(got, kv_sys)


async def test_full_of_pinned_blocks_is_resource_exhausted_and_keeps_them(server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block_bytes = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 2 * block_bytes})
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        t = tokens(2 * BLOCK_TOKENS)
        kv = random_kv(spec, len(t))
        await client.put(fp, t, kv, pin=True)
        other = tokens(BLOCK_TOKENS, seed=5)
        with pytest.raises(errors.ResourceExhausted, match="pinned"):
            await client.put(fp, other, random_kv(spec, BLOCK_TOKENS))
        n, got = await client.get_prefix(fp, t)
        assert n == len(t) and got is not None and torch.equal(got, kv)


async def test_sixteen_concurrent_clients_stay_consistent(server) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    n_seq = 12
    seqs = [tokens(3 * BLOCK_TOKENS + (s % 3) * 5, seed=s) for s in range(n_seq)]
    kvs = [random_kv(spec, len(t), seed=s) for s, t in enumerate(seqs)]

    async def worker(w: int) -> dict[str, int]:
        """100 random operations; what the daemon told this client it stored and deduplicated, and the blocks it
        served it."""
        rng = random.Random(w)
        told = {"stored": 0, "deduplicated": 0, "served": 0}
        async with EngramClient(server.address, namespace="shared") as c:
            fp = await c.register_model(spec)
            for _ in range(100):
                i = rng.randrange(n_seq)
                op = rng.choice(("put", "put", "get", "lookup", "stats"))
                if op == "put":
                    res = await c.put(fp, seqs[i], kvs[i])
                    assert len(res.keys) == -(-len(seqs[i]) // BLOCK_TOKENS)
                    told["stored"] += res.stored
                    told["deduplicated"] += res.deduplicated
                elif op == "get":
                    n, got = await c.get_prefix(fp, seqs[i])
                    if got is not None:  # whatever is cached must be exactly what was put
                        assert torch.equal(got, kvs[i][:, :, :n])
                    told["served"] += -(-n // BLOCK_TOKENS)
                elif op == "lookup":
                    hit = await c.lookup(fp, seqs[i])
                    assert hit.matched_tokens in (0, *range(BLOCK_TOKENS, len(seqs[i]) + 1))
                else:
                    await c.stats()
        return told

    results = await asyncio.gather(*(worker(w) for w in range(16)))
    async with EngramClient(server.address, namespace="shared") as c:
        fp = await c.register_model(spec)
        # The daemon's counters agree with what its 16 concurrent clients were answered, and each block a put
        # was told stored is one block in the store (no eviction here): none counted twice, none lost.
        during = await c.stats()
        assert during.blocks_put == sum(r["stored"] for r in results) == len(list(server.store.blocks("shared")))
        assert during.blocks_deduplicated == sum(r["deduplicated"] for r in results)
        assert during.blocks_served == sum(r["served"] for r in results)
        for t, kv in zip(seqs, kvs, strict=True):
            await c.put(fp, t, kv)
            n, got = await c.get_prefix(fp, t)
            assert n == len(t) and got is not None and torch.equal(got, kv)
        stats = await c.stats()
    # Each sequence's blocks are stored once however many clients put them.
    expected_blocks = sum(-(-len(t) // BLOCK_TOKENS) for t in seqs)
    assert stats.models[0].blocks == expected_blocks
    tier = stats.tiers[0]
    assert tier.used_bytes == sum(spec.layout.block_nbytes(min(BLOCK_TOKENS, len(t) - s))
                                  for t in seqs for s in range(0, len(t), BLOCK_TOKENS))


async def test_namespaces_do_not_see_each_other(server) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS)
    async with EngramClient(server.address, namespace="a") as ca, EngramClient(server.address, namespace="b") as cb:
        fp = await ca.register_model(spec)
        await cb.register_model(spec)
        put = await ca.put(fp, toks, random_kv(spec, len(toks)))
        assert (await ca.lookup(fp, toks)).matched_tokens == len(toks)
        assert (await cb.lookup(fp, toks)).matched_tokens == 0
        with pytest.raises(errors.NotFound):
            await cb.get(fp, list(put.keys))
        with pytest.raises(errors.NotFound):
            await cb.pin(fp, list(put.keys))


async def test_large_blocks_are_chunked_under_the_message_limit(server_factory) -> None:  # type: ignore[no-untyped-def]
    from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec

    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=8, head_dim=128,
                      dtype=DType.FP32, block_tokens=256)
    spec = ModelSpec("big", "w", layout, codec="raw")  # 4 MiB blocks
    srv = await server_factory(**{"server.max_message_bytes": 2 * 2**20, "server.chunk_bytes": 1 * 2**20})
    # gRPC streams only (no data channel, no same-host paths): a 4 MiB block crosses as 1 MiB chunks, and
    # would be refused whole by the 2 MiB message limit
    async with EngramClient(srv.address, chunk_bytes=2**20, max_message_bytes=2 * 2**20, zero_copy=False,
                            data_channel=False) as client:
        fp = await client.register_model(spec)
        toks = tokens(2 * 256)
        kv = torch.randn(layout.block_shape(len(toks)))
        await client.put(fp, toks, kv)
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)
        assert torch.equal(torch.cat(await client.get(fp, [b.key for b in (await client.lookup(fp, toks)).blocks]),
                                     dim=2), kv)
    assert srv.service.dataport is not None and srv.service.dataport.served["put"] == 0


async def test_a_clients_put_chunks_stay_under_the_daemons_message_limit(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A client at its defaults (8 MiB chunks, 64 MiB messages) putting over gRPC to a daemon whose
    server.max_message_bytes is 4 MiB: its 4 MiB blocks went as one message each, which the daemon refused as
    "INTERNAL: Internal error from Core", logging nothing and naming neither setting (an audit, session 45). The
    daemon says its limit when the model is registered, and the client's chunks, block header included, stay
    under it."""
    from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec

    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=8, head_dim=128,
                      dtype=DType.BF16, block_tokens=256)
    spec = ModelSpec("big", "w", layout, codec="raw")  # 4 MiB blocks: with a header, over the limit whole
    srv = await server_factory(**{"server.max_message_bytes": 4 * 2**20, "server.chunk_bytes": 2**20})
    async with EngramClient(srv.address, zero_copy=False, data_channel=False) as client:
        fp = await client.register_model(spec)
        toks = tokens(2 * 256, seed=3)
        kv = torch.randn(layout.block_shape(len(toks))).to(torch.bfloat16)
        assert (await client.put(fp, toks, kv)).stored == 2
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)


async def test_a_client_whose_message_limit_is_below_the_daemons_chunks_still_gets_its_blocks(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A client made with max_message_bytes = 4 MiB fetching over gRPC from a daemon sending 8 MiB Get chunks (the
    default until session 53): a 4 MiB block came as one message over the client's receive limit, and every Get
    and load failed RESOURCE_EXHAUSTED "Received message larger than max", naming neither setting (found in session
    45 beside the put direction's audit). The client takes whatever its daemon sends; its own limit bounds what it
    sends."""
    from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec

    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=8, head_dim=128,
                      dtype=DType.BF16, block_tokens=256)
    spec = ModelSpec("big", "w", layout, codec="raw")  # 4 MiB blocks
    srv = await server_factory(**{"server.chunk_bytes": "8MiB"})
    async with EngramClient(srv.address, zero_copy=False, data_channel=False, chunk_bytes=2**20,
                            max_message_bytes=4 * 2**20) as client:
        fp = await client.register_model(spec)
        toks = tokens(2 * 256, seed=4)
        kv = torch.randn(layout.block_shape(len(toks))).to(torch.bfloat16)
        put = await client.put(fp, toks, kv)
        assert torch.equal(torch.cat(await client.get(fp, list(put.keys)), dim=2), kv)
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)


async def test_sync_client_round_trip(server) -> None:  # type: ignore[no-untyped-def]
    """The blocking client against the fixture's daemon, over TCP and the unix socket: it blocks a thread of its
    own while this test's event loop serves the daemon (it used to start a TCP daemon of its own, so its [unix]
    id was a second TCP run)."""
    from engram.client import SyncEngramClient

    spec = tiny_model()
    toks = tokens(40)
    kv = random_kv(spec, 40)

    def round_trip() -> tuple[int, torch.Tensor | None]:
        with SyncEngramClient(server.address) as c:
            fp = c.register_model(spec)
            c.put(fp, toks, kv)
            return c.get_prefix(fp, toks)

    n, got = await asyncio.to_thread(round_trip)
    assert n == 40 and got is not None and torch.equal(got, kv)
    assert len(list(server.store.blocks())) == 3  # stored by the fixture's daemon


async def test_a_token_no_grpc_header_can_carry_is_refused_when_the_client_is_made(server) -> None:  # type: ignore[no-untyped-def]
    """A token with a CRLF ending (read from a file) failed at the first call deep in gRPC (ExecuteBatchError)."""
    with pytest.raises(errors.InvalidArgument, match="printable ASCII"):
        EngramClient(server.address, token="secret\r")


async def test_token_ids_the_wire_cannot_carry_are_invalid_not_changed(server) -> None:  # type: ignore[no-untyped-def]
    """Token ids travel as int32: an int64 array past that range was cast with wrap-around, floats truncated (the
    lookup and put were for other tokens, silently); a Python int past it raised numpy's OverflowError."""
    spec = tiny_model()
    async with EngramClient(server.address, namespace="t") as c:
        fp = await c.register_model(spec)
        good = tokens(BLOCK_TOKENS)
        await c.put(fp, good, random_kv(spec, BLOCK_TOKENS))
        wrapped = good.astype(np.int64)
        wrapped[3] += 2**32  # the same int32 bits
        for bad, what in ((wrapped, "32-bit"), (good.astype(np.float64), "integers"), ([2**31], "32-bit"),
                          (good.reshape(2, -1), "flat")):
            with pytest.raises(errors.InvalidArgument, match=what):
                await c.lookup(fp, bad)
        with pytest.raises(errors.InvalidArgument, match="32-bit"):
            await c.put(fp, wrapped, random_kv(spec, BLOCK_TOKENS))
        assert (await c.lookup(fp, good.astype(np.int64))).matched_tokens == BLOCK_TOKENS  # in range: fine


@pytest.mark.parametrize("path", ["data channel", "grpc", "in place"])
async def test_a_chain_longer_than_one_request_may_name_goes_in_parts(server_factory, path: str) -> None:  # type: ignore[no-untyped-def]
    """server.max_blocks_per_request bounds the blocks one Put, Get or ReservePut names (4 here, 4096 by
    default: 64k tokens of 16-token blocks). A longer chain was refused after the daemon had stored the first
    part, or not at all in place, and its hit could not be fetched as bytes; the client now splits each request
    (the daemon says its bound when the model is registered) and every path round-trips 10 blocks."""
    srv = await server_factory(**{"server.max_blocks_per_request": 4, "server.metrics_port": -1})
    spec = tiny_model()
    kw: dict[str, Any] = {"data channel": {"zero_copy": False}, "grpc": {"zero_copy": False, "data_channel": False},
                          "in place": {"in_place_min_bytes": 0}}[path]
    async with EngramClient(srv.address, namespace="t", **kw) as c:
        fp = await c.register_model(spec)
        toks = tokens(10 * BLOCK_TOKENS, seed=12)
        kv = random_kv(spec, len(toks), seed=12)
        put = await c.put(fp, toks, kv)
        assert put.stored == 10 and len(put.keys) == 10
        assert rpcs_answered(srv, "ReservePut") == (3 if path == "in place" else 0)  # 4 + 4 + 2 blocks in place
        assert (await c.lookup(fp, toks, probe=True)).matched_tokens == len(toks)
        for zero_copy in (False, True):
            assert torch.equal(torch.cat(await c.get(fp, list(put.keys), zero_copy=zero_copy), dim=2), kv)
        dest = torch.zeros_like(kv)
        assert (await c.load_prefix_into(fp, toks, dest)).loaded_tokens == len(toks)
        assert torch.equal(dest, kv)


@pytest.mark.parametrize("path", ["data channel", "grpc"])
async def test_a_prompt_longer_than_one_lookup_may_name_is_put_and_its_cached_blocks_skipped(server_factory, path: str) -> None:  # type: ignore[no-untyped-def]
    """server.max_tokens_per_request bounds a Lookup's tokens (64 here). A put split its blocks to fit a request
    but sent its skip-cached Lookup whole: a 100-token prompt could never be put, "Lookup tokens: 100 exceeds the
    server's limit of 64; split the request" (an audit, session 45). The put now looks up at most the limit's
    tokens: the cached blocks among them are skipped, the rest sent (and deduplicated where cached)."""
    srv = await server_factory(**{"server.max_tokens_per_request": 64})
    spec = tiny_model()
    kw: dict[str, Any] = {"data channel": {"zero_copy": False}, "grpc": {"zero_copy": False, "data_channel": False}}[path]
    async with EngramClient(srv.address, namespace="t", **kw) as c:
        fp = await c.register_model(spec)
        toks = tokens(100, seed=13)  # 6 full blocks of 16 and a tail of 4
        kv = random_kv(spec, len(toks), seed=13)
        put = await c.put(fp, toks, kv)
        assert (put.stored, put.deduplicated, put.skipped) == (7, 0, 0)
        again = await c.put(fp, toks, kv)
        assert (again.stored, again.deduplicated, again.skipped, again.keys) == (0, 3, 4, put.keys)
        assert torch.equal(torch.cat(await c.get(fp, list(put.keys)), dim=2), kv)
        n, got = await c.get_prefix(fp, toks[:64])
        assert n == 64 and torch.equal(got, kv[:, :, :64])


async def test_a_prompt_longer_than_one_lookup_may_name_hits_the_cached_prefix_of_its_first_that_many_tokens(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A Lookup or load of a prompt longer than server.max_tokens_per_request (64 here) was refused "split the
    request", which a worker cannot: the vLLM connector counted a lookup failure and computed every such prompt
    in full, the transformers store a load failure (an audit, session 45). The client asks about the first
    max_tokens_per_request tokens (RegisterModel says it): the hit is the cached prefix among them."""
    srv = await server_factory(**{"server.max_tokens_per_request": 64})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(100, seed=14)
        kv = random_kv(spec, len(toks), seed=14)
        await c.put(fp, toks, kv)
        assert (await c.lookup(fp, toks, probe=True)).matched_tokens == 64
        dest = torch.zeros_like(kv)
        assert (await c.load_prefix_into(fp, toks, dest)).loaded_tokens == 64
        assert torch.equal(dest[:, :, :64], kv[:, :, :64]) and not dest[:, :, 64:].any()
        n, got = await c.get_prefix(fp, toks)
        assert n == 64 and torch.equal(got, kv[:, :, :64])


async def test_more_finished_loads_than_one_request_may_name_end_their_leases_in_parts(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Each finished load's lease waits for the next load's GetPrefix to end it; more of them than
    server.max_blocks_per_request (8 concurrent loads, a bound of 4) made that next load fail RESOURCE_EXHAUSTED,
    and the background release too: the leases stayed until they expired (an audit)."""
    srv = await server_factory(**{"server.max_blocks_per_request": 4})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS, seed=3)
        kv = random_kv(spec, len(toks), seed=3)
        await c.put(fp, toks, kv)
        dests = [torch.zeros_like(kv) for _ in range(8)]
        await asyncio.gather(*(c.load_prefix_into(fp, toks, d) for d in dests))
        assert all(torch.equal(d, kv) for d in dests)
        assert (await c.stats()).leases == 8  # held for the next load
        dest = torch.zeros_like(kv)
        assert (await c.load_prefix_into(fp, toks, dest)).loaded_tokens == len(toks) and torch.equal(dest, kv)
        for _ in range(50):  # the four it could not name go in a ReleaseLeases of their own, at once
            if (await c.stats()).leases == 1:
                break
            await asyncio.sleep(0.02)
        assert (await c.stats()).leases == 1  # the last load's own
        await c.close()  # and the close ends that one, in parts too
    async with EngramClient(srv.address, namespace="t") as c:
        assert (await c.stats()).leases == 0


@pytest.mark.parametrize("channel", ["data channel", "grpc"])
async def test_a_put_in_parts_names_the_failing_block_in_the_chain_and_pins_go_in_parts(server_factory,  # type: ignore[no-untyped-def]
                                                                                          channel: str) -> None:
    """Each part of a chain sent in parts (server.max_blocks_per_request) counts its blocks from 0: a quota
    refusal at block 5 of a chain said block 1 (an audit). And a Pin of more keys than one request may name
    was refused, where puts and gets went in parts."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"server.max_blocks_per_request": 2, "auth.tenants.t.token": "tok",
                                  "auth.tenants.t.quota": 5 * block, "auth.salt_secret": "s"})
    kw: dict[str, Any] = {"data channel": {}, "grpc": {"data_channel": False}}[channel]
    async with EngramClient(srv.address, token="tok", namespace="t", zero_copy=False, **kw) as c:
        fp = await c.register_model(spec)
        toks = tokens(7 * BLOCK_TOKENS, seed=21)
        with pytest.raises(errors.ResourceExhausted, match=r"^block 5: namespace 't' holds"):
            await c.put(fp, toks, random_kv(spec, len(toks), seed=21))
        keys = [b.key for b in (await c.lookup(fp, toks)).blocks]
        assert len(keys) == 5  # what was stored before it
        assert await c.pin(fp, keys) == 5
        assert sum(d.pins for d in (await c.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks) == 5


async def test_a_namespaces_live_leases_are_bounded_and_releasing_them_makes_room(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A client that asked GetPrefix to hold prefixes faster than it ended them grew the lease table without bound
    (2,000 held 1,024-block prefixes: +37 MiB, an audit): a namespace's live leases may name
    server.max_leased_blocks_per_namespace blocks; past it RESOURCE_EXHAUSTED, another namespace unaffected, and
    a release (the next load's, here a GetPrefix's) makes room."""
    import grpc

    from engram.v1 import engram_pb2 as pb
    from engram.v1 import engram_pb2_grpc as pb_grpc

    srv = await server_factory(**{"server.max_leased_blocks_per_namespace": 8})
    spec = tiny_model()
    toks = tokens(4 * BLOCK_TOKENS, seed=31)
    for ns in ("a", "b"):
        async with EngramClient(srv.address, namespace=ns) as c:
            fp = await c.register_model(spec)
            await c.put(fp, toks, random_kv(spec, len(toks), seed=31))
    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = pb_grpc.EngramStub(ch)

        def hold(ns: str, release: tuple[int, ...] = ()) -> Any:
            return stub.GetPrefix(pb.GetPrefixRequest(namespace=ns, model_fingerprint=fp, tokens=toks.tolist(),
                                                      hold_for_get=True, release_lease_ids=release))

        first, second = await hold("a"), await hold("a")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await hold("a")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_leased_blocks_per_namespace" in (refused.value.details() or "")
        assert (await hold("b")).lease_id  # its own share
        assert (await hold("a", release=(first.lease_id,))).lease_id  # the last load's lease ended first
        assert second.lease_id


async def test_a_get_of_a_block_whose_header_passes_the_slack_stays_under_the_daemons_message_limit(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """A daemon whose server.max_message_bytes is server.chunk_bytes + 4 KiB (as config allows) serving, over gRPC,
    blocks whose BlockHeader (4096 tokens) is larger than that 4 KiB: the first chunk of each, chunk_bytes of
    payload beside the header, was over the daemon's own send limit and the Get failed. Each message, its header
    included, now stays under the limit, and the blocks come back whole."""
    spec = long_block_model()
    srv = await server_factory(**LEAST_ROOM)
    async with EngramClient(srv.address, zero_copy=False, data_channel=False) as client:
        fp = await client.register_model(spec)
        toks = tokens(2 * 4096, seed=5)
        kv = torch.randn(spec.layout.block_shape(len(toks))).to(torch.bfloat16)
        put = await client.put(fp, toks, kv)
        assert put.stored == 2
        assert torch.equal(torch.cat(await client.get(fp, list(put.keys)), dim=2), kv)
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)
