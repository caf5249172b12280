"""Build, start and stop a daemon: the factory tests use (port 0 or a unix socket, returns the real
address) and the long-running `engram serve` loop with graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engram import compiled
from engram.cluster import ClusterIndex
from engram.codec.base import default_backend, resolve_default_codec
from engram.collector import CollectorSchedule
from engram.config import EngramConfig, ServerConfig, secret_files
from engram.errors import AddressInUse, ConfigError, InsufficientResources
from engram.inspection import Inspector
from engram.lockfile import DaemonLock
from engram.logs import report_activity
from engram.metrics import MetricsEndpoint
from engram.private import remove_stale_socket, secure_socket, socket_umask
from engram.registry import ModelRegistry
from engram.replay.costmodel import Calibration, CostModel, FidelityFloor, machine_id
from engram.replay.runtime import ReplayRuntime
from engram.server.dataport import DataPort
from engram.server.inspection import InspectionService
from engram.server.openrpcs import OpenServiceGuard
from engram.server.peers import PeerFetcher
from engram.server.service import SERVICE_NAME, EngramService
from engram.sessions import SessionManager
from engram.store import BlockStore, WritePolicy, pins
from engram.store.quality import QualityWatch
from engram.tenancy import Tenancy, resolve_secret
from engram.tiers import nvmedir
from engram.tiers.base import Tier
from engram.tiers.dram import DramTier, shared_dram_tier
from engram.tiers.hbm import hbm_tier
from engram.tiers.nvme import NvmeTier
from engram.tiers.shm import mem_available
from engram.trust import ClusterTrust
from engram.v1 import engram_pb2
from engram.wire.channel import (
    MAX_SOCKET_PATH,
    message_options,
    server_keepalive_options,
    server_receive_window_options,
)

log = logging.getLogger("engram.server")


async def build_store(config: EngramConfig, tenancy: Tenancy | None = None) -> BlockStore:
    """The tiers the config names, and the index recovered from the NVMe tier when there is one. A failure
    closes what was built (the shared DRAM segment was left behind, for the next start to remove)."""
    tiers: list[Tier] = []
    try:
        return await _build_store(config, tenancy, tiers)
    except BaseException:
        for tier in tiers:
            with contextlib.suppress(Exception):
                await tier.close()
        raise


async def _build_store(config: EngramConfig, tenancy: Tenancy | None, tiers: list[Tier]) -> BlockStore:
    t = config.tiers
    d = t.dram
    shm_files = ("tiers.dram.shm_dir", d.shm_dir, "its shared segment", _SHM_FIX)
    # The workers' group may connect to the socket; where the same-host paths are on, it maps the pools too.
    group = config.server.unix_socket_group if config.auth.same_host_allowed else ""
    if t.hbm.capacity:
        with _files_of(*shm_files):  # its generation table is a segment there
            tiers.append(hbm_tier(t.hbm.capacity, t.hbm.device, t.hbm.page_bytes,
                                  shm_dir=d.shm_dir if d.pool == "shared" else None, group=group))
    if d.pool == "private":  # the shared pool checks its own budget (engram/tiers/shm.py)
        avail = mem_available()
        if d.capacity > avail:
            raise InsufficientResources(f"tiers.dram.capacity needs {d.capacity} bytes of host memory, but "
                                        f"MemAvailable (or the container's memory limit) leaves {avail}; lower "
                                        "tiers.dram.capacity")
    if t.nvme.path:
        _check_nvme_dir(Path(t.nvme.path))
    with _files_of(*shm_files):
        tiers.append(shared_dram_tier(d.capacity, d.shm_dir, d.page_bytes, pin=d.pin, prefault=d.prefault, group=group)
                     if d.pool == "shared" else DramTier(d.capacity))
    backend = default_backend() if config.codec.backend == "auto" else config.codec.backend
    codec, why = resolve_default_codec(config.codec.default, backend)
    registry = ModelRegistry(default_codec=codec, default_reason=why)
    if t.nvme.path:
        root = Path(t.nvme.path)
        # A first start makes models/, blocks/, tmp/ and the lock file; every start reads the model files
        with _files_of("tiers.nvme.path", t.nvme.path, "", _NVME_FIX):
            nvmedir.claim(root, create=True, fsync=t.nvme.fsync)  # marked before models/ is made in it
            registry = ModelRegistry(root / "models", default_codec=codec, default_reason=why)
            tiers.append(NvmeTier(root, t.nvme.capacity, compression=t.nvme.compression,
                                  io_threads=t.nvme.io_threads, fsync=t.nvme.fsync,
                                  verify_on_start=t.nvme.verify_on_start))
    store = BlockStore(tiers, registry, write_policy=WritePolicy(t.write_policy), retry_s=t.retry_s,
                       codec_backend=backend, namespaces=tenancy, on_nvme_failure=t.on_nvme_failure,
                       write_back_window_s=t.write_back_window_s, write_back_window_bytes=t.write_back_window_bytes,
                       quality=QualityWatch(config.codec.quality_sample, config.codec.max_error, backend=backend),
                       eviction=t.eviction)
    if t.nvme.path:
        t0 = time.perf_counter()
        shares = None if tenancy is None else pins.shares_of(  # a tenant's pins come back within its share
            [(p.name, p.namespaces) for p in tenancy.tenants()], config.server.max_pinned_fraction_per_tenant, tiers)
        report = await store.recover(shares)
        log.info("recovered %d blocks from %s in %.2fs (%d problems fixed)", report.recovered_blocks, t.nvme.path,
                 time.perf_counter() - t0, len(report.findings))
        for path, problem, _ in report.findings:
            log.warning("recovery: %s: %s", path, problem)
    return store


def _check_nvme_dir(root: Path) -> None:
    """The NVMe tier's directory, or its parent, must exist: a typo must not create a tree under / (or on the
    root filesystem instead of the drive). And it must be empty or Engram's (engram/tiers/nvmedir.py), refused
    before anything is made (the DRAM segment included)."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"tiers.nvme.path {root} is not a directory; name a directory on the NVMe drive")
    if not root.exists() and not root.parent.is_dir():
        raise ConfigError(f"tiers.nvme.path {root}: neither it nor its parent {root.parent} exists; create the "
                          f"directory on the NVMe drive (mkdir -p {root}) or correct the path")
    with _files_of("tiers.nvme.path", str(root), "", _NVME_FIX):  # one it cannot list: say which setting
        nvmedir.inspect(root)


_NVME_FIX = ("let this daemon read and write it and what it holds (models/, blocks/, tmp/ are directories), or set "
             "another tiers.nvme.path")
_SHM_FIX = "give a tmpfs directory this daemon can write (e.g. /dev/shm), or set tiers.dram.pool = private"


@contextlib.contextmanager
def _files_of(key: str, value: str, what: str, fix: str) -> Iterator[None]:
    """An OSError of a file or directory the setting `key` (= `value`) names, as one line saying the setting, the
    path that could not be created or opened, why, and what to change (`engram serve`: exit 9); a full disk as
    too little disk (exit 7). `[Errno 13] Permission denied: '...'` alone said neither which setting nor what
    the daemon was doing. `what` names the file where the error's own path would not say it."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:  # a message already (the NVMe tier's index journal)
            raise
        path = f"{what} {exc.filename}".strip() if exc.filename else what or value
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientResources(f"{key} {value}: the disk is full, {path} cannot be created "
                                        f"({exc.strerror}); free space on it or set another {key}") from None
        raise OSError(f"{key} {value}: {path} cannot be created or opened ({exc.strerror}); {fix}") from None


def _tls(s: ServerConfig) -> grpc.ServerCredentials:
    key, cert = Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


@dataclass
class RunningServer:
    server: grpc.aio.Server
    address: str  # what a client dials: "127.0.0.1:50051" or "unix:/path/engram.sock"
    store: BlockStore
    sessions: SessionManager
    health: health.aio.HealthServicer
    grace_s: float
    service: EngramService | None = None
    metrics: MetricsEndpoint | None = None  # when server.metrics_port is set; metrics.port is the bound port
    reporter: asyncio.Task[None] | None = None  # engram/logs.py: summary lines of store activity
    socket_lock: DaemonLock | None = None  # held while serving on a unix socket (engram/lockfile.py)
    flush_s: float = 30.0  # tiers.shutdown_flush_s: time to copy blocks held only in DRAM/HBM to NVMe at stop
    prefetcher: asyncio.Task[None] | None = None  # SessionManager.run_prefetch: hinted sessions' blocks copied up
    closer: asyncio.Task[None] | None = None  # SessionManager.run_idle_close: sessions idle past server.session_idle_s

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting RPCs, give in-flight ones `grace_s` to finish, then release the tiers."""
        for task in (self.reporter, self.prefetcher, self.closer):
            if task is not None:
                task.cancel()
        await self.health.enter_graceful_shutdown()
        grace = self.grace_s if grace_s is None else grace_s
        data = self.service.dataport if self.service is not None else None
        # The data channel's requests in flight get the same grace as gRPC's (they were cut at once), side by side
        await asyncio.gather(self.server.stop(grace), *([data.stop(grace)] if data is not None else []))
        if self.service is not None and self.service.cluster is not None:
            try:
                await self.service.cluster.close()
                await self.service.peers.close()  # type: ignore[union-attr]
            except Exception:  # the cluster is a cache of where blocks are: the flush and cleanup below matter more
                log.exception("closing the cluster index failed; stopping the rest")
        if self.metrics is not None:
            self.metrics.stop()
        if self.service is not None and self.service.inplace is not None:
            await self.service.inplace.close()  # uncommitted reservations free their slots
        if self.flush_s > 0:  # the DRAM pool dies with the process: what only it holds goes to NVMe first
            flushed = await self.store.flush(self.flush_s)
            if flushed.flushed or flushed.left:
                log.log(logging.WARNING if flushed.left else logging.INFO,
                        "shutdown: %d blocks (%d bytes) copied to NVMe in %.2fs; %d held only in memory were not "
                        "(tiers.shutdown_flush_s = %g)", flushed.flushed, flushed.flushed_bytes, flushed.seconds,
                        flushed.left, self.flush_s, extra={"fields": {
                            "flushed": flushed.flushed, "left": flushed.left, "seconds": flushed.seconds}})
        self.sessions.shutdown()
        await self.store.close()
        if self.socket_lock is not None:
            self.socket_lock.release()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def build_sessions(config: EngramConfig, store: BlockStore) -> SessionManager:
    rc = config.replay
    paths = [p.strip() for p in rc.models.split(",") if p.strip()]
    try:
        runtime = ReplayRuntime.from_paths(paths, device=rc.device, dtype=rc.dtype)
    except Exception as exc:  # not a checkpoint: safetensors', transformers' and torch's errors, whatever they are
        raise ConfigError(f"replay.models: cannot load {', '.join(paths)}: {exc}") from exc
    return SessionManager(store, runtime, max_hot_windows=rc.max_hot_windows, max_concurrent_replays=rc.max_concurrent,
                          max_queued_replays=rc.max_queued, max_queued_replays_per_tenant=rc.max_queued_per_tenant,
                          max_persisted_window_bytes_per_tenant=rc.max_persisted_window_bytes_per_tenant,
                          max_sessions_per_namespace=config.server.max_sessions_per_namespace,
                          max_session_tokens=config.server.max_tokens_per_request,
                          max_live_session_tokens=config.server.max_live_session_tokens,
                          max_live_session_tokens_per_tenant=config.server.max_live_session_tokens_per_tenant,
                          max_persisted_window_bytes=rc.max_persisted_window_bytes,
                          cost_models=load_cost_models(runtime, rc.calibrations, rc.device),
                          floor=FidelityFloor(min_top1=rc.min_top1, max_kl=rc.max_kl or None),
                          prefetch_lead_ms=config.tiers.prefetch_lead_ms, idle_close_s=config.server.session_idle_s)


def load_cost_models(runtime: ReplayRuntime, directory: str, device: str) -> dict[str, CostModel]:
    """The calibration of each replay model on this machine, where `directory` holds one; a malformed one stops
    the start (ConfigError), as any bad setting does."""
    if not directory:
        return {}
    here = machine_id(device)
    out = {}
    for identity in runtime.identities:
        try:
            cal = Calibration.load(directory, identity.weights_id, here)
        except ValueError as exc:
            raise ConfigError(f"replay.calibrations: {exc}") from exc
        if cal is not None:
            out[identity.weights_id] = CostModel(cal)
    return out


def _check_tls_pair(s: ServerConfig) -> None:
    """Load the certificate and key as gRPC will: its failure to is blamed on the address at bind time."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(s.tls_cert, s.tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"server.tls_cert / server.tls_key: {s.tls_cert} and {s.tls_key} are not a PEM "
                          f"certificate and its private key ({exc})") from None


def _lock_socket(unix_socket: str) -> DaemonLock:
    """Only the lock's holder may replace the socket: a second daemon is refused before it can unlink a
    live daemon's socket (or build a store on its NVMe directory)."""
    path = os.path.abspath(unix_socket)
    if not os.path.isdir(os.path.dirname(path)):  # checked here: the lock would create the directory
        raise ConfigError(f"server.unix_socket {path}: the directory {os.path.dirname(path)} does not exist; "
                          "create it or choose another path")
    if len(os.fsencode(path + ".data")) > MAX_SOCKET_PATH:  # the data channel's socket beside it, the longer
        raise ConfigError(f"server.unix_socket {path}: {len(os.fsencode(path))} bytes, and {path}.data must fit a "
                          f"unix socket's {MAX_SOCKET_PATH} bytes; choose a shorter path")
    with _files_of("server.unix_socket", path, "its lock file", "remove what is in its place or let this daemon "
                   "write the directory, or set another server.unix_socket"):
        return DaemonLock(f"{path}.lock", f"the unix socket {path}", "set another server.unix_socket").acquire()


async def start_server(config: EngramConfig, store: BlockStore | None = None,
                       sessions: SessionManager | None = None) -> RunningServer:
    s = config.server
    if not s.unix_socket:  # before the tiers are built: a taken port fails fast, with nothing to undo
        _check_free(s.host, s.port, f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}")
    socket_lock = _lock_socket(s.unix_socket) if s.unix_socket else None
    built = None
    try:
        trust = ClusterTrust.from_config(config.cluster) if config.cluster.redis_url else None
        tenancy = Tenancy.from_config(config.auth, trust.peer_token if trust else config.cluster.peer_token)
        if tenancy is not None:
            tenancy.max_calls = config.server.max_concurrent_rpcs_per_tenant
            tenancy.peer_node = trust.peer_node if trust else None
            if s.metrics_port and s.metrics_token:
                tenancy.check_apart(resolve_secret(s.metrics_token, "server.metrics_token"), "server.metrics_token")
        if store is None:
            store = built = await build_store(config, tenancy)
        return await _start(config, store, sessions, tenancy, trust, socket_lock)
    except BaseException:
        if built is not None:
            await built.close()  # its NVMe directory lock too
        if socket_lock is not None:
            socket_lock.abandon()  # a start that never served leaves no <socket>.lock it made
        raise


async def _start(config: EngramConfig, store: BlockStore, sessions: SessionManager | None, tenancy: Tenancy | None,
                 trust: ClusterTrust | None, socket_lock: DaemonLock | None) -> RunningServer:
    s = config.server
    sessions = sessions or build_sessions(config, store)
    options = [*message_options(int(s.max_message_bytes)), *server_keepalive_options(),
               *server_receive_window_options(s.grpc_stream_window_bytes), ("grpc.so_reuseport", 0)]
    metrics = MetricsEndpoint() if s.metrics_port else None
    metrics_token = resolve_secret(s.metrics_token, "server.metrics_token") if metrics and s.metrics_token else ""
    open_rpcs = OpenServiceGuard(s.max_concurrent_open_rpcs, s.stream_stall_s)  # health and reflection: no token, a share of their own
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=s.max_concurrent_rpcs,
                             interceptors=[metrics.interceptor, open_rpcs] if metrics else [open_rpcs])
    service = EngramService(store, s, sessions, tenancy, same_host=config.auth.same_host_allowed)
    if metrics is not None:
        metrics.watch_receive_budget(lambda: service.receive_budget.used)
    if not config.auth.same_host_allowed and service.pool is not None:
        log.warning("same-host zero-copy hits and in-place puts are off (%s): the shared DRAM pool holds every "
                    "tenant's blocks; hits and puts travel as bytes. Set auth.same_host_paths = on to trust this "
                    "host's workers with all of them", "tenancy is on" if config.auth.enabled else
                    "auth.same_host_paths = off")
    inspection = InspectionService(Inspector(store, sessions), s.max_blocks_per_request, tenancy, s.stream_stall_s)
    server.add_generic_rpc_handlers((service.generic_handler(), inspection.generic_handler()))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        engram_pb2.DESCRIPTOR.services_by_name["Engram"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if s.unix_socket:
        path = os.path.abspath(s.unix_socket)
        remove_stale_socket(path, "server.unix_socket")
        with socket_umask(s.unix_socket_group):
            _bind(lambda: server.add_insecure_port(f"unix:{path}"), f"unix:{path}",  # under the narrow umask
                  "check that its directory is writable, or set server.unix_socket")
        secure_socket(path, s.unix_socket_group)
        address = f"unix:{path}"
    else:
        host = f"[{s.host}]" if ":" in s.host else s.host
        if s.tls_cert:
            _check_tls_pair(s)
        port = _bind(lambda: server.add_secure_port(f"{host}:{s.port}", _tls(s)) if s.tls_cert else
                     server.add_insecure_port(f"{host}:{s.port}"), f"{host}:{s.port}",  # [::1]: gRPC wants brackets
                     _BIND_HINT)
        address = f"{host}:{port}"
    if s.data_channel:  # before gRPC starts: a taken data port fails the start with nothing to stop
        service.dataport = await _start_dataport(service, s, tenancy, metrics)
    service.joins_cluster = trust is not None
    try:
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if metrics is not None:
            metrics.watch(store, sessions)
            try:
                metrics.start(s.metrics_host, s.metrics_port, metrics_token)
            except OSError as exc:
                raise AddressInUse(f"cannot serve /metrics on {s.metrics_host}:{s.metrics_port}: "
                                   f"{exc.strerror or exc}; set server.metrics_port (0: off)") from None
            log.info("engram metrics on http://%s:%d/metrics", s.metrics_host, metrics.port)
        states = compiled.status()
        # The tiers in the line itself, as stdout's banner has them: the log alone said what ran (an audit, session 48)
        capacities = {t.name: t.usage().capacity_bytes for t in store.tiers}
        log.info("engram serving on %s (tiers: %s)", address,
                 ", ".join(f"{name} {_size(n)}" for name, n in capacities.items()), extra={"fields": {
            "address": address, "tiers": list(capacities), "tier_capacity_bytes": capacities, "blocks": len(store),
            "metrics_port": metrics.port if metrics else 0, "compiled": sorted(set(states.values()))}})
        if compiled.STALE in states.values():
            log.warning("the store's modules: %s", compiled.summary(states))
        if trust is not None:
            await _join_cluster(config, service, address, trust)
            if metrics is not None and service.cluster is not None:
                metrics.watch_cluster(service.cluster)
    except BaseException:  # a taken metrics port, an unreachable cluster: nothing is left listening
        if service.dataport is not None:
            await service.dataport.stop()
        await server.stop(0)
        if metrics is not None:
            metrics.stop()
        raise
    loop = asyncio.get_running_loop()
    reporter = loop.create_task(report_activity(store, config.logging.summary_s))
    prefetcher = loop.create_task(sessions.run_prefetch()) if len(store.tiers) > 1 and sessions.prefetch_lead_ms \
        else None  # with one tier every block is in the top one already
    closer = loop.create_task(sessions.run_idle_close()) if sessions.idle_close_s else None
    return RunningServer(server, address, store, sessions, health_servicer, s.shutdown_grace_s, service, metrics,
                         reporter, socket_lock, config.tiers.shutdown_flush_s, prefetcher, closer)


async def _start_dataport(service: EngramService, s: ServerConfig, tenancy: Tenancy | None,
                          metrics: MetricsEndpoint | None) -> DataPort:
    """The data channel beside the gRPC port: <unix_socket>.data (as private as the gRPC socket), or data_port on
    the same host, under TLS when the gRPC port is."""
    port = DataPort(service, s, tenancy, metrics.interceptor.data_done if metrics else None)
    if metrics is not None:
        metrics.watch_data(port.buffered_bytes)
    if s.unix_socket:
        path = os.path.abspath(s.unix_socket) + ".data"
        with socket_umask(s.unix_socket_group):
            await port.start_unix(path)
        secure_socket(path, s.unix_socket_group)
    else:
        tls = None
        if s.tls_cert:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(s.tls_cert, s.tls_key)
        await port.start_tcp(s.host, s.data_port, tls)
    log.info("engram data channel on %s", port.unix_path or f"port {port.tcp_port}" + (" (TLS)" if port.tls else ""))
    return port


_BIND_HINT = ("stop what holds the port or set another (--port, server.port; 0 picks a free one), and check that "
              "the host is an address of this machine (--host, server.host)")


def _check_free(host: str, port: int, where: str) -> None:
    """Bind the address once here first: gRPC's own failure says neither why nor which address. Racy (another
    process may take it in between), so _bind still maps gRPC's failure."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"server.host {host!r} does not resolve ({exc.strerror}); give an address of this "
                          "machine (127.0.0.1, 0.0.0.0, ::)") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            probe.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"server.host {host!r} is not an address of this machine; give one of its "
                                  "addresses (127.0.0.1, 0.0.0.0 for every interface)") from None
            raise AddressInUse(f"cannot listen on {where}: {exc.strerror}; {_BIND_HINT}") from None


def _bind(add_port: Callable[[], int], where: str, what_to_change: str) -> int:
    """gRPC's add_*_port, its failures (a RuntimeError, or port 0) as AddressInUse saying what to change."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise AddressInUse(f"cannot listen on {where}: the address is in use or not this host's; {what_to_change}")
    return port


async def _join_cluster(config: EngramConfig, service: EngramService, address: str, trust: ClusterTrust) -> None:
    c = config.cluster
    advertised = c.advertise or address
    service.trust = trust
    grants = trust.grants_digest(None if service.tenancy is None else service.tenancy.grants())
    service.cluster = ClusterIndex(c, service.store.index, c.node_id or advertised, advertised, trust, grants)
    root = Path(c.peer_root_cert).read_bytes() if c.peer_root_cert else None
    service.peers = PeerFetcher(service.cluster, service.store, token=trust.peer_token, root_cert=root,
                                timeout_s=c.fetch_timeout_s, fill_timeout_s=c.fill_timeout_s,
                                max_blocks=c.max_fetch_blocks,
                                metadata=trust.peer_metadata(service.cluster.node_id, grants),
                                untagged_gets=service.tenancy is None)
    await service.cluster.start()


def _size(n: int) -> str:
    """Bytes in the largest unit they fill one of: a 64 KiB tier read "dram 0 MiB" (an audit, session 48)."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 2**shift:
            return f"{n / 2**shift:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"


def banner(config: EngramConfig, running: RunningServer) -> list[str]:
    """What `engram serve` says it is running, after the address: tiers, codec, tenancy, TLS, replay, metrics."""
    t, a = config.tiers, config.auth
    where = {"hbm": f" on {t.hbm.device}", "dram": f" ({t.dram.pool} pool" +
             (f" in {t.dram.shm_dir})" if t.dram.pool == "shared" else ")"), "nvme": f" at {t.nvme.path}"}
    tiers = ", ".join(f"{tier.name} {_size(tier.usage().capacity_bytes)}{where.get(tier.name, '')}"
                      for tier in running.store.tiers)
    policy = t.write_policy + (f", loss window {t.write_back_window_s:g} s" if t.write_policy == "write-back"
                               and t.nvme.path else "")
    tenants = len(a.tenants)
    models = [p.strip() for p in config.replay.models.split(",") if p.strip()]
    reg, backend = running.store.registry, running.store.codec_backend
    codec = (f"codec: {reg.default_codec} ({reg.default_reason}; lossy: codec.default = raw stores KV exactly)"
             if reg.default_codec != "raw" else f"codec: raw (lossless; {reg.default_reason})")
    lines = [f"tiers: {tiers}; {policy}",
             f"{codec}; the daemon encodes with {backend}",
             (f"tenancy: on ({tenants} tenants" + (", a tenants file" if a.tenants_file else "") + ")") if a.enabled
             else "tenancy: off (every caller may act in every namespace)",
             "TLS: on" if config.server.tls_cert else "TLS: off",
             f"replay models: {', '.join(models)}" if models else "replay models: none"]
    if models and config.replay.calibrations:
        sm = running.sessions
        lines.append(f"replay cost models: {len(sm.cost_models)} of {len(models)} calibrated for this machine in "
                     f"{config.replay.calibrations} (auto sessions of the others replay exact); fidelity floor "
                     f"top-1 >= {sm.floor.min_top1}, KL <= {sm.floor.max_kl}")
    if running.metrics is not None:
        lines.append(f"metrics on http://{config.server.metrics_host}:{running.metrics.port}/metrics")
    if config.cluster.redis_url:
        lines.append(f"cluster: node {config.cluster.node_id or config.cluster.advertise or running.address}")
    return lines


def startup_warnings(config: EngramConfig, running: RunningServer) -> list[str]:
    """What is allowed but probably not meant: an open address without tenants, tokens in clear, a disk that
    cannot hold the NVMe tier's capacity."""
    out = []
    s = config.server
    exposed = not s.unix_socket and s.host not in ("127.0.0.1", "::1", "localhost")
    if exposed and not config.auth.enabled:
        out.append(f"listening on {s.host} with tenancy off: any host that reaches it may read, write and evict "
                   "every namespace; configure [auth] tenants or listen on 127.0.0.1")
    if exposed and config.auth.enabled and not s.tls_cert:
        out.append(f"tokens travel in clear text to {s.host}: set server.tls_cert and server.tls_key")
    for setting, path in secret_files(config):
        # Under the usual umask 022 a file is made 0644: every user of the host read each tenant's token in it, so
        # a tenant whose workers run here could act as any other
        with contextlib.suppress(OSError):  # read at start; gone since, there is nothing left to read
            mode = os.stat(path).st_mode & 0o777
            if mode & 0o044:
                what = "each tenant's token" if setting == "auth.tenants_file" else setting
                out.append(f"{setting}: {path} is readable by other users of this host (mode {mode:04o}): any of "
                           f"them reads the secrets in it ({what}); chmod 600 it")
    if config.tiers.nvme.path:
        st = os.statvfs(config.tiers.nvme.path)
        free = st.f_bavail * st.f_frsize + running.store.tiers[-1].usage().used_bytes
        if config.tiers.nvme.capacity > free:
            out.append(f"tiers.nvme.capacity is {_size(config.tiers.nvme.capacity)} but {config.tiers.nvme.path} "
                       f"has {_size(free)} free: the tier degrades (ENOSPC) before it is full; lower the capacity")
    return out


async def serve(config: EngramConfig, ready: asyncio.Event | None = None) -> None:
    """Run a daemon until SIGTERM or SIGINT, then shut down gracefully."""
    running = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: the shutdown is under way, say so (it was silently ignored)
            print(f"engram: already stopping: in-flight calls get up to {config.server.shutdown_grace_s:g} s, then "
                  f"blocks held only in memory are copied to NVMe (up to {config.tiers.shutdown_flush_s:g} s); "
                  "SIGKILL now loses those", flush=True)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    print(f"engram: serving on {running.address}", flush=True)
    for line in banner(config, running):
        print(f"engram: {line}", flush=True)
    for warning in startup_warnings(config, running):
        log.warning(warning)
        print(f"engram: warning: {warning}", flush=True)
    # What start-up built (torch, the protobuf modules, the index of blocks recovered from NVMe) lives as long as
    # the daemon: out of the collector's sight, a full collection no longer walks it, which stalled every
    # request for tens of milliseconds under load (benchmarks/RESULTS.md, put_get).
    gc.freeze()
    schedule = CollectorSchedule(config.server.gc_freeze_s, config.server.gc_full_s)
    collector = loop.create_task(schedule.run()) if schedule.freeze_s else None
    if ready is not None:
        ready.set()
    await stop.wait()
    if collector is not None:
        collector.cancel()
    log.info("engram: shutting down (grace %.1fs)", running.grace_s, extra={"fields": {"grace_s": running.grace_s}})
    await running.stop()
    log.info("engram stopped", extra={"fields": {"address": running.address}})
    print("engram: stopped", flush=True)
