"""Which directories the NVMe tier takes (engram/tiers/nvmedir.py): a daemon's start and `engram check --dir`
on another program's directory (one with a blocks/ folder, as bitcoind's datadir) are refused and leave every
file as it was (bytes and modes); a plain check changes nothing in an Engram directory either; a directory an
earlier Engram wrote (no marker) is taken, marked, and its blocks served. Real daemons and CLI subprocesses."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from engram.client import SyncEngramClient
from engram.tiers.nvmedir import MARKER

from helpers import ENGRAM, NEUTRAL_CWD, engram_daemon, random_kv, small_tmpfs, tiny_model, tokens


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under root (root included): its mode and, for a file, its bytes."""
    out: dict[str, tuple[int, bytes | None]] = {".": (os.lstat(root).st_mode, None)}
    for path in sorted(root.rglob("*")):
        st = os.lstat(path)
        out[str(path.relative_to(root))] = (st.st_mode, path.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


def other_programs_directory(where: Path) -> Path:
    """A datadir with a blocks/ folder, as bitcoind's: blocks/blk00000.dat, blocks/index/000003.ldb."""
    root = where / "otherapp"
    (root / "blocks" / "index").mkdir(parents=True)
    (root / "blocks" / "blk00000.dat").write_bytes(b"ledger" * 100)
    (root / "blocks" / "index" / "000003.ldb").write_bytes(b"index")
    (root / "chainstate").mkdir()
    for d in (root, root / "blocks", root / "blocks" / "index", root / "chainstate"):
        os.chmod(d, 0o755)
    return root


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENGRAM, *args], capture_output=True, text=True, timeout=60, cwd=NEUTRAL_CWD)


def test_serve_refuses_another_programs_directory_and_leaves_it_untouched(tmp_path: Path) -> None:
    """`engram serve --set tiers.nvme.path=DIR` made DIR and DIR/blocks 0700, put its lock and index in DIR and
    deleted every file of DIR/blocks as a stray at its recovery. Now: exit 4, one line naming the setting."""
    other = other_programs_directory(tmp_path)
    before = tree(other)
    shm = tmp_path / "shm"
    shm.mkdir()
    out = run("serve", "--port", "0", "--dram-capacity", "64MiB", "--set", f"tiers.dram.shm_dir={shm}",
              "--set", f"tiers.nvme.path={other}")
    assert out.returncode == 4, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"error: tiers.nvme.path {other} is not an Engram NVMe tier directory: it holds "
                               "blocks/, chainstate/"), lines[0]
    assert "nothing in it was changed" in lines[0]
    assert tree(other) == before
    assert list(shm.iterdir()) == []


def test_check_dir_refuses_another_programs_directory_with_or_without_fix(tmp_path: Path) -> None:
    """`engram check --dir DIR` chmodded DIR and DIR/blocks and left engram.lock, index/ and tmp/ in it; with
    --fix it unlinked every file of DIR/blocks/ and DIR/blocks/*/ as "stray entry (not a block file)"."""
    other = other_programs_directory(tmp_path)
    before = tree(other)
    for args in ((), ("--fix",)):
        out = run("check", "--dir", str(other), *args)
        assert out.returncode == 4, out.stderr
        assert f"--dir {other} is not an Engram NVMe tier directory" in out.stderr
        assert "Traceback" not in out.stderr
        assert tree(other) == before


def put_blocks(address: str) -> tuple[bytes, list[bytes], torch.Tensor]:
    spec = tiny_model()
    toks = tokens(64)
    kv = random_kv(spec, 64)
    with SyncEngramClient(address, namespace="ns") as c:
        fp = c.register_model(spec)
        keys = list(c.put(fp, toks, kv).keys)
    return fp, keys, kv


def test_a_plain_check_changes_nothing_in_an_engram_directory(tmp_path: Path) -> None:
    """Without --fix an offline check is read-only: no chmod (an older build's 0755 directories stay so), no lock
    file, no index/ or tmp/ made; it still finds every block valid."""
    nvme = tmp_path / "nvme"
    with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}", "--set", "tiers.write_policy=write-through"
                       ) as (address, _):
        _, keys, _ = put_blocks(address)
    for d in (nvme, nvme / "blocks"):
        os.chmod(d, 0o755)
    (nvme / "engram.lock").unlink()
    for name in os.listdir(nvme / "tmp"):
        os.unlink(nvme / "tmp" / name)
    (nvme / "tmp").rmdir()
    before = tree(nvme)
    out = run("check", "--dir", str(nvme))
    assert out.returncode == 0, out.stderr
    assert f"scanned {len(keys)} stored copies: {len(keys)} valid, 0 problems" in out.stdout
    assert tree(nvme) == before


def test_an_earlier_engram_directory_is_adopted_and_its_blocks_served(tmp_path: Path) -> None:
    """A directory written before the marker (this build's, its marker removed): a plain check reads it without
    marking it, and a daemon takes it, marks it and serves its blocks."""
    nvme = tmp_path / "nvme"
    with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}", "--set", "tiers.write_policy=write-through"
                       ) as (address, _):
        fp, keys, kv = put_blocks(address)
    assert (nvme / MARKER).is_file()
    (nvme / MARKER).unlink()
    out = run("check", "--dir", str(nvme))
    assert out.returncode == 0 and f"{len(keys)} valid, 0 problems" in out.stdout, out.stderr
    assert not (nvme / MARKER).exists()
    with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}") as (address, _), SyncEngramClient(address, namespace="ns") as c:
        assert (nvme / MARKER).is_file()
        c.register_model(tiny_model())
        got = c.get(fp, keys)
    assert torch.equal(torch.cat(got, dim=2), kv)


def test_a_missing_or_empty_directory_is_taken_and_marked(tmp_path: Path) -> None:
    """A fresh filesystem's root holds lost+found: still empty, for the tier."""
    empty = tmp_path / "mnt"
    (empty / "lost+found").mkdir(parents=True)
    for nvme in (tmp_path / "new", empty):
        with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}") as (address, _):
            put_blocks(address)
        assert (nvme / MARKER).read_text().startswith("engram NVMe tier directory, format 1\n")


def fill(mnt: Path) -> None:
    """Every page of the tmpfs at `mnt` taken by one file, mnt/fill (files can still be created, not written)."""
    with contextlib.suppress(OSError), open(mnt / "fill", "wb") as fh:
        while True:
            fh.write(bytes(4096))
            fh.flush()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_first_start_that_could_not_write_the_marker_leaves_the_directory_empty(tmp_path: Path) -> None:
    """A first start on a full disk fails (exit 7) writing the marker: it left engram-nvme-tier.tmp behind, and
    every later start (space freed) refused the directory as another program's. A real full tmpfs."""
    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        nvme = mnt / "nvme"
        nvme.mkdir()
        fill(mnt)
        shm = tmp_path / "shm"
        shm.mkdir()
        out = run("serve", "--port", "0", "--dram-capacity", "64MiB", "--set", f"tiers.dram.shm_dir={shm}",
                  "--set", f"tiers.nvme.path={nvme}")
        assert out.returncode == 7, out.stderr
        assert os.listdir(nvme) == []
        (mnt / "fill").unlink()
        with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}") as (address, _):
            put_blocks(address)
        assert (nvme / MARKER).is_file()


def test_a_directory_holding_only_the_markers_temp_file_is_taken(tmp_path: Path) -> None:
    """A first start that died writing the marker (a crash, or a build that kept the temp file at a failure)
    left engram-nvme-tier.tmp alone in the directory: still an empty directory, taken and marked."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / f"{MARKER}.tmp").write_bytes(b"engram NVMe tier dir")
    with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}") as (address, _):
        put_blocks(address)
    assert (nvme / MARKER).read_text().startswith("engram NVMe tier directory, format 1\n")
    assert not (nvme / f"{MARKER}.tmp").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_an_earlier_engram_directory_on_a_full_disk_is_taken_unmarked(tmp_path: Path) -> None:
    """Upgrading a deployment whose NVMe filesystem is full: the build before the marker started (degraded) and
    served its blocks; this one failed to start (exit 7) writing the marker. Now it warns, takes the directory
    unmarked (recognised again by its files) and serves the blocks. A real full tmpfs."""
    with small_tmpfs(tmp_path / "small", "4m") as mnt:
        nvme = mnt / "nvme"
        with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}", "--set",
                           "tiers.write_policy=write-through") as (address, _):
            fp, keys, kv = put_blocks(address)
        (nvme / MARKER).unlink()  # as the build before the marker left it
        fill(mnt)
        with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}") as (address, proc), \
                SyncEngramClient(address, namespace="ns") as c:
            c.register_model(tiny_model())
            got = c.get(fp, keys)
            proc.kill()
            assert proc.stdout is not None
            logged = proc.stdout.read()
        assert torch.equal(torch.cat(got, dim=2), kv)
        assert f"{nvme}: the disk is full, so its {MARKER} marker file cannot be written" in logged, logged
        assert not (nvme / MARKER).exists() and not (nvme / f"{MARKER}.tmp").exists()


# root reads any directory: the daemon's user, as an operator runs it, is one without these capabilities
_UNPRIVILEGED = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps",
                  "-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else [])


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root without setpriv reads all")
@pytest.mark.parametrize("command", ["serve", "check"])
def test_a_directory_the_user_cannot_read_is_one_line_naming_it(tmp_path: Path, command: str) -> None:
    """tiers.nvme.path (or --dir) naming a directory of another user: `serve` said only `cannot start: [Errno 13]
    Permission denied: '...'` and `check --dir` printed a PermissionError traceback. Now one line each naming the
    setting, the path and what to change (serve: exit 9, as any file it cannot open; check: exit 4)."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o000)
    shm = tmp_path / "shm"
    shm.mkdir()
    args = (["serve", "--port", "0", "--dram-capacity", "64MiB", "--set", f"tiers.dram.shm_dir={shm}", "--set",
             f"tiers.nvme.path={closed}"] if command == "serve" else ["check", "--dir", str(closed)])
    out = subprocess.run([*_UNPRIVILEGED, *ENGRAM, *args], capture_output=True, text=True, timeout=60,
                         cwd=NEUTRAL_CWD)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr and "Errno" not in out.stderr, out.stderr
    if command == "serve":
        assert out.returncode == 9, out.stderr
        assert lines[0] == (f"error: cannot start: tiers.nvme.path {closed}: {closed} cannot be created or opened "
                            "(Permission denied); let this daemon read and write it and what it holds (models/, "
                            "blocks/, tmp/ are directories), or set another tiers.nvme.path"), lines[0]
        assert list(shm.iterdir()) == []
    else:
        assert out.returncode == 4, out.stderr
        assert lines[0] == (f"error: --dir {closed}: {closed} cannot be read (Permission denied); run the check as "
                            "the user the daemon runs as, or one who may read the directory"), lines[0]


@pytest.mark.parametrize("marked", [True, False], ids=["this-builds-daemon", "an-earlier-builds-daemon"])
def test_check_fix_beside_the_daemon_serving_the_directory_changes_nothing(tmp_path: Path, marked: bool) -> None:
    """`check --dir --fix` on a directory a running daemon holds is refused by its lock (exit 4): it first made
    the directory 0700 and, beside a daemon of the build before the marker (its directory unmarked), wrote the
    marker. Now the lock comes before either."""
    nvme = tmp_path / "nvme"
    with engram_daemon(tmp_path, "--set", f"tiers.nvme.path={nvme}", "--set", "tiers.write_policy=write-through"
                       ) as (address, _):
        put_blocks(address)
        if not marked:
            (nvme / MARKER).unlink()  # as an earlier build serves it
        os.chmod(nvme, 0o755)  # as an earlier build or an operator left it
        before = sorted(os.listdir(nvme)), os.lstat(nvme).st_mode
        out = run("check", "--dir", str(nvme), "--fix")
        assert out.returncode == 4, out.stderr
        assert "holds the NVMe directory" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert (sorted(os.listdir(nvme)), os.lstat(nvme).st_mode) == before
