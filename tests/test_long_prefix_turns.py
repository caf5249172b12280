"""One tenant's long-prefix calls cannot hold the daemon's event loop from the others (an audit, session 48: bob's
Lookups of a million-token prefix of 16-token blocks took a third of a second of Python each, on the loop, and
alice's 64-token Lookup waited 12 s behind 32 of them). A long match and its answer are walked a slice of blocks
at a time, and one tenant's long calls take turns (engram/loopturns.py). What a slice-wise walk answers ends
before any block removed while it walked."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import grpc
import pytest

from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.loopturns import SLICE_BLOCKS
from engram.v1 import engram_pb2 as pb

from helpers import dram_store, put_raw_chain, random_kv, tiny_model, tokens

ALICE, BOB = "alice-token", "bob-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB, "auth.salt_secret": "test-secret"}


def minimal() -> ModelSpec:
    """The smallest legal layout: one layer, one head of one dimension, 16-token blocks of 64 bytes."""
    return ModelSpec(name="mini", weights_id="w", codec="raw",
                     layout=KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=1,
                                     dtype=DType.BF16, block_tokens=16))


@pytest.mark.parametrize("transport", ["unix"])
@pytest.mark.parametrize("method", ["Lookup", "GetPrefix"])
async def test_another_tenants_lookup_finishes_while_one_tenants_long_lookups_run(server_factory: Any,
                                                                                   method: str) -> None:
    """Bob keeps 12 calls of a 8,192-block prefix in flight; each of alice's short Lookups finishes while at most
    a couple of bob's do (counted, not timed: the count does not depend on the machine's speed). Main ran each of
    bob's calls in one go, so each of alice's waited for all of those queued ahead of it: ~11 of bob's finished
    during each."""
    srv = await server_factory(**AUTH)
    spec, n_blocks, workers = minimal(), 8192, 12
    big = tokens(n_blocks * 16, seed=7)
    async with EngramClient(srv.address, token=BOB, namespace="bob") as b, \
            EngramClient(srv.address, token=ALICE, namespace="alice") as a:
        fpb = await b.register_model(spec)
        assert (await b.put(fpb, big, random_kv(spec, len(big), seed=1))).stored == n_blocks
        fpa = await a.register_model(tiny_model())
        small = tokens(64, seed=2)
        await a.put(fpa, small, random_kv(tiny_model(), 64))
        cls, answer_cls = ((pb.LookupRequest, pb.LookupResponse) if method == "Lookup" else
                           (pb.GetPrefixRequest, pb.PrefixHeader))
        raw = cls(namespace="bob", model_fingerprint=fpb, tokens=big.tolist()).SerializeToString()
        done, stop = [0], asyncio.Event()
        async with grpc.aio.insecure_channel(srv.address, options=[("grpc.max_receive_message_length", -1)]) as ch:
            call = ch.unary_unary(f"/engram.v1.Engram/{method}", request_serializer=None, response_deserializer=None)

            async def bob() -> None:
                while not stop.is_set():
                    answer = answer_cls.FromString(await call(raw, metadata=(("authorization", f"Bearer {BOB}"),)))
                    assert answer.matched_tokens == len(big)
                    done[0] += 1

            hammer = [asyncio.create_task(bob()) for _ in range(workers)]
            try:
                while done[0] < workers:  # every worker's first call answered: the next ones queue behind others
                    assert not any(t.done() for t in hammer)
                    await asyncio.sleep(0.01)
                during = []
                for _ in range(5):
                    before = done[0]
                    assert (await a.lookup(fpa, small)).matched_tokens == 64
                    during.append(done[0] - before)
                    await asyncio.sleep(0.01)
            finally:
                stop.set()
                await asyncio.gather(*hammer)
        assert statistics.median(during) <= 2, during


async def test_a_walk_ends_before_a_block_removed_between_its_slices() -> None:
    """A long prefix walked a slice at a time (the loop serves other calls between slices): a block it found is
    deleted meanwhile, with the chain after it. The answer ends before that block: a shorter match, never a
    block that is gone; the walk's later slices do not go on past the gap either."""
    store, fp = dram_store(capacity_blocks=3 * SLICE_BLOCKS)
    spec = tiny_model()
    n = 2 * SLICE_BLOCKS + 10
    keys = await put_raw_chain(store, "ns", spec, seed=3, n_blocks=n)
    toks = tokens(n * spec.layout.block_tokens, seed=3)
    whole = store.walk("ns", fp, toks)
    await store.lookup_walk(whole)
    whole.close()
    assert whole.kept() == n and whole.matched_tokens() == len(toks)

    walk = store.walk("ns", fp, toks)
    try:
        assert not walk.step(SLICE_BLOCKS)
        walk.watch()  # as lookup_walk does before it gives the loop a turn
        gone = SLICE_BLOCKS // 2
        for key in reversed(keys[gone:]):  # leaves first, as `engram evict` removes a chain
            meta = store.block(key)
            assert meta is not None
            await store.remove(meta)
        while not walk.step(SLICE_BLOCKS):
            pass
        assert walk.kept() == gone and walk.matched_tokens() == gone * spec.layout.block_tokens
        assert [m.key for m in walk.found()] == keys[:gone]
        assert all(store.block(m.key) is m for m in walk.result().blocks)
    finally:
        walk.close()
    assert not store.index._walks  # closed: it hears of no more removals
