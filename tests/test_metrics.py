"""Scrape the real /metrics endpoint of a running daemon after known traffic and check the values."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engram import errors
from engram.client import EngramClient
from engram.config import load_config

from helpers import random_kv, tiny_model, tokens


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_metrics_after_known_traffic(server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block = spec.layout.block_nbytes(16)
    # Room for 3 blocks in DRAM and no tier below: a second chain of 2 blocks evicts the first chain's tail
    # (2 evictions; a chain loses its tail first, and a put never evicts the parent it extends).
    srv = await server_factory(**{"server.metrics_port": -1, "tiers.dram.capacity": 3 * block})
    assert srv.metrics is not None and srv.metrics.port > 0
    async with EngramClient(srv.address, namespace="m", zero_copy=False, data_channel=False) as c:  # Put RPCs
        fp = await c.register_model(spec)
        toks = tokens(48)
        await c.put(fp, toks, random_kv(spec, 48))
        await c.put(fp, tokens(32, seed=1), random_kv(spec, 32))
        hit = await c.lookup(fp, toks)
        assert hit.blocks
        await c.lookup(fp, toks[:48])
        await c.get(fp, [hit.blocks[0].key])
        with pytest.raises(errors.NotFound):
            await c.get(fp, [b"\0" * 16])
    m = await asyncio.to_thread(scrape, srv.metrics.port)
    dram = (("tier", "dram"),)
    assert m[("engram_tier_capacity_bytes", dram)] == 3 * block
    assert m[("engram_tier_blocks", dram)] == 3
    assert m[("engram_tier_used_bytes", dram)] == 3 * block
    assert m[("engram_tier_evictions_total", dram)] == 2
    assert m[("engram_tier_hits_total", dram)] == 1
    assert m[("engram_tier_degraded", dram)] == 0
    assert m[("engram_blocks_put_total", ())] == 5
    assert m[("engram_lookups_total", ())] == 4  # each put looks up first
    assert m[("engram_corrupt_blocks_total", ())] == 0
    assert m[("engram_replay_seconds_count", ())] == 0
    # The eviction model: cold (too few comebacks to rank by density), both orders even, and the two blocks
    # the second chain deleted remembered as ghosts; the lookups' hits are comebacks it counted.
    assert m[("engram_eviction_learned", ())] == 0
    assert m[("engram_eviction_recency_weight", ())] == 0.5
    assert m[("engram_eviction_ghosts", ())] == 2
    assert m[("engram_eviction_comebacks_total", ())] >= 1
    ok = lambda method: (("code", "OK"), ("method", method))  # noqa: E731
    assert m[("engram_rpcs_total", ok("Put"))] == 2
    assert m[("engram_rpcs_total", ok("Lookup"))] == 4
    assert m[("engram_rpcs_total", ok("Get"))] == 1
    assert m[("engram_rpcs_total", (("code", "NOT_FOUND"), ("method", "Get")))] == 1
    assert m[("engram_rpc_duration_seconds_count", ok("Put"))] == 2
    assert m[("engram_rpc_duration_seconds_sum", ok("Put"))] > 0


async def four_blocks_into_two(server_factory, tmp_path):  # type: ignore[no-untyped-def]
    """A daemon whose DRAM tier holds 2 of a tiny model's blocks, over an NVMe tier: 4 blocks put (2 demoted to
    NVMe), then a Get of the first (served by NVMe, promoted to DRAM, demoting another). Returns the daemon, a
    block's bytes and the DRAM tier's Stats after."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(16)
    srv = await server_factory(**{"server.metrics_port": -1, "tiers.dram.capacity": 2 * block,
                                  "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.nvme.fsync": False})
    async with EngramClient(srv.address, namespace="m") as c:
        fp = await c.register_model(spec)
        keys = (await c.put(fp, tokens(64), random_kv(spec, 64))).keys
        await c.get(fp, [keys[0]])
        return srv, block, (await c.stats()).tier("dram")


async def test_metrics_count_promotions_and_bytes_moved(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv, block, _ = await four_blocks_into_two(server_factory, tmp_path)
    m = await asyncio.to_thread(scrape, srv.metrics.port)
    dram, nvme = (("tier", "dram"),), (("tier", "nvme"),)
    demoted = m[("engram_tier_demoted_bytes_total", dram)]
    assert demoted == block * srv.store.counters.tiers["dram"].demotions and demoted >= 2 * block
    assert m[("engram_tier_promoted_bytes_total", dram)] == block
    assert m[("engram_tier_hits_total", nvme)] == 1 and m[("engram_tier_misses_total", dram)] == 1


async def test_metrics_count_each_tiers_demotions_promotions_and_full_disk_refusals(server_factory,  # type: ignore[no-untyped-def]
                                                                                    tmp_path) -> None:
    """/metrics had the bytes moved between tiers but not the blocks, nor how often a tier refused a write for a
    full disk (ENOSPC): Stats alone had them (an audit, session 48). A scripted workload on a real daemon: 4 blocks
    into a DRAM tier of 2 (2 demoted to NVMe), then a Get of an NVMe-only block (promoted, demoting another); then
    write-through puts onto a 256 KiB tmpfs until the full disk refuses one. Labelled by tier name only."""
    import os

    from helpers import small_tmpfs

    srv, _, dram = await four_blocks_into_two(server_factory, tmp_path)
    spec = tiny_model()
    m = await asyncio.to_thread(scrape, srv.metrics.port)
    assert (dram.demotions, dram.promotions) == (3, 1)
    assert m[("engram_tier_demotions_total", (("tier", "dram"),))] == 3
    assert m[("engram_tier_promotions_total", (("tier", "dram"),))] == 1
    assert m[("engram_tier_enospc_total", (("tier", "nvme"),))] == 0
    tiers = {labels for name, labels in m if name.startswith(("engram_tier_demotions", "engram_tier_promotions",
                                                              "engram_tier_enospc"))}
    assert tiers == {(("tier", "dram"),), (("tier", "nvme"),)}

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with small_tmpfs(tmp_path / "small") as small:
        full = await server_factory(**{"server.metrics_port": -1, "tiers.dram.capacity": "1MiB",
                                       "tiers.nvme.path": str(small), "tiers.nvme.capacity": "64MiB",
                                       "tiers.nvme.fsync": False, "tiers.write_policy": "write-through",
                                       "tiers.on_nvme_failure": "fail", "tiers.retry_s": 30})
        async with EngramClient(full.address, namespace="m", zero_copy=False) as c:
            fp = await c.register_model(spec)
            refused = 0
            for seed in range(1000):
                try:
                    await c.put(fp, tokens(64, seed=seed), random_kv(spec, 64, seed=seed))
                except errors.Unavailable:
                    refused += 1
                    if refused == 3:
                        break
            enospc = (await c.stats()).tier("nvme").enospc
        m = await asyncio.to_thread(scrape, full.metrics.port)
    assert refused == 3 and enospc >= 1
    assert m[("engram_tier_enospc_total", (("tier", "nvme"),))] == enospc


def test_metrics_port_is_validated() -> None:
    with pytest.raises(errors.ConfigError, match="metrics_port"):
        load_config(env={}, overrides={"server.metrics_port": -2})


async def test_data_channel_requests_are_counted(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"server.metrics_port": -1})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="m", zero_copy=False) as c:  # payloads on the data channel
        fp = await c.register_model(spec)
        toks = tokens(48)
        put = await c.put(fp, toks, random_kv(spec, 48))
        await c.get(fp, list(put.keys))
        with pytest.raises(errors.NotFound):
            await c.get(fp, [b"\0" * 16])
    m = await asyncio.to_thread(scrape, srv.metrics.port)
    assert m[("engram_data_requests_total", (("code", "OK"), ("op", "put")))] == 1
    assert m[("engram_data_requests_total", (("code", "OK"), ("op", "get")))] == 1
    assert m[("engram_data_requests_total", (("code", "NOT_FOUND"), ("op", "get")))] == 1
    assert m[("engram_data_request_duration_seconds_count", (("code", "OK"), ("op", "put")))] == 1
    assert ("engram_rpcs_total", (("code", "OK"), ("method", "Put"))) not in m  # no payload went over gRPC


async def test_a_stream_the_client_cancels_is_counted_as_cancelled(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A Get stream the client cancels after its first message was counted UNKNOWN (read as a server failure);
    it is CANCELLED (grpc closes the abandoned stream's generator: GeneratorExit). 32 blocks of 1 MiB: more than
    HTTP/2's flow control lets the daemon send before the client reads, so each stream is cut, never finished."""
    import grpc

    from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec
    from engram.v1 import engram_pb2 as pb

    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8, head_dim=128, block_tokens=128)
    spec = ModelSpec(name="big", weights_id="w", layout=layout, codec="raw")
    srv = await server_factory(**{"server.metrics_port": -1, "tiers.dram.capacity": "256MiB"})
    async with EngramClient(srv.address, namespace="m", zero_copy=False) as c:
        fp = await c.register_model(spec)
        keys = (await c.put(fp, tokens(32 * 128), random_kv(spec, 32 * 128))).keys
    async with grpc.aio.insecure_channel(srv.address.removeprefix("tcp:"),
                                         options=[("grpc.max_receive_message_length", 1 << 30)]) as ch:
        get = ch.unary_stream("/engram.v1.Engram/Get", request_serializer=pb.GetRequest.SerializeToString,
                              response_deserializer=pb.GetResponse.FromString)
        for _ in range(3):
            call = get(pb.GetRequest(namespace="m", model_fingerprint=fp, keys=list(keys)))
            async for _resp in call:
                break
            call.cancel()

    async def counts() -> tuple[float, float]:
        m = await asyncio.to_thread(scrape, srv.metrics.port)
        return (m.get(("engram_rpcs_total", (("code", "CANCELLED"), ("method", "Get"))), 0.0),
                m.get(("engram_rpcs_total", (("code", "UNKNOWN"), ("method", "Get"))), 0.0))

    for _ in range(100):  # the handlers see the cancels
        if sum(await counts()) >= 3:
            break
        await asyncio.sleep(0.05)
    assert await counts() == (3.0, 0.0)


async def test_write_backs_loss_window_is_exported(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What a crash now would lose under write-back (blocks and bytes held only in memory, the oldest one's age)
    was in Stats but not in /metrics, where an operator alerts on it."""
    spec = tiny_model()
    srv = await server_factory(**{"server.metrics_port": -1, "tiers.nvme.path": str(tmp_path / "nvme"),
                                  "tiers.write_back_window_s": 600.0})
    async with EngramClient(srv.address, namespace="m") as c:
        fp = await c.register_model(spec)
        await c.put(fp, tokens(48), random_kv(spec, 48))
        stats = await c.stats()
    m = await asyncio.to_thread(scrape, srv.metrics.port)
    assert m[("engram_write_back_pending_blocks", ())] == stats.write_back_pending_blocks == 3
    assert m[("engram_write_back_pending_bytes", ())] == stats.write_back_pending_bytes > 0
    assert m[("engram_write_back_oldest_seconds", ())] >= 0


async def test_with_tenancy_metrics_are_refused_without_a_token_and_scrapes_need_it(
        server_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """/metrics has no tenants: its lookup counters, tier used bytes and bytes served told anyone who could scrape
    another tenant's prompt lengths (their change around its call), which a tenant's Stats does not (audits). With
    tenancy on, server.metrics_port without server.metrics_token is a config error; with it every scrape must
    show the token (401 without it) and sees every figure."""
    import urllib.error

    auth = {"auth.tenants.a.token": "tok-a", "auth.salt_secret": "s", "server.metrics_port": -1}
    spec = tiny_model()
    toks = tokens(40)
    with pytest.raises(errors.ConfigError, match=r"server\.metrics_token"):
        load_config(env={}, overrides=auth)
    load_config(env={}, overrides={"server.metrics_port": -1})  # tenancy off: every caller sees everything anyway

    monkeypatch.setenv("ENGRAM_TEST_METRICS_TOKEN", "scrape-secret")
    srv = await server_factory(**auth, **{"server.metrics_token": "env:ENGRAM_TEST_METRICS_TOKEN"})
    async with EngramClient(srv.address, token="tok-a", namespace="a") as c:
        fp = await c.register_model(spec)
        await c.lookup(fp, toks)
    assert srv.metrics is not None
    url = f"http://127.0.0.1:{srv.metrics.port}/metrics"
    for header in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=header), timeout=5)
        assert refused.value.code == 401
        refused.value.close()
    req = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-secret"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        text = resp.read().decode()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["engram_lookup_miss_tokens_total"] == 40


async def test_a_tenants_token_is_refused_as_the_metrics_token(server_factory) -> None:  # type: ignore[no-untyped-def]
    """/metrics shows every tenant's figures (tier used bytes, bytes served: another tenant's prompt lengths around
    its calls), so its token is the operator's. One that was also a tenant's token let that tenant scrape them with
    the token it calls with (bob's scrape saw alice's lookup): the daemon refused two tenants one token, not a
    tenant and /metrics. Refused at start now, naming server.metrics_token; an admin's token may be it (an admin
    sees every figure anyway)."""
    import urllib.error

    auth = {"auth.tenants.alice.token": "tok-alice", "auth.tenants.bob.token": "tok-bob",
            "auth.admin_tokens": "tok-admin", "auth.salt_secret": "s", "server.metrics_port": -1}
    with pytest.raises(errors.ConfigError, match=r"server\.metrics_token is the token of tenant bob"):
        await server_factory(**auth, **{"server.metrics_token": "tok-bob"})
    srv = await server_factory(**auth, **{"server.metrics_token": "tok-admin"})
    assert srv.metrics is not None
    url = f"http://127.0.0.1:{srv.metrics.port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:  # bob's token scrapes nothing
        urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer tok-bob"}), timeout=5)
    assert refused.value.code == 401
    refused.value.close()


async def test_with_metrics_on_health_watch_and_reflection_are_served_and_counted(server_factory, caplog
                                                                                  ) -> None:  # type: ignore[no-untyped-def]
    """The metrics interceptor ran `async for` over every streaming handler; health's Watch writes its stream with
    context.write from a coroutine (as do the open services' wrappers), so with metrics on each Watch was UNKNOWN
    "'async for' requires an object with __aiter__" with a traceback in the log. Now a Watch sees SERVING, a
    reflection stream lists the services, and both are counted."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    srv = await server_factory(**{"server.metrics_port": -1})
    async with grpc.aio.insecure_channel(srv.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 10)).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        names = [s.name async for r in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([ask]))
                 for s in r.list_services_response.service]
        assert "engram.v1.Engram" in names
    assert not [r for r in caplog.records if r.exc_info], caplog.text

    async def counts() -> tuple[float, float]:
        m = await asyncio.to_thread(scrape, srv.metrics.port)
        return (m.get(("engram_rpcs_total", (("code", "CANCELLED"), ("method", "Watch"))), 0.0),
                m.get(("engram_rpcs_total", (("code", "OK"), ("method", "ServerReflectionInfo"))), 0.0))

    for _ in range(100):  # the handler sees the cancel
        if await counts() == (1.0, 1.0):
            break
        await asyncio.sleep(0.05)
    assert await counts() == (1.0, 1.0)
