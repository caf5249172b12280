"""A plain client registers its model again when the daemon has forgotten it, through real daemons.

A daemon forgets a registration: restarted without a model registry (DRAM only), or dropping one that holds nothing
to make room for another (engram/server/modelroom.py). A plain EngramClient or SyncEngramClient then failed every
call naming the model UnknownModel until its user registered it again by hand; only the worker integrations
recovered. Now the client registers each model it registered again, once, and makes the call once more
(engram/reregister.py); a call still refused raises, and a client that never registered the model gets the
UnknownModel as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engram import errors
from engram.client import EngramClient, SyncEngramClient

from helpers import BLOCK_TOKENS, RestartingDaemon, random_kv, tiny_model, tokens

TOKS = tokens(3 * BLOCK_TOKENS, seed=4)


async def test_each_call_naming_a_model_whose_registration_was_dropped_registers_it_again_and_answers(
        server_factory: Any) -> None:
    """Two models take turns in a registry of one (tenancy off): registering one drops the other, which holds
    nothing, so every call below names a model the daemon forgot; each registers it again and answers (each of
    which drops the other model again). Puts over the data channel and over a gRPC Put stream alike."""
    srv = await server_factory(**{"server.max_models": 1})
    one, two = tiny_model(weights_id="one"), tiny_model(weights_id="two")
    kv = random_kv(one, len(TOKS), seed=4)
    async with EngramClient(srv.address, namespace="ns") as c, \
            EngramClient(srv.address, namespace="ns", data_channel=False) as grpc_only:
        f1 = await c.register_model(one)
        f2 = await c.register_model(two)  # f1 forgotten
        assert await grpc_only.register_model(one) == f1  # f2 forgotten
        assert await grpc_only.register_model(two) == f2  # f1 forgotten

        def forgotten(fp: bytes) -> bytes:
            assert fp not in srv.store.registry
            return fp

        assert (await c.lookup(forgotten(f1), TOKS)).matched_tokens == 0
        assert (await c.get_prefix(forgotten(f2), TOKS))[0] == 0
        assert (await c.load_prefix_into(forgotten(f1), TOKS, torch.empty_like(kv))).matched_tokens == 0
        assert await c.pin(forgotten(f2), []) == 0
        assert await c.get(forgotten(f1), []) == []
        info = await c.open_session(forgotten(f2), mode="persist", tokens=TOKS)
        await c.close_session(info.session_id)
        assert (await grpc_only.put(forgotten(f1), TOKS, kv, skip_cached=False)).stored == 3  # a Put stream
        assert f1 in srv.store.registry and f2 not in srv.store.registry  # f1 holds blocks now
        # f2 again needs room that f1's blocks hold: the registration is refused, and that refusal raised, once
        with pytest.raises(errors.ResourceExhausted, match="max_models"):
            await c.put(f2, TOKS, kv, skip_cached=False)
        found = await c.lookup(f1, TOKS)
        assert found.matched_tokens == len(TOKS)
        assert torch.equal(torch.cat(await c.get(f1, [b.key for b in found.blocks]), dim=2), kv)
    async with EngramClient(srv.address, namespace="ns") as stranger:  # it registered nothing: told so, as before
        with pytest.raises(errors.UnknownModel):
            await stranger.lookup(f2, TOKS)
        assert f2 not in srv.store.registry


def test_a_sync_client_puts_and_hits_again_after_a_dram_only_daemon_restarted(tmp_path: Path) -> None:
    """An `engram serve` without NVMe restarts knowing no model: the client's next put registers its model again
    and stores every block, and its next load hits them (it failed UnknownModel until registered by hand)."""
    spec = tiny_model()
    kv = random_kv(spec, len(TOKS), seed=5)
    with RestartingDaemon(tmp_path) as daemon, SyncEngramClient(daemon.address, namespace="ns") as client:
        fp = client.register_model(spec)
        assert client.put(fp, TOKS, kv).stored == 3
        daemon.restart(client)
        assert client.put(fp, TOKS, kv).stored == 3
        dest = torch.empty_like(kv)
        assert client.load_prefix_into(fp, TOKS, dest).loaded_tokens == len(TOKS) and torch.equal(dest, kv)
        daemon.restart(client)
        matched, got = client.get_prefix(fp, TOKS)
        assert matched == 0 and got.shape[2] == 0
