"""Files, directories and sockets only the daemon's user can reach.

A block file holds a tenant's KV and the unix socket admits anyone who can connect to it (tenancy checks
tokens, but with tenancy off the socket's mode is the only guard), so both are created private: files 0600,
directories 0700, the socket 0600, or 0660 for one configured group (`server.unix_socket_group`) whose
members run the workers. Modes are set at creation (a umask around the bind, explicit modes on open and
mkdir), never widened afterwards, so there is no window in which another local user could open them; a
directory an older version created with a wider mode is tightened when the daemon starts.

The shared DRAM segment (engram/tiers/shm.py) is 0600 too, or, where that group's members run the workers and
the same-host paths are on (`auth.same_host_paths`), opened to the group as the socket is (`share_with_group`):
a worker that may connect but not map the pool silently lost zero-copy hits and in-place puts. What this module
does not do: CUDA IPC exports are the hit path's, and whom the same-host paths trust is decided in config
(docs/ARCHITECTURE.md, "Trust").
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from engram.errors import ConfigError

log = logging.getLogger("engram.private")

FILE_MODE = 0o600
DIR_MODE = 0o700
SOCKET_MODE = 0o600
GROUP_SOCKET_MODE = 0o660
GROUP_SEGMENT_MODE = 0o660  # the DRAM pool: a worker reads its hits there and writes its in-place puts
GROUP_READ_SEGMENT_MODE = 0o640  # the HBM pool's generation table: a worker only reads it


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) and make it 0700; an existing one is tightened to 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    try:
        if path.stat().st_mode & 0o777 != DIR_MODE:
            os.chmod(path, DIR_MODE)
    except PermissionError as exc:  # not ours (a mount point owned by root): say so, do not fail the start
        log.warning("cannot make %s private (mode 0700): %s; other local users may list it", path, exc)
    return path


def remove_stale_socket(path: str, key: str) -> None:
    """Remove a socket an earlier run left at `path` (the bind would fail on it); anything else there is not
    ours to delete: ConfigError naming the setting."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{key} {path} exists and is not a socket; move it, or choose another path")
    os.unlink(path)


def group_id(name: str) -> int:
    """The id of group `name` (a config value): ConfigError saying what to change when it does not exist."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"server.unix_socket_group: no group {name!r} on this host; create it or leave the "
                          "key empty (the socket is then 0600, for the daemon's user only)") from None


@contextlib.contextmanager
def socket_umask(group: str) -> Iterator[None]:
    """Bind inside this: the socket file is created with no bits for others (and none for the group unless
    one is configured), so it is never connectable by another user, not even before `secure_socket`. The
    umask is the process's: it only ever removes group/other bits, so files other threads create meanwhile
    are at most narrower than they asked (the daemon's own files ask for 0600/0700 anyway)."""
    old = os.umask(0o007 if group else 0o077)
    try:
        yield
    finally:
        os.umask(old)


def secure_socket(path: str, group: str) -> None:
    """After the bind: the socket's mode (and group) as configured, checked rather than assumed."""
    if group:
        os.chown(path, -1, group_id(group))
        os.chmod(path, GROUP_SOCKET_MODE)
    else:
        os.chmod(path, SOCKET_MODE)


def share_with_group(fd: int, group: str, *, writes: bool) -> None:
    """Open a shared segment's file, created 0600 and not yet written, to `group` (server.unix_socket_group):
    0660 where its workers write (in-place puts into the DRAM pool), 0640 where they only read."""
    os.fchown(fd, -1, group_id(group))
    os.fchmod(fd, GROUP_SEGMENT_MODE if writes else GROUP_READ_SEGMENT_MODE)
