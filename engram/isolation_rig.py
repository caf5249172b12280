"""Where `engram verify-isolation` runs its checks (engram/isolation.py).

Built in (the default): a throwaway deployment in a temporary directory, so every tier and path can be
reached on purpose: daemon A with tenancy on and an HBM tier on the CPU (`tiers.hbm.device = cpu`), the
shared DRAM pool and an NVMe tier; the owner's blocks are moved into each tier in turn (the store's
`keep_only_in`) and probed there. When `redis-server` is installed, a Redis with a password and daemon B
join A in a cluster (the Redis index and peer fetch are probed); daemon C has another `auth.salt_secret`
(does the salt depend on it?). Everything is stopped and removed at the end.

Live: against a running daemon with two tokens. Blocks stay where the daemon puts them, and the paths that
need a deployment of their own (per tier, Redis, peers, another secret) are reported "not checked".

Zero-copy memory and CUDA IPC are reported "not checked": a zero-copy Get is probed as a request (another
namespace's keys are NOT_FOUND before any descriptor), but the shared segment and an exported device allocation
hold every namespace's blocks: under tenancy the daemon hands out neither unless auth.same_host_paths = on.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from engram.client import EngramClient
from engram.cluster import block_record_key
from engram.config import load_config
from engram.errors import InvalidArgument
from engram.isolation import NOT_CHECKED, Check, Prober, Report, verdict
from engram.server import RunningServer, start_server

OWNER_NS, PROBER_NS = "isolation-owner", "isolation-prober"
TIERS = ("hbm", "dram", "nvme")
Progress = Callable[[str], None]

ZERO_COPY_NOTE = ("not probed here: the shared DRAM segment holds every namespace's blocks, so under tenancy the "
                  "daemon hands out no descriptors into it unless auth.same_host_paths = on trusts this host's "
                  "workers (tests/test_put_in_place.py); a zero-copy Get request is probed above")
CUDA_IPC_NOTE = "not probed here: needs a GPU, and which allocation a CUDA IPC handle exports is the hit path's"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _redis(password: str) -> Any:
    """A redis-server on a free port with a password, or None when none is installed."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        yield None
        return
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--requirepass", password], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "-a", password, "--no-auth-warning", "ping"],
                             capture_output=True, text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


class Rig:
    """Daemon A (every tier), and with Redis daemon B; daemon C with another salt secret; tokens for the
    owner, the prober and an admin."""

    def __init__(self, workdir: Path, redis_port: int | None, redis_password: str) -> None:
        self.workdir = workdir
        self.tokens = {name: secrets.token_hex(16) for name in ("owner", "prober", "admin")}
        self.salt_secret = secrets.token_hex(16)
        self.cluster_secret = secrets.token_hex(16)
        self.redis_port = redis_port
        self.redis_password = redis_password
        self.daemons: dict[str, RunningServer] = {}

    def _config(self, name: str, salt_secret: str, cluster: bool) -> dict[str, Any]:
        d = self.workdir / name
        (d / "shm").mkdir(parents=True, exist_ok=True)
        cfg: dict[str, Any] = {
            "server.port": 0, "tiers.hbm.capacity": "4MiB", "tiers.hbm.device": "cpu",
            "tiers.dram.capacity": "8MiB", "tiers.dram.shm_dir": str(d / "shm"), "tiers.nvme.path": str(d / "nvme"),
            "tiers.nvme.fsync": False, "logging.level": "error",
            "auth.tenants.owner.token": self.tokens["owner"], "auth.tenants.owner.namespaces": OWNER_NS,
            "auth.tenants.prober.token": self.tokens["prober"], "auth.tenants.prober.namespaces": PROBER_NS,
            "auth.admin_tokens": self.tokens["admin"], "auth.salt_secret": salt_secret}
        if cluster and self.redis_port is not None:
            cfg.update({"cluster.redis_url": f"redis://127.0.0.1:{self.redis_port}/0",
                        "cluster.redis_password": self.redis_password, "cluster.secret": self.cluster_secret,
                        "cluster.node_id": name, "cluster.heartbeat_s": 0.2, "cluster.ttl_s": 3.0})
        return cfg

    async def start(self) -> None:
        for name, secret, cluster in (("a", self.salt_secret, True), ("b", self.salt_secret, True),
                                      ("c", secrets.token_hex(16), False)):
            if name == "b" and self.redis_port is None:
                continue
            self.daemons[name] = await start_server(load_config(env={}, overrides=self._config(name, secret, cluster)))

    async def stop(self) -> None:
        for srv in self.daemons.values():
            await srv.stop(0)

    @contextlib.asynccontextmanager
    async def client(self, daemon: str, who: str, namespace: str) -> AsyncIterator[EngramClient]:
        async with EngramClient(self.daemons[daemon].address, token=self.tokens[who], namespace=namespace) as c:
            yield c


async def run_builtin(*, samples: int = 300, use_redis: bool = True, progress: Progress | None = None,
                      workdir: Path | None = None) -> Report:
    """Start the throwaway deployment, run every check, tear it down."""
    say = progress or (lambda _: None)
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engram-isolation-")))
        password = secrets.token_hex(12)
        port = stack.enter_context(_redis(password)) if use_redis else None
        rig = Rig(root, port, password)
        await rig.start()
        try:
            return await _run(rig, samples, say)
        finally:
            await rig.stop()
    raise AssertionError("unreachable")


async def _run(rig: Rig, samples: int, say: Progress) -> Report:
    report = Report()
    async with rig.client("a", "owner", OWNER_NS) as owner, rig.client("a", "prober", PROBER_NS) as other:
        p = Prober(owner, other, OWNER_NS, PROBER_NS)
        fp = await p.register()
        store = rig.daemons["a"].store
        last = None
        for i, tier in enumerate(TIERS):
            say(f"blocks in the {tier} tier")
            w = await p.write(fp, blocks=4, seed=100 + i)
            for meta in store.find(OWNER_NS, fp, w.keys):
                await store.keep_only_in(meta, tier)
            report.checks += await p.blocks(w, tier)
            last = w
        assert last is not None
        say("sessions, inspection, Stats")
        report.checks += await p.sessions(last)
        report.checks += await p.figures(last)
        report.checks.append(await p.models())
        say("the key salt")
        async with rig.client("c", "owner", OWNER_NS) as elsewhere:
            other_secret_salt = (await elsewhere.describe_namespace()).key_salt
        report.checks += await p.salts(last, other_secret_salt)
        report.checks += [Check("zero-copy memory", "dram", NOT_CHECKED, ZERO_COPY_NOTE),
                          Check("CUDA IPC", "hbm", NOT_CHECKED, CUDA_IPC_NOTE)]
        if rig.redis_port is None:
            report.checks += [Check("redis index", "cluster", NOT_CHECKED, "redis-server is not installed"),
                              Check("peer fetch", "cluster", NOT_CHECKED, "redis-server is not installed")]
        else:
            say("the Redis index and peer fetch")
            report.checks += await _cluster(rig, p, fp)
        say(f"timing ({samples} lookups per class, twice)")
        report.timing = await p.timing_verdict(fp, samples)
    return report


async def _until(check: Callable[[], Any], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return False


async def _cluster(rig: Rig, p: Prober, fp: bytes) -> list[Check]:
    import redis.asyncio as aioredis

    assert rig.redis_port is not None
    r = aioredis.Redis(port=rig.redis_port, password=rig.redis_password)
    checks = []
    try:
        # The cluster's counters are the admin's to read (a tenant's Stats leaves them 0: they move with every
        # tenant's fetches), so daemon B's are read with the admin token.
        async with rig.client("b", "owner", OWNER_NS) as owner_b, rig.client("b", "prober", PROBER_NS) as other_b, \
                rig.client("b", "admin", OWNER_NS) as admin_b:
            await owner_b.register_model(p.spec)
            await other_b.register_model(p.spec)

            async def joined() -> bool:
                return (await owner_b.stats()).cluster.live_nodes == 2
            await _until(joined)
            w = await p.write(fp, blocks=4, seed=300)

            async def published() -> bool:
                return all([await r.hexists(block_record_key(k), "a") for k in w.keys])
            control = await _until(published)
            other_salt = (await p.other.describe_namespace(PROBER_NS)).key_salt
            found = [k for k in p.candidate_keys(w, other_salt) if await r.exists(block_record_key(k))]
            checks.append(verdict("redis index: keys the prober can compute", "cluster", control, not found,
                                  f"{len(found)} of the owner's blocks are found in Redis under keys computed "
                                  "without the owner's salt" if found else ""))
            named = []
            async for name in r.scan_iter(match="engram:*"):
                kind = await r.type(name)
                values = await r.hvals(name) if kind == b"hash" else [await r.get(name)] if kind == b"string" else []
                named += [name for v in values if v and OWNER_NS.encode() in v]
            checks.append(verdict("redis index: records name no namespace", "cluster", control, not named))

            hits = (await admin_b.stats()).cluster.remote_hits
            missed = (await other_b.lookup(fp, w.tokens)).matched_tokens == 0
            by_key = await _refused_not_found(lambda: other_b.get(fp, w.keys, zero_copy=False))
            fetched_nothing = (await admin_b.stats()).cluster.remote_hits == hits

            async def owner_hits() -> bool:
                return (await owner_b.lookup(fp, w.tokens)).matched_tokens == len(w.tokens)
            owner_ok = await _until(owner_hits) and (await admin_b.stats()).cluster.remote_hits > hits
            checks.append(verdict("peer fetch: lookup by content", "cluster", owner_ok, missed and fetched_nothing))
            checks.append(verdict("peer fetch: get by key", "cluster", owner_ok, by_key))
            # Now the blocks are on B too: still nothing for the prober there.
            checks.append(verdict("peer fetch: after the owner's copy", "cluster", owner_ok,
                                  (await other_b.lookup(fp, w.tokens)).matched_tokens == 0 and
                                  await _refused_not_found(lambda: other_b.get(fp, w.keys, zero_copy=False))))
    finally:
        await r.aclose()
    return checks


async def _refused_not_found(call: Callable[[], Any]) -> bool:
    from engram import errors
    from engram.isolation import refused

    return await refused(call, errors.NotFound)


def check_two_tenants(owner_ns: str, other_ns: str) -> None:
    """A live run compares two namespaces: refuse tokens that do not resolve to two. In one namespace the prober
    reaches the owner's blocks by right (it failed on a session "not in this namespace"); an admin token (or
    any token with tenancy off) acts in "" when it names none, and "" named by the prober's calls is its own
    namespace, so the owner's blocks were "found" there: false leaks."""
    for who, flag, ns in (("owner", "--namespace", owner_ns), ("prober", "--other-namespace", other_ns)):
        if not ns:
            raise InvalidArgument(f"the {who}'s token acts in no namespace of its own (an admin token, or a daemon "
                                  f"with tenancy off): give a tenant's token, or name its namespace with {flag}")
    if owner_ns == other_ns:
        raise InvalidArgument(f"both tokens act in namespace {owner_ns!r}: nothing to verify; give the prober "
                              "(--other-token) another tenant's token, or name another namespace with "
                              "--other-namespace")


async def run_live(address: str, owner_token: str, other_token: str, owner_ns: str, other_ns: str, *,
                   samples: int = 300, root_cert: bytes | None = None, progress: Progress | None = None) -> Report:
    """The checks a running daemon allows, with two tenants' tokens (the owner's blocks stay where the
    daemon puts them)."""
    say = progress or (lambda _: None)
    report = Report()
    async with EngramClient(address, token=owner_token, namespace=owner_ns, root_cert=root_cert) as owner, \
            EngramClient(address, token=other_token, namespace=other_ns, root_cert=root_cert) as other:
        owner_ns = owner_ns or (await owner.describe_namespace()).namespace
        other_ns = other_ns or (await other.describe_namespace()).namespace
        check_two_tenants(owner_ns, other_ns)
        p = Prober(owner, other, owner_ns, other_ns)
        fp = await p.register()
        say("blocks where the daemon put them")
        w = await p.write(fp, blocks=4, seed=secrets.randbits(30))
        report.checks += await p.blocks(w, "-")
        say("sessions, inspection, Stats")
        report.checks += await p.sessions(w)
        report.checks += await p.figures(w)
        report.checks.append(await p.models())
        report.checks += await p.salts(w, None)
        for path, note in (("blocks on each tier", "needs the built-in run (it moves blocks between tiers)"),
                           ("redis index", "needs the built-in run (it reads Redis with its password)"),
                           ("peer fetch", "needs the built-in run (a second daemon)"),
                           ("zero-copy memory", ZERO_COPY_NOTE), ("CUDA IPC", CUDA_IPC_NOTE)):
            report.checks.append(Check(path, "-", NOT_CHECKED, note))
        say(f"timing ({samples} lookups per class, twice)")
        report.timing = await p.timing_verdict(fp, samples, seed=secrets.randbits(30))
    return report
