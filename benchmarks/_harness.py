"""Shared pieces of the benchmarks: start a real daemon or redis-server as a subprocess on this machine,
time operations, and summarise latencies. Nothing here talks to anything but loopback and unix sockets."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def cells(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A Rich progress bar on stderr over a benchmark's cells (the Markdown table stays alone on stdout);
    yields `done(label)`, called once per finished cell."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)

        def done(label: str) -> None:
            bar.update(task, advance=1, description=f"{what}: {label}")

        yield done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def give_back_freed_memory() -> None:
    """Return the memory this process freed to the kernel now (glibc's malloc_trim; a no-op elsewhere), at the start
    of a cell, before it makes its payloads. Otherwise what earlier cells freed (gigabytes, after the 16 MiB cells)
    went back lazily inside a later free(): in put_get one 1 MiB put held the GIL 200-700 ms, 241-245 puts into
    the first cell after Redis's 16 MiB cells, while 2 GiB left the process's RSS (benchmarks/RESULTS.md put_get,
    session 50). Not just before a clock: the cell's own allocations would then fault in fresh pages on it
    (Redis's gets ran at 0.65x)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    arr = np.asarray(samples_s) * 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def _wait_health(address: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from engram.wire.channel import RECONNECT_OPTIONS

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("engram serve exited during start-up")
        try:
            with grpc.insecure_channel(address, options=RECONNECT_OPTIONS) as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return
        except grpc.RpcError:
            time.sleep(0.1)
    raise RuntimeError("engram serve did not become healthy")


def _rss_shmem(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_prefault(proc: subprocess.Popen[bytes], nbytes: int, timeout: float = 300.0) -> None:
    """Until the daemon's DRAM pool is resident (tiers.dram.prefault populates it in the background after
    start): figures are of a warm daemon, as on a GPU host, where pinning populates it at start."""
    deadline = time.monotonic() + timeout
    while _rss_shmem(proc.pid) < 0.99 * nbytes:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon's DRAM pool was not prefaulted")
        time.sleep(0.2)


@contextlib.contextmanager
def engram_daemon(transport: str, dram: str = "8GiB", extra: tuple[str, ...] = (), *, warm: bool = True
                  ) -> Iterator[str]:
    """A real `engram serve` subprocess; yields the address to dial (with warm, once its pool is resident)."""
    with tempfile.TemporaryDirectory(prefix="engram-bench-") as tmp:
        if transport == "unix":
            sock = Path(tmp) / "engram.sock"
            args = ["--unix-socket", str(sock)]
            address = f"unix:{sock}"
        else:
            port = free_port()
            args = ["--port", str(port)]
            address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "engram", "serve", "--dram-capacity", dram, "--log-level", "warning",
               "--set", "server.max_message_bytes=64MiB", "--set", "server.chunk_bytes=32MiB", *args, *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        try:
            _wait_health(address, proc)
            if warm and Path("/proc").is_dir():
                from engram.config import parse_bytes

                _wait_prefault(proc, parse_bytes(dram))
            yield address
        finally:
            proc.terminate()
            proc.wait(15)


@contextlib.contextmanager
def redis_server(transport: str) -> Iterator[dict[str, object]]:
    """A real redis-server subprocess without persistence; yields redis-py connection kwargs."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="engram-bench-redis-") as tmp:
        port = free_port()
        sock = Path(tmp) / "redis.sock"
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", str(sock), "--save", "",
             "--appendonly", "no", "--dir", tmp, "--proto-max-bulk-len", "512mb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            yield {"unix_socket_path": str(sock)} if transport == "unix" else {"host": "127.0.0.1", "port": port}
        finally:
            proc.terminate()
            proc.wait(10)


def write_rows(path: str, rows: list[dict[str, object]]) -> None:
    """One JSON object per row (the --json files the GPU session brings back)."""
    import json

    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
