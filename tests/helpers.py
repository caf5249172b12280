"""Small real objects the tests share: a tiny layout and model, seeded KV and tokens, free ports, and
waiting for a daemon subprocess to become healthy. (Imported as `helpers`: pytest puts tests/ on sys.path,
and not the repository root, whose kernels/ directory would shadow Hugging Face's `kernels` package.)"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import pytest
import torch

from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

if TYPE_CHECKING:  # the store stays unimported for tests that only need a layout
    from engram.index import BlockMeta
    from engram.store import BlockStore

BLOCK_TOKENS = 16

# Modules a test file needs that this machine is known to lack, comma-separated (e.g. "triton,transformers"):
# their files skip, saying so. Unset (as in CI), a missing one fails: see missing().
TESTS_WITHOUT = "ENGRAM_TESTS_WITHOUT"


def missing(module: str, why: str) -> NoReturn:
    """What a test or test file does when `module` is not installed (its caller checked with find_spec, before
    importing anything that needs it): fail. It is part of the build (the C codec engram.codec._cpu, compiled by
    every install) or of the dev extra `make test` installs (triton, transformers), so a skip would only hide a
    broken install behind a green run. A machine that lacks it on purpose names it in ENGRAM_TESTS_WITHOUT, and
    the file skips instead."""
    if module in {name.strip() for name in os.environ.get(TESTS_WITHOUT, "").split(",")}:
        pytest.skip(f"{module} is not installed: {why} ({TESTS_WITHOUT} names it)", allow_module_level=True)
    pytest.fail(f"{module} is not installed: {why}. It is a declared dependency of the tests (pyproject.toml, "
                f"`make test`); on a machine meant to lack it, set {TESTS_WITHOUT}={module} to skip these tests",
                pytrace=False)


def tiny_layout(dtype: DType = DType.BF16, block_tokens: int = BLOCK_TOKENS) -> KVLayout:
    # 4 layers alternating sliding (W=8) and global: blocks carry the 2 global layers.
    layers = (LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)) * 2
    return KVLayout(layers=layers, num_kv_heads=2, head_dim=16, dtype=dtype, block_tokens=block_tokens)


def tiny_model(dtype: DType = DType.BF16, weights_id: str = "seed-0", codec: str = "raw") -> ModelSpec:
    # raw by default, so round trips are bit-exact; the codec tests name their codec.
    return ModelSpec(name="tiny-hybrid", weights_id=weights_id, layout=tiny_layout(dtype), codec=codec)


def long_block_model() -> ModelSpec:
    """A model of 4096-token blocks of 2 MiB: a BlockHeader of about 10 KB (its tokens), past the 4 KiB that
    server.chunk_bytes must leave under server.max_message_bytes (LEAST_ROOM)."""
    return ModelSpec("long", "w", KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=128,
                                           dtype=DType.BF16, block_tokens=4096), codec="raw")


LEAST_ROOM = {"server.chunk_bytes": 2**20, "server.max_message_bytes": 2**20 + 4096}  # the least config allows


def random_kv(spec: ModelSpec, n_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = spec.layout.block_shape(n_tokens)
    return torch.randn(shape, generator=gen).to(spec.layout.dtype.torch_dtype)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32_000, n, dtype=np.int32)


async def register_holding(client: Any, spec: ModelSpec, seed: int = 0) -> bytes:
    """Register a model and store a block of it: a registration that holds a block keeps its place against the
    registry's bounds (engram/server/modelroom.py); one that holds nothing gives it up to a new model."""
    fp: bytes = await client.register_model(spec)
    await client.put(fp, tokens(BLOCK_TOKENS, seed), random_kv(spec, BLOCK_TOKENS, seed))
    return fp


def dram_store(capacity_blocks: int = 64, spec: ModelSpec | None = None) -> tuple[BlockStore, bytes]:
    """A real BlockStore over one real DRAM tier that holds `capacity_blocks` full blocks of `spec` (tiny_model
    by default), with the model registered; returns the store and the model's fingerprint."""
    from engram.registry import ModelRegistry
    from engram.store import BlockStore
    from engram.tiers.dram import DramTier

    spec = spec or tiny_model()
    tier = DramTier(capacity_blocks * spec.layout.block_nbytes(spec.layout.block_tokens))
    store = BlockStore([tier], ModelRegistry(default_codec="raw"))
    return store, store.registry.register(spec)


async def put_tokens(store: BlockStore, namespace: str, fingerprint: bytes, toks: np.ndarray,
                     kv: torch.Tensor | None = None, *, seed: int = 0) -> list[BlockMeta]:
    """Put `toks` as a chain of raw blocks, the last one partial if the length says so, as a worker does;
    `kv` is the whole sequence's (global layers, 2, T, kv heads, head dim), seeded random KV if None.
    Returns the chain's blocks in order."""
    from engram.block import BlockHeader, checksum

    spec = store.registry.get(fingerprint)
    bt = spec.layout.block_tokens
    kv = random_kv(spec, len(toks), seed) if kv is None else kv
    parent, keys = store.root(namespace, fingerprint), []
    for i, start in enumerate(range(0, len(toks), bt)):
        end = min(start + bt, len(toks))
        payload = kv[:, :, start:end].contiguous().view(torch.uint8).numpy().tobytes()
        header = BlockHeader(toks[start:end], spec.layout.dtype, spec.layout.block_shape(end - start), len(payload),
                             checksum(payload))
        parent = (await store.put(namespace, fingerprint, parent, header, payload, index=i)).key
        keys.append(parent)
    return store.find(namespace, fingerprint, keys)


async def put_raw_chain(store: BlockStore, namespace: str, spec: ModelSpec, seed: int, n_blocks: int) -> list[bytes]:
    """Put n_blocks full raw blocks of seeded tokens and KV through the store, one put per block as the daemon
    does; the chain's keys (each block is acknowledged before the next is put)."""
    from engram.block import BlockHeader, checksum
    from engram.codec.stored import RAW, encode
    from engram.keys import root_key

    bt = spec.layout.block_tokens
    toks = tokens(n_blocks * bt, seed=seed)
    kv = random_kv(spec, len(toks), seed=seed)
    parent = root_key(namespace, spec.fingerprint)
    keys = []
    for i in range(n_blocks):
        block = kv[:, :, i * bt : (i + 1) * bt]
        payload = encode(block, RAW)
        header = BlockHeader(toks[i * bt : (i + 1) * bt], spec.layout.dtype, tuple(block.shape), len(payload),
                             checksum(payload))
        parent = (await store.put(namespace, spec.fingerprint, parent, header, payload, index=i)).key
        keys.append(parent)
    return keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(address: str, proc: subprocess.Popen[str], timeout: float = 20.0, root_cert: bytes | None = None
             ) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from engram.wire.channel import RECONNECT_OPTIONS

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"engram serve exited early: {proc.stdout.read() if proc.stdout else ''}")
        try:
            creds = grpc.ssl_channel_credentials(root_cert) if root_cert else None
            with (grpc.secure_channel(address, creds, options=RECONNECT_OPTIONS) if creds
                  else grpc.insecure_channel(address, options=RECONNECT_OPTIONS)) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            time.sleep(0.1)
    raise AssertionError("daemon did not become healthy")


ENGRAM = [sys.executable, "-m", "engram"]
# Subprocesses run outside the checkout: `python -m` puts its working directory on sys.path, and the
# repository root's kernels/ would shadow Hugging Face's `kernels` package there.
NEUTRAL_CWD = tempfile.gettempdir()


@contextlib.contextmanager
def engram_daemon(tmp_path: Path, *args: str, env: dict[str, str] | None = None
                  ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A real `engram serve` subprocess on a unix socket in tmp_path; yields (address, process), killed at exit.
    Its stdout and stderr go to one pipe (read it after it stops)."""
    sock = tmp_path / "engram.sock"
    full_env = {**os.environ, "ENGRAM_TIERS__DRAM__CAPACITY": "64MiB", **(env or {})}
    proc = subprocess.Popen([*ENGRAM, "serve", "--unix-socket", str(sock), "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=NEUTRAL_CWD)
    address = f"unix:{sock}"
    try:
        wait_for(address, proc)
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


class RestartingDaemon:
    """A real `engram serve` subprocess on one socket in tmp_path that `restart` stops (SIGKILL) and starts again
    there: DRAM only, it comes back holding no block and knowing no model."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self._running: contextlib.ExitStack | None = None
        self.address = self._start()

    def _start(self) -> str:
        self._running = contextlib.ExitStack()
        address, _ = self._running.enter_context(engram_daemon(self.tmp_path, env=self.env))
        return address

    def restart(self, *clients: Any) -> None:
        """Stop the daemon and start another on its socket; return once each of `clients` (sync clients) reaches
        it (a channel that lost its daemon reconnects with a back-off of up to a few seconds)."""
        self.close()
        assert self._start() == self.address
        for client in clients:
            wait_reachable(client)

    def close(self) -> None:
        if self._running is not None:
            self._running.close()
            self._running = None

    def __enter__(self) -> RestartingDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_reachable(client: Any) -> None:
    """Wait for a sync client's channel to reach a daemon just started (its reconnect backs off up to 2 s)."""
    from engram.errors import Unavailable

    for _ in range(200):
        try:
            client.stats()
            return
        except Unavailable:
            time.sleep(0.05)
    raise AssertionError("the daemon did not answer within 10 s of starting")


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """(cert, key): a throwaway certificate for localhost and 127.0.0.1, made by the openssl CLI."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True,
                   env={**os.environ, "OPENSSL_CONF": "/dev/null"})
    return cert, key


def redis_cli(port: int, *args: str, password: str = "") -> str:
    auth = ["-a", password, "--no-auth-warning"] if password else []
    return subprocess.run(["redis-cli", "-p", str(port), *auth, *args], capture_output=True, text=True).stdout.strip()


def start_redis(port: int, *args: str, password: str = "", ping_port: int | None = None,
                ping_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """A real redis-server on 127.0.0.1:port (no persistence), with extra args (requirepass, TLS, cluster);
    returns once it answers PING. `ping_port`/`ping_args` reach it where plain TCP on `port` would not (TLS)."""
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = subprocess.run(["redis-cli", "-p", str(ping_port or port), *ping_args,
                              *(["-a", password, "--no-auth-warning"] if password else []), "ping"],
                             capture_output=True, text=True).stdout.strip()
        if out == "PONG":
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("redis-server did not start")


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "256k", inodes: int | None = None) -> Iterator[Path]:
    """A real tmpfs of `size` mounted at `where` (a real full disk: ENOSPC from the kernel); root only, and the
    test is skipped where the machine refuses the mount. A full tmpfs still makes directories (they take no
    pages); `inodes` bounds its files and directories, so that filling them makes mkdir fail as well."""
    where.mkdir()
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes is not None else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine refuses a tmpfs mount: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def silent_puts(channel: Any, n: int, metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    """n Put streams that send nothing (each holds a call slot of its caller until cancelled)."""
    import asyncio

    from engram.v1 import engram_pb2 as pb

    put = channel.stream_unary("/engram.v1.Engram/Put", request_serializer=pb.PutRequest.SerializeToString,
                               response_deserializer=pb.PutResponse.FromString)
    never = asyncio.Event()

    async def silent() -> Any:
        await never.wait()
        yield pb.PutRequest()

    return [put(silent(), metadata=metadata) for _ in range(n)]


async def until(check: Any, what: str, timeout: float = 20.0) -> None:
    """Wait for a state daemons reach by themselves (`check`: an async callable answering whether it holds): a
    bound on waiting, not a timing assertion."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never reached: {what}")


# A signed cluster that notices joins and deaths quickly: the cluster tests' daemons
CLUSTER = {"cluster.heartbeat_s": 0.2, "cluster.ttl_s": 10.0, "cluster.secret": "cluster-secret"}


async def cluster_daemon(redis_port: int, node_id: str) -> Any:
    """An in-process daemon (a RunningServer) on a free TCP port in the cluster of the redis-server on redis_port."""
    from engram.config import load_config
    from engram.server import start_server

    return await start_server(load_config(env={}, overrides={
        "server.port": 0, "tiers.dram.capacity": "64MiB", "server.metrics_port": -1,
        "cluster.redis_url": f"redis://127.0.0.1:{redis_port}/0", "cluster.node_id": node_id, **CLUSTER}))


async def cluster_joined(client: Any) -> None:
    """Wait until the client's daemon says it is in the cluster."""
    async def ok() -> bool:
        return str((await client.stats()).cluster.state) == "ok"

    await until(ok, "the daemon joined the cluster")


def rpcs_answered(srv: Any, method: str, code: str = "OK") -> float:
    """Calls of `method` the daemon answered with `code`, from its /metrics registry (start it with
    server.metrics_port -1): what a test counts to know a put went in place (ReservePut) and in how many rounds,
    which a client falling back to bytes would never show."""
    assert srv.metrics is not None, "start the daemon with server.metrics_port -1"
    return srv.metrics.registry.get_sample_value("engram_rpcs_total", {"method": method, "code": code}) or 0.0


def rpcs_served(srv: Any, method: str) -> float:
    """Calls of `method` the daemon answered, whatever their status (its /metrics registry; server.metrics_port
    -1): what a test counts to know whether a daemon asked a peer at all."""
    assert srv.metrics is not None, "start the daemon with server.metrics_port -1"
    return sum(s.value for m in srv.metrics.registry.collect() if m.name == "engram_rpcs" for s in m.samples
               if s.name == "engram_rpcs_total" and s.labels["method"] == method)


class FirstIoHeld:
    """An NVMe tier's `fault_hook` that holds the tier's first `op` ("write", "read", "delete") in its I/O thread
    until `go` is set (30 s at most): `entered` is set once it is held."""

    def __init__(self, op: str) -> None:
        self.op, self.entered, self.go = op, threading.Event(), threading.Event()

    def __call__(self, op: str, path: Path) -> None:
        if op == self.op and not self.entered.is_set():
            self.entered.set()
            self.go.wait(30)


def damage_pool_and_file(pool: Any, nvme: Any, key: bytes) -> None:
    """A byte flipped in the block's copy in the shared pool and in its NVMe file."""
    pool.view(key)[-1] ^= 0x40
    path = nvme.path_of(key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
