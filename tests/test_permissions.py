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
