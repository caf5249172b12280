"""One daemon per unix socket path and per NVMe directory: a second `engram serve` is refused, says which
process holds what it wanted, and leaves the first daemon (and its socket) alone; a lock left by a daemon
killed with SIGKILL does not block the next start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from engram.config import load_config
from engram.errors import AddressInUse, AlreadyRunning, ConfigError
from engram.lockfile import DaemonLock, holder_pid
from engram.server import start_server
from engram.tiers.nvme import NvmeTier
from engram.tiers.nvmedir import write_marker

from helpers import ENGRAM, NEUTRAL_CWD, small_tmpfs, wait_for


def serve(sock: Path, nvme: Path | None = None) -> subprocess.Popen[str]:
    args = [*ENGRAM, "serve", "--unix-socket", str(sock), "--log-level", "warning", "--dram-capacity", "8MiB"]
    if nvme is not None:
        args += ["--set", f"tiers.nvme.path={nvme}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=NEUTRAL_CWD)


def refused(proc: subprocess.Popen[str]) -> str:
    """Wait for a daemon that must refuse to start to exit on its own; its output."""
    proc.wait(60)
    return stop(proc)


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.stdout:
        proc.stdout.close()
    return out


def test_a_second_daemon_on_the_same_socket_is_refused_and_the_first_keeps_serving(tmp_path: Path) -> None:
    sock = tmp_path / "engram.sock"
    first = serve(sock)
    try:
        wait_for(f"unix:{sock}", first)
        second = serve(sock)
        out = refused(second)
        assert second.returncode != 0
        assert f"process {first.pid}" in out and str(sock) in out and "server.unix_socket" in out, out
        assert sock.exists()  # the second never unlinked the first's socket
        wait_for(f"unix:{sock}", first)  # and the first still answers on it
    finally:
        stop(first)


def test_a_second_daemon_on_the_same_nvme_directory_is_refused(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    first = serve(tmp_path / "a.sock", nvme)
    try:
        wait_for(f"unix:{tmp_path / 'a.sock'}", first)
        second = serve(tmp_path / "b.sock", nvme)
        out = refused(second)
        assert second.returncode != 0
        assert f"process {first.pid}" in out and str(nvme) in out and "tiers.nvme.path" in out, out
        wait_for(f"unix:{tmp_path / 'a.sock'}", first)
        # An offline check of the directory is refused too while the daemon owns it.
        check = subprocess.run([*ENGRAM, "check", "--dir", str(nvme), "--fix"], capture_output=True, text=True,
                               cwd=NEUTRAL_CWD, timeout=60)
        assert check.returncode == 4 and f"process {first.pid}" in check.stderr, check.stderr
    finally:
        stop(first)


def test_locks_of_a_daemon_killed_with_sigkill_do_not_block_a_restart(tmp_path: Path) -> None:
    sock, nvme = tmp_path / "engram.sock", tmp_path / "nvme"
    first = serve(sock, nvme)
    wait_for(f"unix:{sock}", first)
    first.kill()
    stop(first)
    assert holder_pid(f"{sock}.lock") == first.pid  # the dead daemon's pid is still written there
    again = serve(sock, nvme)
    try:
        wait_for(f"unix:{sock}", again)
        assert holder_pid(f"{sock}.lock") == again.pid and holder_pid(nvme / "engram.lock") == again.pid
    finally:
        out = stop(again)
    assert again.returncode == 0, out


def test_a_start_that_fails_after_taking_the_socket_lock_removes_the_lock_file_it_made(tmp_path: Path) -> None:
    """An NVMe directory whose index/ is a file fails the start (exit 9) after the socket's lock was taken: the
    lock file it had made was left beside the socket (harmless to the next start, a flock, but litter that looks
    like a daemon's). It goes now; one a daemon that served left stays, it is not the failed start's."""
    sock, lock = tmp_path / "engram.sock", tmp_path / "engram.sock.lock"
    bad = tmp_path / "nvme"
    bad.mkdir()
    write_marker(bad)  # Engram's directory (another program's is refused before the socket lock is taken)
    (bad / "index").write_text("not a directory")
    failed = serve(sock, bad)
    out = refused(failed)
    assert failed.returncode == 9, out
    assert not lock.exists() and not sock.exists(), sorted(p.name for p in tmp_path.iterdir())
    served = serve(sock)  # the next start on the socket works
    try:
        wait_for(f"unix:{sock}", served)
    finally:
        stop(served)
    assert served.returncode == 0 and lock.exists()
    again = serve(sock, bad)
    assert "index" in refused(again) and again.returncode == 9
    assert lock.exists()  # it was there before this start


async def test_in_process_the_second_start_fails_before_touching_the_socket(tmp_path: Path) -> None:
    sock = tmp_path / "engram.sock"
    cfg = load_config(env={}, overrides={"server.unix_socket": str(sock), "tiers.nvme.path": str(tmp_path / "n"),
                                         "tiers.dram.capacity": "4MiB", "tiers.dram.pool": "private"})
    first = await start_server(cfg)
    try:
        inode = sock.stat().st_ino
        with pytest.raises(AlreadyRunning, match=f"process {os.getpid()} holds the unix socket"):
            await start_server(cfg)
        assert sock.stat().st_ino == inode
        # The same NVMe directory under another socket: refused by the directory's lock, which names it.
        other = load_config(env={}, overrides={"server.unix_socket": str(tmp_path / "other.sock"),
                                               "tiers.nvme.path": str(tmp_path / "n"), "tiers.dram.capacity": "4MiB",
                                               "tiers.dram.pool": "private"})
        with pytest.raises(AlreadyRunning, match="holds the NVMe directory"):
            await start_server(other)
        # The refused start released what it had taken: the other socket's lock is free again.
        with DaemonLock(tmp_path / "other.sock.lock", "x", "y"):
            pass
    finally:
        await first.stop(0)
    tier = NvmeTier(tmp_path / "n", 1 << 20)  # the stopped daemon released the directory
    await tier.close()


async def test_a_file_at_the_socket_path_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    """A stale socket is replaced at start; a regular file there (a config file named by mistake) is not ours
    to delete: the start is refused naming the setting, and the file is intact."""
    for target in ("engram.toml", "engram.toml.data"):
        sock = tmp_path / "engram.toml"
        victim = tmp_path / target
        victim.write_text("[server]\n")
        cfg = load_config(env={}, overrides={"server.unix_socket": str(sock), "tiers.dram.capacity": "4MiB",
                                             "tiers.dram.pool": "private"})
        with pytest.raises(ConfigError, match="exists and is not a socket"):
            await start_server(cfg)
        assert victim.read_text() == "[server]\n"
        victim.unlink()


async def test_start_errors_name_the_setting_to_change(tmp_path: Path) -> None:
    """A socket path whose data channel socket would not fit sun_path, a metrics port already taken, a TLS pair
    that is not PEM, and a replay.models file that is not a checkpoint: each a ConfigError or AddressInUse saying
    what to set."""
    long_dir = tmp_path / ("d" * (110 - len(str(tmp_path))))
    long_dir.mkdir()
    cfg = load_config(env={}, overrides={"server.unix_socket": str(long_dir / "s"), "tiers.dram.capacity": "4MiB"})
    with pytest.raises(ConfigError, match="must fit a unix socket"):
        await start_server(cfg)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cfg = load_config(env={}, overrides={"server.unix_socket": str(tmp_path / "m.sock"), "tiers.dram.capacity": "4MiB",
                                             "tiers.dram.pool": "private", "server.metrics_port": taken.getsockname()[1]})
        with pytest.raises(AddressInUse, match=r"set server\.metrics_port"):
            await start_server(cfg)
    finally:
        taken.close()
    (tmp_path / "not.pem").write_text("not a certificate")
    cfg = load_config(env={}, overrides={"server.port": 0, "tiers.dram.capacity": "4MiB", "tiers.dram.pool": "private",
                                         "server.tls_cert": str(tmp_path / "not.pem"),
                                         "server.tls_key": str(tmp_path / "not.pem")})
    with pytest.raises(ConfigError, match="not a PEM certificate"):  # not blamed on the address any more
        await start_server(cfg)
    (tmp_path / "model.safetensors").write_text("not a checkpoint")
    cfg = load_config(env={}, overrides={"server.unix_socket": str(tmp_path / "r.sock"), "tiers.dram.capacity": "4MiB",
                                         "tiers.dram.pool": "private", "replay.models": str(tmp_path / "model.safetensors")})
    with pytest.raises(ConfigError, match=r"replay\.models: cannot load"):
        await start_server(cfg)


async def test_an_ipv6_host_is_served(tmp_path: Path) -> None:
    """server.host = ::1 binds as [::1] (gRPC takes IPv6 addresses in brackets; it refused the bare form)."""
    probe = socket.socket(socket.AF_INET6)
    try:
        probe.bind(("::1", 0))
    except OSError as exc:  # this host has no IPv6 loopback: nothing to serve on
        pytest.skip(f"no IPv6 loopback here: {exc}")
    finally:
        probe.close()
    from engram.client import EngramClient

    cfg = load_config(env={}, overrides={"server.host": "::1", "server.port": 0, "tiers.dram.capacity": "4MiB",
                                         "tiers.dram.pool": "private"})
    srv = await start_server(cfg)
    try:
        assert srv.address.startswith("[::1]:")
        async with EngramClient(srv.address) as c:
            assert (await c.stats()).tiers
    finally:
        await srv.stop(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_lock_is_taken_on_a_full_filesystem(tmp_path: Path) -> None:
    # A clean stop empties the lock file; writing the pid again needs space a full disk has not (the daemon
    # could not start: ENOSPC). The pid only names the holder: the lock is taken without it.
    with small_tmpfs(tmp_path / "small", "64k") as mnt:
        DaemonLock(mnt / "engram.lock", "the directory", "stop it").acquire().release()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        lock = DaemonLock(mnt / "engram.lock", "the directory", "stop it").acquire()
        with pytest.raises(AlreadyRunning):
            DaemonLock(mnt / "engram.lock", "the directory", "stop it").acquire()
        lock.release()


async def test_a_tier_whose_construction_fails_after_taking_its_lock_releases_it(tmp_path: Path) -> None:
    """NvmeTier failing once it held the directory's lock (here its I/O pool: io_threads=0) kept the lock's
    descriptor open: a second tier on the directory in the same process was refused as locked, by a tier that
    never came to be."""
    with pytest.raises(ValueError, match="max_workers"):
        NvmeTier(tmp_path / "n", 1 << 20, io_threads=0)
    tier = NvmeTier(tmp_path / "n", 1 << 20)
    with pytest.raises(AlreadyRunning):  # the lock is still one holder's
        NvmeTier(tmp_path / "n", 1 << 20)
    await tier.close()
