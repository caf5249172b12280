"""Tenant isolation through a real daemon: tenant B's token never reaches tenant A's blocks, sessions or
namespace, through any RPC, by name or by key. Every denial is paired with a positive control (A itself
gets the hit), so the tests fail if caching is simply off rather than isolated."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engram import errors
from engram.client import EngramClient
from engram.config import load_config
from engram.keys import chain_keys
from engram.server import RunningServer, start_server
from engram.tenancy import Tenancy

from helpers import BLOCK_TOKENS, random_kv, register_holding, silent_puts, tiny_model, tokens, until

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.alice.quota": "128KiB",
        "auth.tenants.bob.token": BOB, "auth.tenants.bob.namespaces": "bob,bob-scratch",
        "auth.admin_tokens": ADMIN, "auth.salt_secret": "test-secret"}


@pytest.fixture
async def daemon(server_factory: Any) -> RunningServer:
    srv: RunningServer = await server_factory(**AUTH)
    return srv


def as_(srv: RunningServer, token: str = "", namespace: str = "") -> EngramClient:
    return EngramClient(srv.address, token=token, namespace=namespace)


async def alice_prefix(srv: RunningServer) -> tuple[bytes, np.ndarray, torch.Tensor, list[bytes]]:
    spec = tiny_model()
    toks = tokens(4 * BLOCK_TOKENS, seed=11)
    kv = random_kv(spec, len(toks), seed=11)
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(spec)
        put = await a.put(fp, toks, kv)
        assert put.stored == 4
        await a.open_session(fp, mode="persist", session_id="plan", tokens=toks)
        # Positive control: alice herself gets the whole prefix back, bit for bit.
        n, got = await a.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)
    return fp, toks, kv, list(put.keys)


async def test_calls_without_a_valid_token_are_unauthenticated(daemon: RunningServer) -> None:
    for token in ("", "not-a-token"):
        async with as_(daemon, token) as c:
            with pytest.raises(errors.Unauthenticated, match="token"):
                await c.stats()
            with pytest.raises(errors.Unauthenticated):
                await c.register_model(tiny_model())
    async with as_(daemon, ALICE) as a:  # the daemon kept serving
        assert (await a.stats()).version


async def test_bob_never_reaches_alices_blocks_through_any_rpc(daemon: RunningServer) -> None:
    fp, toks, kv, keys = await alice_prefix(daemon)
    async with as_(daemon, BOB) as b:
        await b.register_model(tiny_model())
        # By content, in his own namespace: nothing, although the tokens are the same.
        assert (await b.lookup(fp, toks)).matched_tokens == 0
        # By naming her namespace: refused, on every namespaced RPC.
        for call in (lambda: b.lookup(fp, toks, namespace="alice"),
                     lambda: b.get(fp, keys, namespace="alice"),
                     lambda: b.pin(fp, keys, namespace="alice"),
                     lambda: b.put(fp, toks, kv, namespace="alice"),
                     lambda: b.open_session(fp, mode="persist", tokens=toks, namespace="alice"),
                     lambda: b.fork_session("plan", namespace="alice"),
                     lambda: b.append_session("plan", [1], namespace="alice"),
                     lambda: b.suspend_session("plan", namespace="alice"),
                     lambda: b.close_session("plan", namespace="alice"),
                     lambda: b.resume("plan", namespace="alice"),
                     lambda: b.describe_namespace("alice")):
            with pytest.raises(errors.PermissionDenied, match="may not act in namespace 'alice'"):
                await call()
        # By key, in his own namespace: her keys do not exist there (NOT_FOUND, like any absent key).
        with pytest.raises(errors.NotFound):
            await b.get(fp, keys)
        with pytest.raises(errors.NotFound):
            await b.pin(fp, keys)
        # Chaining onto her block: the parent is not stored in his namespace; nothing lands in hers.
        with pytest.raises(errors.FailedPrecondition, match="parent block"):
            await b.put_blocks(fp, [(toks[:BLOCK_TOKENS], kv[:, :, :BLOCK_TOKENS])], parent_key=keys[-1])
        # Her session id, in his namespace: absent.
        for call in (lambda: b.fork_session("plan"), lambda: b.append_session("plan", [1]),
                     lambda: b.suspend_session("plan"), lambda: b.resume("plan"), lambda: b.close_session("plan")):
            with pytest.raises(errors.NotFound):
                await call()
        with pytest.raises(errors.PermissionDenied, match="admin"):
            await b.check()
        stats = await b.stats()
        assert {n.namespace for n in stats.namespaces} <= {"bob", "bob-scratch"}
    async with as_(daemon, ALICE) as a:  # and her data is intact
        await a.register_model(tiny_model())
        n, got = await a.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)
        assert (await a.describe_namespace()).blocks == 4


async def test_admin_acts_on_the_whole_daemon_and_a_tenant_defaults_to_its_namespace(daemon: RunningServer) -> None:
    fp, toks, _, _ = await alice_prefix(daemon)
    async with as_(daemon, ADMIN) as admin:
        assert (await admin.check()).valid == 4
        assert "alice" in {n.namespace for n in (await admin.stats()).namespaces}
    async with as_(daemon, ALICE) as a:  # no namespace named: the token's first
        await a.register_model(tiny_model())
        assert (await a.lookup(fp, toks)).matched_tokens == len(toks)


async def test_keys_carry_a_secret_per_namespace_salt(daemon: RunningServer) -> None:
    fp, toks, _, keys = await alice_prefix(daemon)
    # Knowing her namespace's name, the model and the tokens is not enough to compute her keys.
    unsalted = [k for k, _, _ in chain_keys("alice", fp, toks, BLOCK_TOKENS)]
    assert not set(unsalted) & set(keys)
    async with as_(daemon, ALICE) as a, as_(daemon, BOB) as b:
        salt_a = (await a.describe_namespace()).key_salt
        salt_b = (await b.describe_namespace()).key_salt
        assert salt_a and salt_b and salt_a != salt_b
        assert [k for k, _, _ in chain_keys("alice", fp, toks, BLOCK_TOKENS, salt_a)] == keys


async def test_a_lookup_in_another_namespace_never_reads_the_first_ones_entries(daemon: RunningServer) -> None:
    fp, toks, _, keys = await alice_prefix(daemon)
    space = daemon.store.index._spaces["alice"]
    reads: list[bytes] = []

    class Recording(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            reads.append(key)
            return super().get(key, default)

        def __getitem__(self, key: Any) -> Any:
            reads.append(key)
            return super().__getitem__(key)

    space.entries = Recording(space.entries)
    space.children = Recording(space.children)
    async with as_(daemon, BOB) as b:
        await b.register_model(tiny_model())
        await b.lookup(fp, toks)
        with pytest.raises(errors.NotFound):
            await b.get(fp, keys)
        with pytest.raises(errors.NotFound):
            await b.pin(fp, keys)
    assert reads == []  # so no timing can depend on what alice holds
    async with as_(daemon, ALICE) as a:  # control: her own lookup does read them
        await a.register_model(tiny_model())
        assert (await a.lookup(fp, toks)).matched_tokens == len(toks)
    assert reads


async def test_quota_counts_physical_bytes_and_refuses_with_a_message(daemon: RunningServer) -> None:
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)  # 4 KiB: the 128 KiB quota holds 32 blocks
    async with as_(daemon, ALICE) as a:
        fp = await a.register_model(spec)
        first = tokens(30 * BLOCK_TOKENS, seed=1)
        await a.put(fp, first, random_kv(spec, len(first), seed=1))
        again = await a.put(fp, first, random_kv(spec, len(first), seed=1), skip_cached=False)
        assert again.deduplicated == 30  # a duplicate costs no quota
        info = await a.describe_namespace()
        assert info.physical_bytes == 30 * block and info.quota_bytes == 128 * 1024
        more = tokens(4 * BLOCK_TOKENS, seed=2)
        with pytest.raises(errors.ResourceExhausted, match="quota"):
            await a.put(fp, more, random_kv(spec, len(more), seed=2))
        assert (await a.describe_namespace()).physical_bytes == 32 * block  # two fit, the rest was refused
        assert (await a.lookup(fp, first)).matched_tokens == len(first)  # nothing stored was lost
    async with as_(daemon, BOB) as b:  # another tenant's quota is its own
        fp = await b.register_model(spec)
        await b.put(fp, more, random_kv(spec, len(more), seed=2))


async def test_tokens_from_a_tenants_file_and_the_environment(server_factory: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = tmp_path / "tenants.toml"
    secrets.write_text('admin_tokens = "file-admin"\n[tenants.carol]\ntoken = "env:CAROL_TOKEN"\n')
    monkeypatch.setenv("CAROL_TOKEN", "carol-from-env")
    srv = await server_factory(**{"auth.tenants_file": str(secrets), "auth.salt_secret": "env:CAROL_TOKEN"})
    async with as_(srv, "carol-from-env") as c:
        assert (await c.describe_namespace()).namespace == "carol"
    async with as_(srv, "file-admin") as admin:
        await admin.check()
    async with as_(srv, "env:CAROL_TOKEN") as literal:  # the reference itself is not a token
        with pytest.raises(errors.Unauthenticated):
            await literal.stats()


@pytest.mark.parametrize("name", ["peer", "peer:node-a", "admin-0", "admin-12"])
def test_a_tenant_named_as_one_of_the_daemons_own_callers_is_refused_at_config_load(tmp_path: Path,
                                                                                    name: str) -> None:
    """The daemon counts its cluster peers as "peer" (or "peer:<node id>") and admin tokens as "admin-<n>": a
    tenant so named shared their count of calls in flight (its calls refused a peer's fetches). Such names are
    refused, in the config and in the tenants file, with the names that are reserved; others are not."""
    from engram.config import load_config
    from engram.errors import ConfigError
    from engram.tenancy import Tenancy

    reserved = f"tenant name '{name}' is reserved \\(the empty name, peer, peer:<anything> and admin-<number>"
    with pytest.raises(ConfigError, match=f"auth.tenants.{name}: the {reserved}"):
        load_config(env={}, overrides={f"auth.tenants.{name}.token": "t", "auth.salt_secret": "s"})
    secrets = tmp_path / "tenants.toml"
    secrets.write_text(f'[tenants."{name}"]\ntoken = "t"\n')
    auth = load_config(env={}, overrides={"auth.tenants_file": str(secrets), "auth.salt_secret": "s"}).auth
    with pytest.raises(ConfigError, match=f"auth.tenants_file {secrets}: tenants.{name}: the {reserved}"):
        Tenancy.from_config(auth, peer_token="peer-token")
    secrets.write_text('[tenants.peers]\ntoken = "t1"\n[tenants."admin-team"]\ntoken = "t2"\n')
    config = load_config(env={}, overrides={"auth.tenants_file": str(secrets), "auth.salt_secret": "s",
                                            "auth.tenants.admin.token": "t3", "auth.tenants.Peer.token": "t4"})
    tenancy = Tenancy.from_config(config.auth, peer_token="peer-token")
    assert tenancy is not None
    assert sorted(p.name for p in tenancy.principals.values()) == ["Peer", "admin", "admin-team", "peer", "peers"]


def test_a_tenant_with_the_empty_name_is_refused_at_config_load(tmp_path: Path) -> None:
    """The daemon names an admin's calls (and every call with tenancy off) by the empty tenant name: tenant_of() is
    "" for them, and every per-tenant check reads "" as "the whole daemon". A tenant named "" (`[auth.tenants.""]`,
    valid TOML) was such a caller with a tenant's token: its Lookup naming a model only another tenant had
    registered answered as for its own (no UnknownModel: it learned which models the others run), its sessions were
    the admins', and it had no share of the receive buffers, reservations or the model registry. The name is
    refused, in the config and in the tenants file."""
    from engram.config import load_config
    from engram.errors import ConfigError
    from engram.tenancy import Tenancy

    config = tmp_path / "engram.toml"
    config.write_text('[auth]\nsalt_secret = "s"\n[auth.tenants.alice]\ntoken = "a"\n[auth.tenants.""]\ntoken = "e"\n'
                      'namespaces = "eve"\n')
    with pytest.raises(ConfigError, match=r"auth\.tenants\.: the tenant name '' is reserved"):
        load_config(path=config, env={})
    secrets = tmp_path / "tenants.toml"
    secrets.write_text('[tenants.""]\ntoken = "e"\n')
    auth = load_config(env={}, overrides={"auth.tenants_file": str(secrets), "auth.salt_secret": "s",
                                          "auth.tenants.alice.token": "a"}).auth
    with pytest.raises(ConfigError, match=f"auth.tenants_file {secrets}: tenants.: the tenant name '' is reserved"):
        Tenancy.from_config(auth)


@pytest.mark.parametrize(("content", "says"), [
    (b'[tenants.bob]\ntoken = "t"\nquota = -5\n', "tenants.bob.quota must be >= 0"),
    (b'[tenants.bob]\ntoken = "t"\nmax_sessions = -2\n', "tenants.bob.max_sessions must be >= 0"),
    (b'[tenants.bob]\ntoken = ""\n', "tenants.bob.token is empty"),
    (b"\xff\xfe[tenants.bob]\n", "not valid TOML"),
    (b'[tenants.bob]\ntoken = "t"\nquota_byts = 5\n', "unknown config key 'tenants.bob.quota_byts'"),
    (b'tenant = "x"\n[tenants.bob]\ntoken = "t"\n', "unknown key 'tenant'"),
    (b'salt_secret = "x"\n[tenants.bob]\ntoken = "t"\n', "unknown key 'salt_secret'.*belong in the config"),
    (b'[tenants.carol]\nquota = -5\n', "tenants.carol.quota must be >= 0"),  # a tenant of the config's
], ids=["negative-quota", "negative-max-sessions", "empty-token", "not-utf-8", "typo-in-a-table",
        "unknown-top-level-key", "auth-key-the-file-cannot-set", "bad-value-for-a-config-tenant"])
def test_a_tenants_file_is_checked_as_the_config_is(tmp_path: Path, content: bytes, says: str) -> None:
    """A tenants file's tables skipped the config's checks: a negative quota started the daemon and failed every
    call of that tenant INTERNAL (ValueError); a file not in UTF-8 stopped the start with a traceback (an audit).
    Unknown keys were either errors that did not name the file (a typo in a table) or read as nothing (a key
    beside the tables, salt_secret among them), and a table for a tenant the config has was not checked at all.
    Each is a ConfigError naming the file and the key now (`engram serve`: exit 4)."""
    from engram.config import load_config
    from engram.errors import ConfigError
    from engram.tenancy import Tenancy

    secrets = tmp_path / "tenants.toml"
    secrets.write_bytes(content)
    auth = load_config(env={}, overrides={"auth.tenants_file": str(secrets), "auth.salt_secret": "s",
                                          "auth.tenants.carol.token": "c"}).auth
    with pytest.raises(ConfigError, match=f"auth.tenants_file {secrets}[: ].*{says}"):
        Tenancy.from_config(auth)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a self-signed cert")
async def test_tls_over_tcp_with_a_self_signed_certificate(tmp_path: Path) -> None:
    from engram.config import load_config
    from engram.server import start_server

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True,
                   env={**os.environ, "OPENSSL_CONF": "/dev/null"})
    srv = await start_server(load_config(env={}, overrides={
        "server.port": 0, "tiers.dram.capacity": "64MiB", "server.tls_cert": str(cert), "server.tls_key": str(key),
        **AUTH}))
    try:
        spec = tiny_model()
        toks = tokens(2 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        async with EngramClient(srv.address, token=ALICE, namespace="alice", root_cert=cert.read_bytes()) as a:
            fp = await a.register_model(spec)
            await a.put(fp, toks, kv)
            n, got = await a.get_prefix(fp, toks)
            assert n == len(toks) and got is not None and torch.equal(got, kv)
        async with EngramClient(srv.address, token=ALICE) as plain:  # plaintext to a TLS port fails
            with pytest.raises(errors.Unavailable):
                await plain.stats()
    finally:
        await srv.stop(0)


async def test_fetch_blocks_is_for_peers_only(server_factory: Any) -> None:
    import grpc

    from engram.v1 import engram_pb2 as pb
    from engram.wire.channel import open_channel, stub_for

    srv = await server_factory(**AUTH, **{"cluster.peer_token": "peer-token"})
    fp, _, _, keys = await alice_prefix(srv)
    request = pb.FetchBlocksRequest(keys=keys, namespace="alice", model_fingerprint=fp)
    for token, code in ((ALICE, grpc.StatusCode.PERMISSION_DENIED), ("", grpc.StatusCode.UNAUTHENTICATED)):
        channel = open_channel(srv.address)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub_for(channel, token).FetchBlocks(request):
                pass
        assert info.value.code() == code
        await channel.close()
    channel = open_channel(srv.address)  # control: the peer token gets the blocks
    got = [r async for r in stub_for(channel, "peer-token").FetchBlocks(request)]
    # ... of the namespace and model it names only: her keys asked for in bob's namespace are absent
    other = [r async for r in stub_for(channel, "peer-token").FetchBlocks(
        pb.FetchBlocksRequest(keys=keys, namespace="bob", model_fingerprint=fp))]
    await channel.close()
    assert [r.chunk.key for r in got if r.chunk.HasField("header")] == keys
    assert other == []


async def test_bob_never_reaches_alices_blocks_through_the_inspection_rpcs(daemon: RunningServer) -> None:
    fp, toks, kv, keys = await alice_prefix(daemon)
    async with as_(daemon, BOB) as b:
        for call in (lambda: b.list_namespaces(),
                     lambda: b.list_sessions(all_namespaces=True),
                     lambda: b.describe_blocks(key_prefixes=[keys[0].hex()], all_namespaces=True),
                     lambda: b.evict(key_prefixes=[keys[0].hex()], all_namespaces=True, force=True)):
            with pytest.raises(errors.PermissionDenied, match="admin"):
                await call()
        for call in (lambda: b.list_sessions(namespace="alice"),
                     lambda: b.describe_blocks(session_id="plan", namespace="alice"),
                     lambda: b.evict(whole_namespace=True, force=True, namespace="alice")):
            with pytest.raises(errors.PermissionDenied, match="may not act in namespace 'alice'"):
                await call()
        # Her keys and session, named inside his own namespace: absent.
        for call in (lambda: b.describe_blocks(key_prefixes=[keys[0].hex()]),
                     lambda: b.evict(key_prefixes=[keys[0].hex()], force=True),
                     lambda: b.describe_blocks(session_id="plan")):
            with pytest.raises(errors.NotFound):
                await call()
        assert not await b.list_sessions()
    async with as_(daemon, ADMIN) as admin:  # positive control: the admin sees her session and blocks
        listed = await admin.list_sessions(all_namespaces=True)
        assert [s.info.session_id for s in listed] == ["plan"]
        assert len((await admin.describe_blocks(session_id="plan", namespace="alice")).blocks) == 4
    async with as_(daemon, ALICE) as a:  # and nothing of hers was evicted
        await a.register_model(tiny_model())
        n, got = await a.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)


async def test_stats_counts_only_the_callers_namespaces(daemon: RunningServer) -> None:
    """Stats showed every tenant the per-model block and token counts of all namespaces (and every session)."""
    fp, toks, _, _ = await alice_prefix(daemon)  # 4 blocks and a session of hers
    async with as_(daemon, BOB) as b:
        stats = await b.stats()
        assert stats.models == () and stats.replay.sessions == 0 and stats.replay.persisted_window_bytes == 0
        await b.register_model(tiny_model())
        mine = tokens(BLOCK_TOKENS, seed=99)
        await b.put(fp, mine, random_kv(tiny_model(), BLOCK_TOKENS, seed=99))
        stats = await b.stats()
        assert [(m.model_fingerprint, m.blocks, m.tokens) for m in stats.models] == [(fp, 1, BLOCK_TOKENS)]
        assert [n.namespace for n in stats.namespaces] == ["bob"]
    async with as_(daemon, ALICE) as a:
        stats = await a.stats()
        assert [(m.blocks, m.tokens) for m in stats.models] == [(4, len(toks))] and stats.replay.sessions == 1
    async with as_(daemon, ADMIN) as admin:  # positive control: the admin sees both
        stats = await admin.stats()
        assert [(m.blocks, m.tokens) for m in stats.models] == [(5, len(toks) + BLOCK_TOKENS)]
        assert {n.namespace for n in stats.namespaces} == {"alice", "bob"} and stats.replay.sessions == 1


async def test_a_namespace_named_twice_in_a_tenants_scope_is_its_once(server_factory: Any) -> None:
    """auth.tenants.<name>.namespaces naming one twice gave the tenant it twice: its Stats listed the namespace
    twice, and its pinned bytes counted twice against its pin share (summed over its namespaces). Kept once, in
    the order given."""
    config = {**AUTH, "auth.tenants.bob.namespaces": "bob, bob-scratch,bob , bob-scratch"}
    tenancy = Tenancy.from_config(load_config(env={}, overrides=config).auth)
    assert tenancy is not None
    assert {p.name: p.namespaces for p in tenancy.tenants()}["bob"] == ("bob", "bob-scratch")
    srv = await server_factory(**config)
    async with as_(srv, BOB) as b:
        fp = await b.register_model(tiny_model())
        await b.put(fp, tokens(BLOCK_TOKENS, seed=5), random_kv(tiny_model(), BLOCK_TOKENS, seed=5))
        assert [n.namespace for n in (await b.stats()).namespaces] == ["bob"]
    async with as_(srv, BOB, "bob-scratch") as b:  # the second namespace, still in its scope
        await b.register_model(tiny_model())
        await b.put(fp, tokens(BLOCK_TOKENS, seed=6), random_kv(tiny_model(), BLOCK_TOKENS, seed=6))
        assert [n.namespace for n in (await b.stats()).namespaces] == ["bob", "bob-scratch"]


async def test_keys_depend_on_the_salt_secret(server_factory: Any) -> None:
    """The salt is derived from auth.salt_secret: daemons sharing it compute the same keys (prefixes match
    across a cluster and a restart), a daemon with another secret computes others (so the keys cannot be
    derived by anyone who runs the same code without the secret)."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=5)
    kv = random_kv(spec, len(toks), seed=5)
    keys = []
    for secret in ("test-secret", "test-secret", "another-secret"):
        srv = await server_factory(**{**AUTH, "auth.salt_secret": secret})
        async with as_(srv, ALICE) as a:
            fp = await a.register_model(spec)
            keys.append((await a.put(fp, toks, kv)).keys)
    assert keys[0] == keys[1] and not set(keys[0]) & set(keys[2])


async def test_a_tenants_stats_do_not_count_another_tenants_tokens_pins_or_lookups(daemon: RunningServer) -> None:
    """Bob's Stats showed the tokens and pinned blocks of every namespace per tier, and the daemon's lookup token
    counters: the difference of two of his Stats told him the exact length of Alice's prompt in between. The
    tiers' tokens and pins now count his namespaces only, the lookup counters are the admin's; so do the tiers'
    bytes and blocks (tests/test_stats_scope.py)."""
    fp, toks, _, keys = await alice_prefix(daemon)
    async with as_(daemon, ALICE) as a:
        await a.pin(fp, keys[:2])
    async with as_(daemon, BOB) as b, as_(daemon, ALICE) as a:
        before = await b.stats()
        await a.lookup(fp, np.concatenate([toks, tokens(37, seed=5)]))  # 37 tokens she misses
        after = await b.stats()
        assert sum(t.tokens for t in after.tiers) == 0 and sum(t.pinned_blocks for t in after.tiers) == 0
        assert (after.lookups, after.lookup_hit_tokens, after.lookup_miss_tokens) == (0, 0, 0)
        assert after.lookup_miss_tokens - before.lookup_miss_tokens == 0
        assert sum(t.blocks for t in after.tiers) == 0  # hers are not his
        mine = tokens(BLOCK_TOKENS, seed=98)
        await b.register_model(tiny_model())
        await b.put(fp, mine, random_kv(tiny_model(), BLOCK_TOKENS, seed=98))
        assert sum(t.tokens for t in (await b.stats()).tiers) >= BLOCK_TOKENS  # his own blocks count
    async with as_(daemon, ADMIN) as admin:  # positive control: the admin sees every namespace's
        stats = await admin.stats()
        assert sum(t.pinned_blocks for t in stats.tiers) >= 2 and stats.lookup_miss_tokens >= 37


async def test_the_admins_stats_list_a_namespace_that_holds_only_sessions(daemon: RunningServer) -> None:
    """Alice's blocks evicted whole, her session stays: the admin's Stats left her namespace out (so `engram stats
    -n alice` said it was unknown) while her own Stats and `engram ls` listed it."""
    await alice_prefix(daemon)
    async with as_(daemon, ADMIN) as admin:
        await admin.evict(whole_namespace=True, force=True, namespace="alice")
        assert "alice" in {n.namespace for n in (await admin.stats()).namespaces}
    async with as_(daemon, ALICE) as a:
        assert "alice" in {n.namespace for n in (await a.stats()).namespaces}


async def test_one_tenants_idle_streams_cannot_take_every_slot_from_the_others(server_factory: Any) -> None:
    """Bob opened Put streams that send nothing until the daemon's max_concurrent_rpcs was reached: every other
    caller was refused, health checks included (an audit). Now each token has a share of the calls in flight
    (server.max_concurrent_rpcs_per_tenant): past it Bob's calls are RESOURCE_EXHAUSTED, Alice and the admin are
    served, and Bob's share comes back when his streams end."""
    import asyncio

    import grpc


    srv = await server_factory(**AUTH, **{"server.max_concurrent_rpcs": 8,
                                          "server.max_concurrent_rpcs_per_tenant": 3})
    async with grpc.aio.insecure_channel(srv.address) as ch:
        idle = silent_puts(ch, 8, (("authorization", f"Bearer {BOB}"),))
        await asyncio.sleep(0.3)  # all started on the daemon: three hold Bob's share, five were refused
        async with as_(srv, BOB) as b:
            with pytest.raises(errors.ResourceExhausted, match="max_concurrent_rpcs_per_tenant"):
                await b.stats()
        async with as_(srv, ALICE) as a, as_(srv, ADMIN) as admin:
            assert (await a.stats()).version and (await admin.stats()).version
            await a.register_model(tiny_model())
        for call in idle:
            call.cancel()
        await asyncio.sleep(0.3)
    async with as_(srv, BOB) as b:
        assert (await b.stats()).version  # his share is back


async def test_one_tenant_cannot_fill_the_daemons_model_registry(server_factory: Any, tmp_path: Path) -> None:
    """Bob registered server.max_models models in a second and every other tenant's RegisterModel was refused
    (an audit): each token may register server.max_models_per_tenant models; registering one of its own again is
    free, one another tenant registered is not (tests/test_model_visibility.py). The share outlives a restart
    (kept in memory only, it let Bob fill the registry over a few restarts)."""
    cfg = {**AUTH, "server.max_models": 8, "server.max_models_per_tenant": 3, "tiers.nvme.path": str(tmp_path / "n")}
    first = await server_factory(**cfg)
    async with as_(first, BOB) as b:
        await b.register_model(tiny_model(weights_id="bob-0"))
        await b.register_model(tiny_model(weights_id="bob-1"))
    await first.stop(0)
    srv = await server_factory(**cfg)  # the same registry on disk
    async with as_(srv, BOB) as b:  # each holds a block: it keeps its place (an idle one gives it up)
        mine = [await register_holding(b, tiny_model(weights_id=f"bob-{i}"), i) for i in range(3)]  # one more is new
        with pytest.raises(errors.ResourceExhausted, match="has registered 3 models"):
            await b.register_model(tiny_model(weights_id="bob-3"))
        assert await b.register_model(tiny_model(weights_id="bob-1")) == mine[1]  # his own again: free
    async with as_(srv, ALICE) as a:
        await register_holding(a, tiny_model(weights_id="bob-2"))  # one the daemon knows: one of her share too
        for i in range(2):
            await register_holding(a, tiny_model(weights_id=f"alice-{i}"), i)
        with pytest.raises(errors.ResourceExhausted, match="has registered 3 models"):
            await a.register_model(tiny_model(weights_id="alice-2"))
    async with as_(srv, ADMIN, "admin") as admin:  # the admin has no share; the daemon's bound still holds
        for i in range(3):  # 5 models known (bob-0..2, alice-0..1): 3 more fill server.max_models
            await register_holding(admin, tiny_model(weights_id=f"admin-{i}"), i)
        with pytest.raises(errors.ResourceExhausted, match=r"server\.max_models\)"):
            await admin.register_model(tiny_model(weights_id="admin-3"))


async def test_a_client_keeps_putting_after_the_daemon_restarts_with_another_salt_secret(tmp_path: Path) -> None:
    """The client keys a put's chain itself, with the namespace's salt asked once. A daemon restarted with
    another auth.salt_secret (a rotation) computes other keys: every later put of a running worker failed
    DataLoss "key versions differ?" though the daemon had stored its blocks, and its skip of the cached prefix
    never matched (every put sent every block; an audit, session 45). The client now asks for the salt again
    when the daemon's keys differ from its own: puts, skips of what is cached, lookups and loads all work."""
    spec = tiny_model()
    toks = tokens(3 * BLOCK_TOKENS + 5, seed=21)
    kv = random_kv(spec, len(toks), seed=21)
    config = {"server.unix_socket": str(tmp_path / "engram.sock"), "tiers.dram.capacity": "64MiB",
              "tiers.dram.prefault": False, **AUTH}
    srv = await start_server(load_config(env={}, overrides=config))
    async with as_(srv, ALICE) as a:
        try:
            fp = await a.register_model(spec)
            assert (await a.put(fp, toks, kv)).stored == 4
        finally:
            await srv.stop(0)
        srv = await start_server(load_config(env={}, overrides={**config, "auth.salt_secret": "rotated-secret"}))
        try:
            async def reached() -> bool:
                with contextlib.suppress(errors.Unavailable):
                    return bool(await a.stats())
                return False

            await until(reached, "the client reaches the restarted daemon")
            fp = await a.register_model(spec)  # DRAM only: it came back knowing no model and holding no block
            put = await a.put(fp, toks, kv)
            assert (put.stored, put.skipped) == (4, 0)
            hit = await a.lookup(fp, toks)
            assert hit.matched_tokens == len(toks) and [b.key for b in hit.blocks] == list(put.keys)
            again = await a.put(fp, toks, kv)  # the cached full blocks are recognised: only the partial tail goes
            assert (again.stored, again.deduplicated, again.skipped, again.keys) == (0, 1, 3, put.keys)
            longer = np.concatenate([toks[: 3 * BLOCK_TOKENS], tokens(2 * BLOCK_TOKENS, seed=22)])
            more = random_kv(spec, len(longer), seed=22)
            more[:, :, : 3 * BLOCK_TOKENS] = kv[:, :, : 3 * BLOCK_TOKENS]
            extended = await a.put(fp, longer, more)  # only the blocks after the cached prefix go
            assert (extended.stored, extended.skipped) == (2, 3)
            n, got = await a.get_prefix(fp, longer)
            assert n == len(longer) and torch.equal(got, more)
            assert torch.equal(torch.cat(await a.get(fp, list(put.keys)), dim=2), kv)
        finally:
            await srv.stop(0)
