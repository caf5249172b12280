"""`engram verify-isolation` and the checks behind it (engram/isolation.py), and tests of those checks:
with the per-namespace key salt removed, made constant, or made independent of `auth.salt_secret`, the
checks must report a leak (a check that passes whatever the salt is proves nothing)."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
from typing import Any

import pytest
from typer.testing import CliRunner

from engram.cli.main import app
from engram.isolation import ISOLATED, LEAK, NOT_CHECKED
from engram.isolation_rig import run_builtin
from engram.tenancy import SALT_BYTES, Tenancy

HAS_REDIS = shutil.which("redis-server") is not None
TIERS = {"hbm", "dram", "nvme"}


def run_cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, ["verify-isolation", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_the_built_in_run_probes_every_tier_and_path_and_finds_them_isolated() -> None:
    code, out = run_cli("--samples", "300")
    checks = out["checks"]
    statuses = {(c["path"], c["tier"]): c["status"] for c in checks}
    assert out["leaks"] == [] and out["inconclusive"] == [] and code == 0, out["leaks"]
    for tier in TIERS:  # every by-content and by-key path, on every tier, with its positive control
        for path in ("lookup by content", "get by key", "zero-copy get by key (the request)", "pin by key",
                     "describe blocks by key", "evict by key", "naming the owner's namespace"):
            assert statuses[(path, tier)] == ISOLATED, (path, tier)
    for path in ("session resume by id", "stats: per-model blocks", "key salt: per namespace", "key salt: keys need it",
                 "key salt: another tenant's salt", "key salt: depends on auth.salt_secret",
                 "a model only the owner registered"):
        assert statuses[(path, "-")] == ISOLATED, path
    cluster = [c for c in checks if c["tier"] == "cluster"]
    want = ISOLATED if HAS_REDIS else NOT_CHECKED  # without redis-server they are reported, not passed
    assert len(cluster) >= 2 and all(c["status"] == want for c in cluster), cluster
    assert statuses[("zero-copy memory", "dram")] == statuses[("CUDA IPC", "hbm")] == NOT_CHECKED
    assert out["timing"]["samples"] == 300 and 0.0 <= out["timing"]["across_auc"] <= 1.0


def _removed(self: Tenancy, namespace: str) -> bytes:
    return b""


def _constant(self: Tenancy, namespace: str) -> bytes:
    return b"\x42" * SALT_BYTES


def _secretless(self: Tenancy, namespace: str) -> bytes:
    # Per namespace and unguessable-looking, but the same on every daemon whatever its auth.salt_secret.
    return hmac.new(b"a key in the code", namespace.encode(), hashlib.sha256).digest()[:SALT_BYTES]


@pytest.mark.parametrize(("salt", "caught_by"), [
    (_removed, {"key salt: keys need it", "key salt: per namespace"}
     | ({"redis index: keys the prober can compute"} if HAS_REDIS else set())),
    (_constant, {"key salt: per namespace", "key salt: another tenant's salt"}
     | ({"redis index: keys the prober can compute"} if HAS_REDIS else set())),
    (_secretless, {"key salt: depends on auth.salt_secret"}),
], ids=["removed", "constant", "independent-of-the-secret"])
async def test_the_checks_catch_a_broken_salt(monkeypatch: pytest.MonkeyPatch, salt: Any, caught_by: set[str]) -> None:
    monkeypatch.setattr(Tenancy, "salt", salt)
    report = await run_builtin(samples=20)
    leaked = {c.path for c in report.checks if c.status == LEAK}
    assert caught_by <= leaked, f"{salt.__name__}: only {leaked} reported"
    # Lookups by content stay isolated (the namespace is in every key's root): only the salt checks see it.
    assert all(c.status != LEAK for c in report.checks if c.path == "lookup by content")


def test_the_cli_exits_1_on_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Tenancy, "salt", _constant)
    code, out = run_cli("--samples", "20", "--no-redis")
    assert code == 1 and any("key salt: per namespace" in leak for leak in out["leaks"])


async def test_a_live_daemon_with_two_tokens(server_factory: Any) -> None:
    srv = await server_factory(**{"auth.tenants.a.token": "ta", "auth.tenants.b.token": "tb",
                                  "auth.salt_secret": "s"})
    import asyncio

    code, out = await asyncio.to_thread(run_cli, "--address", srv.address, "--token", "ta", "--other-token", "tb",
                                        "--samples", "300")
    statuses = {c["path"]: c["status"] for c in out["checks"]}
    assert code == 0 and out["leaks"] == [], out
    assert statuses["lookup by content"] == statuses["get by key"] == statuses["session resume by id"] == ISOLATED
    assert statuses["a model only the owner registered"] == ISOLATED
    for path in ("blocks on each tier", "redis index", "peer fetch", "zero-copy memory", "CUDA IPC",
                 "key salt: depends on auth.salt_secret"):
        assert statuses[path] == NOT_CHECKED, path


async def test_a_live_run_refuses_two_tokens_that_act_in_one_namespace(server_factory: Any) -> None:
    # Tenants a and a2 share namespace "a"; with tenancy off every token acts in "".
    srv = await server_factory(**{"auth.tenants.a.token": "ta", "auth.tenants.a2.token": "ta2",
                                  "auth.tenants.a2.namespaces": "a", "auth.salt_secret": "s"})
    import asyncio

    for owner, other in (("ta", "ta"), ("ta", "ta2")):
        res = await asyncio.to_thread(CliRunner().invoke, app, ["verify-isolation", "--address", srv.address,
                                                                "--token", owner, "--other-token", other])
        assert res.exit_code == 4, res.output  # refused up front, not a session "not in this namespace"
        assert "both tokens act in namespace 'a': nothing to verify" in res.stderr, res.stderr
        assert "no session" not in res.stderr and res.stdout == ""


async def test_a_live_run_refuses_a_token_that_acts_in_no_namespace(server_factory: Any) -> None:
    # An admin token (and any token with tenancy off) acts in "", which the prober's own calls also name:
    # the owner's blocks were "found" by the prober, two false leaks.
    srv = await server_factory(**{"auth.tenants.a.token": "ta", "auth.tenants.b.token": "tb",
                                  "auth.admin_tokens": "adm", "auth.salt_secret": "s"})
    open_srv = await server_factory()
    import asyncio

    for address, owner, other, who in ((srv.address, "adm", "tb", "owner"), (srv.address, "ta", "adm", "prober"),
                                       (open_srv.address, "x", "y", "owner")):
        res = await asyncio.to_thread(CliRunner().invoke, app, ["verify-isolation", "--address", address,
                                                                "--token", owner, "--other-token", other])
        assert res.exit_code == 4, res.output
        assert f"the {who}'s token acts in no namespace of its own" in " ".join(res.stderr.split()), res.stderr
        assert res.stdout == ""
    # An admin token acting in a namespace named for it is a fine owner: the tenant's probes are denied.
    code, out = await asyncio.to_thread(run_cli, "--address", srv.address, "--token", "adm", "--namespace", "a",
                                        "--other-token", "tb", "--samples", "20")
    assert all(c["status"] != LEAK for c in out["checks"]), out  # (20 timed samples: the timing verdict is noise)
