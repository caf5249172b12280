"""`engram serve` start-up, as a real subprocess: each class of failure is one line on stderr (what is wrong,
what to change) with its own exit code, and leaves nothing behind (no DRAM segment, no directories); a start
that succeeds prints a banner naming what runs, and warns about an open address without tenants."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engram.tiers.nvmedir import write_marker
from engram.tiers.shm import mem_available

from helpers import ENGRAM, NEUTRAL_CWD, small_tmpfs


def serve(tmp_path: Path, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], Path]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    out = subprocess.run([*ENGRAM, "serve", "--set", f"tiers.dram.shm_dir={shm}", *args], capture_output=True,
                         text=True, timeout=timeout, cwd=NEUTRAL_CWD)
    return out, shm


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out, shm = serve(tmp_path, "--port", str(port), "--dram-capacity", "64MiB")
    assert out.returncode == 8
    line = one_line(out)
    assert f"127.0.0.1:{port}" in line and "Address already in use" in line and "--port" in line
    assert list(shm.iterdir()) == []


def test_host_not_of_this_machine(tmp_path: Path) -> None:
    out, shm = serve(tmp_path, "--host", "192.0.2.1", "--port", "0", "--dram-capacity", "64MiB")  # TEST-NET-1
    assert out.returncode == 4 and "not an address of this machine" in one_line(out)


def test_dram_larger_than_the_host_can_give(tmp_path: Path) -> None:
    out, shm = serve(tmp_path, "--port", "0", "--dram-capacity", "100TiB")
    assert out.returncode == 7 and "lower tiers.dram.capacity" in one_line(out)
    assert list(shm.iterdir()) == []
    private, _ = serve(tmp_path, "--port", "0", "--dram-capacity", "100TiB", "--set", "tiers.dram.pool=private")
    assert private.returncode == 7 and "MemAvailable" in one_line(private)


def test_missing_nvme_directory_is_not_created_anywhere(tmp_path: Path) -> None:
    out, shm = serve(tmp_path, "--port", "0", "--dram-capacity", "64MiB",
                     "--set", f"tiers.nvme.path={tmp_path / 'typo' / 'engram'}")
    assert out.returncode == 4 and "mkdir -p" in one_line(out)
    assert not (tmp_path / "typo").exists() and list(shm.iterdir()) == []


def test_missing_socket_directory_is_not_created(tmp_path: Path) -> None:
    out, _ = serve(tmp_path, "--unix-socket", str(tmp_path / "nodir" / "e.sock"), "--dram-capacity", "64MiB")
    assert out.returncode == 4 and "does not exist" in one_line(out)
    assert not (tmp_path / "nodir").exists()


def test_failure_after_the_segment_exists_removes_it(tmp_path: Path) -> None:
    """The socket path is a directory: found only at bind time, once the DRAM segment was made (and left
    alone: only a socket there is an earlier run's to replace)."""
    (tmp_path / "sock").mkdir()
    out, shm = serve(tmp_path, "--unix-socket", str(tmp_path / "sock"), "--dram-capacity", "64MiB")
    assert out.returncode == 4 and "exists and is not a socket" in one_line(out)
    assert list(shm.iterdir()) == [] and (tmp_path / "sock").is_dir()


def banner(shm: Path, *args: str) -> list[str]:
    """The first seven lines `engram serve` prints (address, tiers, codec, tenancy, TLS, replay, a warning)."""
    shm.mkdir()
    proc = subprocess.Popen([*ENGRAM, "serve", "--dram-capacity", "64MiB", "--set", f"tiers.dram.shm_dir={shm}",
                             "--log-level", "error", *args], stdout=subprocess.PIPE, text=True, cwd=NEUTRAL_CWD)
    try:
        assert proc.stdout is not None
        return [proc.stdout.readline().strip() for _ in range(7)]
    finally:
        proc.terminate()
        proc.wait(20)
        if proc.stdout is not None:
            proc.stdout.close()


def banner_and_warnings(shm: Path, *args: str, settle_s: float = 3.0) -> list[str]:
    """What `engram serve` prints at start, however many warnings follow its banner: the lines up to the banner's
    last ("replay models: ..."), then those that come within settle_s (the warnings are printed right after it)."""
    import selectors

    shm.mkdir()
    proc = subprocess.Popen([*ENGRAM, "serve", "--dram-capacity", "64MiB", "--set", f"tiers.dram.shm_dir={shm}",
                             "--log-level", "error", *args], stdout=subprocess.PIPE, cwd=NEUTRAL_CWD)
    assert proc.stdout is not None
    out, deadline, banner_done = b"", time.monotonic() + 60, 0.0
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < (banner_done + settle_s if banner_done else deadline):
                if not sel.select(0.2):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break  # the daemon exited
                out += chunk
                if not banner_done and b"engram: replay models" in out:
                    banner_done = time.monotonic()
        return out.decode().splitlines()
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


def test_banner_names_what_runs_and_warns_about_an_open_address(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    lines = banner(shm, "--host", "0.0.0.0", "--port", "0", "--set", "codec.default=raw")
    assert lines[0].startswith("engram: serving on 0.0.0.0:")
    assert f"engram: tiers: dram 64 MiB (shared pool in {shm}); write-back" in lines
    assert any(line.startswith("engram: codec: raw (lossless; codec.default)") for line in lines), lines
    assert "engram: TLS: off" in lines
    assert "engram: replay models: none" in lines
    assert any(line.startswith("engram: tenancy: off") for line in lines)
    assert any(line.startswith("engram: warning: listening on 0.0.0.0 with tenancy off") for line in lines), lines


def test_banner_warns_when_other_users_of_the_host_may_read_the_tenants_tokens(tmp_path: Path) -> None:
    """A tenants file (or a file:PATH secret) made under the usual umask 022 is 0644: every user of the host read
    every tenant's token there, so one tenant whose workers run on the daemon's host acted as any other (read its
    KV, pinned and evicted its blocks), and the daemon said nothing. It warns at start, naming the setting, the
    file and its mode; a file of the daemon's user alone (0600) is not named."""
    tenants, salt = tmp_path / "tenants.toml", tmp_path / "salt"
    tenants.write_text('[tenants.alice]\ntoken = "alice-token"\n[tenants.bob]\ntoken = "bob-token"\n')
    salt.write_text("a-salt-secret\n")
    tenants.chmod(0o644)
    salt.chmod(0o600)
    lines = banner_and_warnings(tmp_path / "shm", "--port", "0", "--set", f"auth.tenants_file={tenants}",
                                "--set", f"auth.salt_secret=file:{salt}")
    warned = [line for line in lines if line.startswith("engram: warning: ")]
    assert warned == [f"engram: warning: auth.tenants_file: {tenants} is readable by other users of this host (mode "
                      "0644): any of them reads the secrets in it (each tenant's token); chmod 600 it"], lines
    tenants.chmod(0o600)
    salt.chmod(0o640)
    lines = banner_and_warnings(tmp_path / "shm2", "--port", "0", "--set", f"auth.tenants_file={tenants}",
                                "--set", f"auth.salt_secret=file:{salt}")
    assert any(line.startswith(f"engram: warning: auth.salt_secret: {salt} is readable by other users of this host "
                               "(mode 0640)") for line in lines), lines
    assert not any(str(tenants) in line for line in lines if "warning" in line), lines


def test_memory_budget_counts_a_containers_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")  # 16 GiB free on the host
    v2, v1, unlimited = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{2**30}\n")  # docker --memory 1g
    (v2 / "memory.current").write_text(f"{256 * 2**20}\n")
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * 2**30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    unlimited.mkdir()
    (unlimited / "memory.max").write_text("max\n")
    (unlimited / "memory.current").write_text("123\n")
    assert mem_available(meminfo, v2) == 768 * 2**20
    assert mem_available(meminfo, v1) == 3 * 2**30
    assert mem_available(meminfo, unlimited) == mem_available(meminfo, tmp_path / "absent") == 16 * 2**30


def test_banner_warns_when_the_disk_cannot_hold_the_nvme_capacity(tmp_path: Path) -> None:
    shm, nvme = tmp_path / "shm", tmp_path / "nvme"
    lines = banner(shm, "--unix-socket", str(tmp_path / "e.sock"), "--set", f"tiers.nvme.path={nvme}",
                   "--set", "tiers.nvme.capacity=1000TiB", "--set", "tiers.nvme.fsync=false")
    assert f"engram: tiers: dram 64 MiB (shared pool in {shm}), nvme 1024000.0 GiB at {nvme}; write-back, loss " \
           "window 5 s" in lines, lines
    assert any("warning: tiers.nvme.capacity" in line and "lower the capacity" in line for line in lines), lines


def test_an_nvme_directory_whose_index_cannot_be_made_fails_the_start_naming_it(tmp_path: Path) -> None:
    """index/ a regular file (or read-only, not this daemon's): the tier started degraded and refused every
    write-through put for good, retrying the journal every 5 s (an audit). Only a full disk starts degraded (it
    frees up); this is a directory the daemon cannot use: exit 9, one line naming it, nothing left behind."""
    nvme = tmp_path / "engram"
    nvme.mkdir()
    write_marker(nvme)  # Engram's directory (another program's is refused before: tests/test_nvme_directory.py)
    (nvme / "index").write_text("not a directory")
    out, shm = serve(tmp_path, "--port", "0", "--dram-capacity", "64MiB", "--set", f"tiers.nvme.path={nvme}",
                     "--set", "tiers.write_policy=write-through")
    assert out.returncode == 9, out.stderr
    line = out.stderr.strip().splitlines()[-1]  # after the journal's own warnings, logged as it found it
    assert line.startswith(f"error: cannot start: tiers.nvme.path {nvme}: its index journal cannot be created in "
                           f"{nvme / 'index'} (File exists)"), line
    assert "Traceback" not in out.stderr and list(shm.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("made", [(), ("models",), ("models", "blocks", "tmp")])
def test_a_first_nvme_start_on_a_full_disk_is_one_line_naming_the_directory(tmp_path: Path,
                                                                            made: tuple[str, ...]) -> None:
    """A fresh NVMe directory on a full disk (no page and no inode left: mkdir fails too, as on a full ext4):
    the models/, blocks/ or tmp/ directory or the lock file cannot be made. That was `cannot start: [Errno 28]`
    (exit 9, as for a permission) and left the DRAM segment behind; it is now the disk that is too small (exit 7),
    naming the directory and what to change, and the segment is removed."""
    with small_tmpfs(tmp_path / "small", inodes=64) as mnt:
        nvme = mnt / "engram"
        nvme.mkdir()
        if made:  # a first start that stopped part way had marked the directory first
            write_marker(nvme)
        for name in made:
            (nvme / name).mkdir()
        with contextlib.suppress(OSError), open(mnt / "fill", "wb") as fh:
            while True:
                fh.write(bytes(4096))
                fh.flush()
        (mnt / "inodes").mkdir()
        with contextlib.suppress(OSError):
            for n in range(1000):
                (mnt / "inodes" / str(n)).touch()
        out, shm = serve(tmp_path, "--port", "0", "--dram-capacity", "64MiB", "--set", f"tiers.nvme.path={nvme}")
    assert out.returncode == 7, out.stderr
    line = one_line(out)
    assert f"tiers.nvme.path {nvme}" in line and "disk is full" in line and "free space" in line, line
    assert list(shm.iterdir()) == []


@pytest.mark.parametrize(("table", "key"), [('[tenants.bob]\ntoken = "t"\nquota_byts = "1GiB"\n', "tenants.bob.quota_byts"),
                                            ('salt_secret = "s2"\n[tenants.bob]\ntoken = "t"\n', "salt_secret")],
                         ids=["typo-in-a-tenants-table", "auth-key-beside-the-tables"])
def test_an_unknown_key_in_the_tenants_file_fails_the_start_naming_the_file_and_the_key(tmp_path: Path, table: str,
                                                                                         key: str) -> None:
    """The config refuses unknown keys; the tenants file named a typo without saying which file held it, and a key
    of [auth] written beside its tables (salt_secret) was read as nothing: the daemon started without it."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(table)
    out, shm = serve(tmp_path, "--port", "0", "--dram-capacity", "64MiB", "--set", f"auth.tenants_file={tenants}",
                     "--set", "auth.salt_secret=s", timeout=30)
    assert out.returncode == 4, out.stderr
    line = one_line(out)
    assert f"auth.tenants_file {tenants}" in line and f"'{key}'" in line, line
    assert list(shm.iterdir()) == []


def test_a_bad_value_from_the_environment_fails_the_start_naming_the_variable(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    out = subprocess.run([*ENGRAM, "serve", "--port", "0", "--dram-capacity", "64MiB", "--set",
                          f"tiers.dram.shm_dir={shm}"], capture_output=True, text=True, timeout=30, cwd=NEUTRAL_CWD,
                         env={**os.environ, "ENGRAM_SERVER__STREAM_STALL_S": "-1"})
    assert out.returncode == 4, out.stderr
    assert one_line(out).startswith("error: ENGRAM_SERVER__STREAM_STALL_S=-1: server.stream_stall_s must be "), out.stderr


def test_an_endless_stall_time_fails_the_start(tmp_path: Path) -> None:
    out, _ = serve(tmp_path, "--port", "0", "--dram-capacity", "64MiB", "--set", "server.stream_stall_s=inf",
                   timeout=30)
    assert out.returncode == 4, out.stderr
    assert "server.stream_stall_s must be a finite number of seconds > 0, got inf" in one_line(out)


@pytest.mark.parametrize("case", ["socket-lock-is-a-directory", "nvme-models-is-a-file", "nvme-lock-is-a-directory"])
def test_a_file_the_daemon_cannot_make_fails_the_start_naming_the_setting_and_the_path(tmp_path: Path,
                                                                                       case: str) -> None:
    """Something else in the place of a file or directory the daemon makes (which fails as root too): that was
    `cannot start: [Errno 21] Is a directory: '...'`, saying neither which setting nor what was being done."""
    nvme, sock = tmp_path / "nvme", tmp_path / "e.sock"
    args = ["--unix-socket", str(sock)]
    if case == "socket-lock-is-a-directory":
        (tmp_path / "e.sock.lock").mkdir()
        key, path, reason = f"server.unix_socket {sock}", f"its lock file {sock}.lock", "Is a directory"
    else:
        nvme.mkdir()
        write_marker(nvme)  # Engram's directory, something else in the place of one of its files
        args += ["--set", f"tiers.nvme.path={nvme}"]
        made, path, reason = ((nvme / "models").touch, nvme / "models", "File exists") if case.endswith("file") \
            else ((nvme / "engram.lock").mkdir, nvme / "engram.lock", "Is a directory")
        made()
        key = f"tiers.nvme.path {nvme}"
    out, shm = serve(tmp_path, "--dram-capacity", "64MiB", *args)
    assert out.returncode == 9, out.stderr
    line = one_line(out)
    assert line.startswith(f"error: cannot start: {key}: {path} cannot be created or opened ({reason}); "), line
    assert "set another" in line and "Errno" not in line, line
    assert list(shm.iterdir()) == [] and not (tmp_path / "e.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_read_only_shm_dir_fails_the_start_naming_the_setting_and_the_segment(tmp_path: Path) -> None:
    """A read-only filesystem stops root too: the shared segment cannot be made (a bare [Errno 30] before)."""
    with small_tmpfs(tmp_path / "ro", "64m") as mnt:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        out = subprocess.run([*ENGRAM, "serve", "--port", "0", "--dram-capacity", "8MiB", "--set",
                              f"tiers.dram.shm_dir={mnt}"], capture_output=True, text=True, timeout=60, cwd=NEUTRAL_CWD)
    assert out.returncode == 9, out.stderr
    line = one_line(out)
    assert line.startswith(f"error: cannot start: tiers.dram.shm_dir {mnt}: its shared segment {mnt}/engram-seg-"), line
    assert "cannot be created or opened (Read-only file system)" in line and "tiers.dram.pool = private" in line, line
