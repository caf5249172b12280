"""Exclusive locks that keep two daemons off one unix socket path and one NVMe directory.

Why: a second `engram serve` on the same socket path used to unlink the first's socket and bind its own,
leaving the first running and unreachable, and then delete the socket again when it exited; two daemons
on one NVMe directory would each believe they own every block file and delete each other's. A daemon
therefore takes an exclusive `flock` on a lock file beside what it owns (`<socket>.lock`, `ROOT/engram.lock`)
before touching it, and holds it for its lifetime.

Why flock: the kernel drops the lock when the holder dies, SIGKILL included, so a lock file left behind by a
crashed daemon never blocks a restart (no stale-pid guessing). The holder writes its pid into the file, only
so that the refusal can say which process to look at; the lock, not the pid, decides.

The file stays when a daemon stops: removing it would let a daemon that had just opened it lock a file no
longer at the path while a third locks a new one. Only a start that fails removes the file it created
(`abandon`), so a failed start leaves nothing beside the socket; it unlinks the file while it still holds the
lock, and `acquire` checks, once locked, that the path still names the file it locked, else starts over.

What it does not do: protect against a process that ignores the lock (an older engram, `rm`), or locks on
NFS, where flock may be local to one client.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from engram.errors import AlreadyRunning

__all__ = ["DaemonLock", "holder_pid"]


def holder_pid(path: str | Path) -> int | None:
    """The pid written in a lock file, if any (it names the holder; it is not what decides)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class DaemonLock:
    """An exclusive lock on `path`, held until `release` (or the process's death)."""

    def __init__(self, path: str | Path, what: str, fix: str) -> None:
        """`what` names the thing guarded ("the unix socket /run/engram.sock"), `fix` what to change when
        another daemon holds it; both go into the refusal."""
        self.path = Path(path)
        self.what = what
        self.fix = fix
        self._fd: int | None = None
        self._read_only = False  # locked by a read-only check: its file is not written
        self.created = False  # this lock made the file (so `abandon` may remove it)

    def acquire(self, *, create: bool = True) -> DaemonLock:
        """Take the lock or raise AlreadyRunning naming the holder's pid; never waits. Without `create` (a
        read-only check), only a lock file already there is locked, opened read-only, nothing written in it; with
        none there no daemon holds the path (one would have made it), and nothing is locked."""
        if not create:
            return self._acquire_existing()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd, created = self._open()
            self._lock(fd)
            if self._still_at_path(fd):
                break
            os.close(fd)  # a failed start removed it between our open and our lock: lock the file there now
        with contextlib.suppress(OSError):  # the pid only names the holder: a full disk must not stop a start
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd, self.created = fd, created
        return self

    def _acquire_existing(self) -> DaemonLock:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return self
        self._lock(fd)
        self._fd, self._read_only = fd, True
        return self

    def _lock(self, fd: int) -> None:
        """flock `fd` without waiting; closed, and AlreadyRunning raised, when another process holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._held_elsewhere() from None
        except BaseException:
            os.close(fd)
            raise

    def _held_elsewhere(self) -> AlreadyRunning:
        pid = holder_pid(self.path)
        who = f"process {pid}" if pid is not None else "another process"
        return AlreadyRunning(f"{who} holds {self.what} (lock file {self.path}); is another engram daemon running? "
                              f"Stop it (kill {pid if pid is not None else '<pid>'}) or {self.fix}")

    def _open(self) -> tuple[int, bool]:
        """The lock file's descriptor, and whether this call created the file."""
        while True:
            with contextlib.suppress(FileExistsError):
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
            with contextlib.suppress(FileNotFoundError):  # removed since: create it
                return os.open(self.path, os.O_RDWR), False

    def _still_at_path(self, fd: int) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock. The file stays (removing it would race a daemon that just opened it)."""
        if self._fd is None:
            return
        if not self._read_only:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd, self._read_only = None, False

    def abandon(self) -> None:
        """Release after a failed start, removing the file if this lock created it (one an earlier daemon left
        stays: it was there before). Unlinked while still held: see the module's docstring."""
        if self._fd is not None and self.created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.release()

    def __enter__(self) -> DaemonLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
