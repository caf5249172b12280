"""What another local user could open: block files, their directories, the model files and the unix socket.
Each is stat'ed on a real daemon after real puts; a mode wider than 0600/0700 (or 0660 with a configured
group) fails the test, whatever the process's umask was."""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engram.client import EngramClient
from engram.config import ConfigError, load_config

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens


@pytest.fixture
def lax_umask() -> Iterator[None]:
    """The daemon must not rely on the umask it inherits: run it under the laxest one."""
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_block_files_are_0600_in_0700_directories(server_factory: Any, tmp_path: Path,
                                                        lax_umask: None) -> None:
    root = tmp_path / "nvme"
    srv = await server_factory(**{"tiers.nvme.path": str(root), "tiers.write_policy": "write-through"})
    spec = tiny_model()
    toks = tokens(3 * BLOCK_TOKENS)
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(spec)
        await c.put(fp, toks, random_kv(spec, len(toks)))
    files = sorted(root.rglob("*.blk"))
    assert len(files) == 3  # write-through: every block is on NVMe
    dirs = [p for p in root.rglob("*") if p.is_dir()] + [root]
    assert {root / "blocks", root / "tmp", root / "models"} <= set(dirs)
    for d in dirs:
        assert mode(d) == 0o700, f"{d} is {oct(mode(d))}"
    for f in [*files, *(root / "models").glob("*.json")]:
        assert mode(f) == 0o600, f"{f} is {oct(mode(f))}"


async def test_an_existing_wide_tier_directory_is_tightened_at_start(server_factory: Any, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    (root / "blocks").mkdir(parents=True)  # as an earlier build left it (engram/tiers/nvmedir.py: no marker)
    (root / "tmp").mkdir()
    (root / "engram.lock").touch()
    os.chmod(root, 0o755)
    os.chmod(root / "blocks", 0o777)
    await server_factory(**{"tiers.nvme.path": str(root)})
    assert mode(root) == 0o700 and mode(root / "blocks") == 0o700


async def test_the_unix_socket_is_0600(tmp_path: Path, lax_umask: None) -> None:
    from engram.server import start_server

    sock = tmp_path / "engram.sock"
    srv = await start_server(load_config(env={}, overrides={"server.unix_socket": str(sock),
                                                            "tiers.dram.capacity": "64MiB"}))
    try:
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and mode(sock) == 0o600
        async with EngramClient(srv.address) as c:  # and its owner still connects
            assert (await c.stats()).version
    finally:
        await srv.stop(0)


async def test_the_unix_socket_with_a_group_is_0660_and_that_group(tmp_path: Path, lax_umask: None) -> None:
    from engram.server import start_server

    group = grp.getgrgid(os.getgid()).gr_name  # a group this user is in, so the chown is allowed
    sock = tmp_path / "engram.sock"
    srv = await start_server(load_config(env={}, overrides={"server.unix_socket": str(sock),
                                                            "server.unix_socket_group": group,
                                                            "tiers.dram.capacity": "64MiB"}))
    try:
        st = os.stat(sock)
        assert mode(sock) == 0o660 and st.st_gid == os.getgid()
    finally:
        await srv.stop(0)


def test_an_unknown_socket_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no group 'no-such-group-here'"):
        load_config(env={}, overrides={"server.unix_socket": "/tmp/x.sock", "server.unix_socket_group": "no-such-group-here"})


def _workers_group() -> str:
    """A group to open the daemon's files to: as root, one it is not in (`daemon`, `nogroup`...), so that access
    by a user who is only in that group can be tried; otherwise this user's own (the chown needs membership)."""
    if os.geteuid() == 0:
        for g in grp.getgrall():
            if g.gr_gid != os.getgid():
                return g.gr_name
    return grp.getgrgid(os.getgid()).gr_name


def _as_a_member(group: str, check: str, path: Path) -> bool:
    """Whether a user other than the daemon's (nobody), in `group` alone, passes `test <check> path` (root drops
    to it; False when it cannot). The shell's test asks the kernel (access(2)), nothing of Engram's."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to try the file as another user")
    gid = grp.getgrnam(group).gr_gid
    return subprocess.run(["setpriv", "--reuid", "65534", "--regid", str(gid), "--clear-groups",
                           "sh", "-c", f"test {check} \"$1\"", "sh", str(path)]).returncode == 0


@pytest.mark.parametrize("same_host", ["tenancy off", "tenancy on, same_host_paths on", "tenancy on"])
async def test_the_shared_pool_is_opened_to_the_socket_group_where_the_same_host_paths_are_on(
        tmp_path: Path, lax_umask: None, same_host: str) -> None:
    """server.unix_socket_group lets a group's workers connect; the DRAM pool's segment stayed 0600, the daemon's
    user's, so those workers could not map it and every hit and put travelled as bytes, silently (the docs audit,
    session 48). Where the same-host paths are on (tenancy off, or auth.same_host_paths = on, which trusts this
    host's workers with every tenant's blocks) the segment is that group's, 0660: a worker writes its in-place puts
    there. Under tenancy with the paths off (auto) no worker maps it: it stays 0600."""
    from engram.server import start_server
    from engram.tiers.pool import shared_pool

    group = _workers_group()
    overrides: dict[str, Any] = {"server.unix_socket": str(tmp_path / "engram.sock"), "server.unix_socket_group": group,
                                 "tiers.dram.capacity": "16MiB", "tiers.dram.prefault": False}
    if same_host != "tenancy off":
        overrides.update({"auth.tenants.t.token": "tok", "auth.salt_secret": "s"})
    if same_host == "tenancy on, same_host_paths on":
        overrides["auth.same_host_paths"] = "on"
    srv = await start_server(load_config(env={}, overrides=overrides))
    try:
        pool = shared_pool(srv.store.tiers)
        assert pool is not None and pool.segment is not None
        path = pool.segment.path
        st = os.stat(path)
        if same_host == "tenancy on":
            assert (mode(path), st.st_gid) == (0o600, os.getgid())
            if os.geteuid() == 0 and st.st_gid != grp.getgrnam(group).gr_gid:
                assert not _as_a_member(group, "-r", path)
        else:
            assert (mode(path), st.st_gid) == (0o660, grp.getgrnam(group).gr_gid)
            assert _as_a_member(group, "-r", path) and _as_a_member(group, "-w", path)
    finally:
        await srv.stop(0)


def test_the_hbm_generation_table_is_only_readable_by_the_workers_group(lax_umask: None) -> None:
    """The HBM pool's generation table (a segment without a data area) is only read by a worker (it checks a CUDA
    IPC descriptor's generation there): the group gets 0640, not write. In /dev/shm, where the daemon makes it
    (another user cannot reach into a test's own directory)."""
    from engram.tiers.shm import SharedSegment

    group = _workers_group()
    table = SharedSegment("/dev/shm", 1 << 20, 1 << 12, pin=False, with_data=False, group=group)
    try:
        assert (mode(table.path), os.stat(table.path).st_gid) == (0o640, grp.getgrnam(group).gr_gid)
        assert _as_a_member(group, "-r", table.path) and not _as_a_member(group, "-w", table.path)
    finally:
        table.close()
