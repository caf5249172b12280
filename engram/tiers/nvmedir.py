"""Which directories are an Engram NVMe tier's: those holding the marker file ROOT/engram-nvme-tier.

Why: a start's recovery and `engram check --fix` delete whatever in blocks/ and tmp/ is not a block file of
theirs, and a start made the directory private (0700) and put its lock and index in it. A tiers.nvme.path or a
`check --dir` naming another program's directory (bitcoind's datadir has a blocks/ folder) had that program's
files deleted. So the tier takes a directory only when it is missing or empty (a daemon makes it and writes
the marker before anything else), marked, or unmistakably an earlier Engram's (written before the marker:
docs/FORMAT.md, "Directory marker"), which it then marks. Anything else is refused before anything in it is
changed: no chmod, no lock file, no directory made.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Literal

from engram.errors import ConfigError, NewerFormat
from engram.layout import ModelSpec
from engram.private import FILE_MODE, private_dir
from engram.tiers.blockfile import MAGIC as BLOCK_MAGIC
from engram.tiers.groupcommit import sync_directory
from engram.tiers.journal import JOURNAL_MAGIC, SNAPSHOT_MAGIC

MARKER = "engram-nvme-tier"
VERSION = 1
_FIRST_LINE = re.compile(r"engram NVMe tier directory, format (\d+)")
_TEXT = ("engram NVMe tier directory, format {}\n"
         "Written by Engram (docs/FORMAT.md, \"NVMe tier directory\"); it deletes stray files in blocks/ and tmp/.\n")
# Still an empty directory to take: a fresh filesystem's root holds lost+found, and a first start that could not
# write the marker (a full disk, a crash mid-write) may have left the marker's temp file and nothing else
_EMPTY_TOO = {"lost+found", f"{MARKER}.tmp"}
_HEX = re.compile(r"[0-9a-f]+")

log = logging.getLogger(__name__)

State = Literal["missing", "empty", "marked", "earlier"]


class ForeignDirectory(ConfigError):
    """The directory is not an Engram NVMe tier's (nor empty): it is left exactly as it is."""


def inspect(root: Path, setting: str = "tiers.nvme.path") -> State:
    """What `root` is to the tier, changing nothing; ForeignDirectory (naming `setting`) when it is not the
    tier's, NewerFormat when a newer Engram's marker is there."""
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        raise ForeignDirectory(f"{setting} {root} is not a directory; name a directory on the NVMe drive") from None
    if MARKER in entries:
        version = _marker_version(root / MARKER)
        if version is None:
            raise ForeignDirectory(f"{setting} {root}: its {MARKER} file is not Engram's marker; nothing in the "
                                   "directory was changed: name another directory") from None
        if version > VERSION:
            raise NewerFormat(str(root / MARKER), "NVMe tier directory", version, VERSION,
                              f"start that version, or move the directory away ({setting} {root}; nothing in it "
                              "was changed)")
        return "marked"
    if set(entries) <= _EMPTY_TOO:
        return "empty"
    if _written_by_earlier_engram(root, set(entries)):
        return "earlier"
    shown = ", ".join(e + ("/" if (root / e).is_dir() else "") for e in entries[:4])
    more = f" and {len(entries) - 4} more" if len(entries) > 4 else ""
    advice = ("name the NVMe tier's directory (its tiers.nvme.path)" if setting == "--dir" else
              "name an empty or new directory, or one Engram wrote")
    raise ForeignDirectory(f"{setting} {root} is not an Engram NVMe tier directory: it holds {shown}{more}, and no "
                           f"{MARKER} file; nothing in it was changed: {advice}")


def claim(root: Path, *, create: bool, mark: bool = True, fsync: bool = True,
          setting: str = "tiers.nvme.path") -> State:
    """Take `root` for the tier: refused (ForeignDirectory) unless it is the tier's, or `create` and it is
    missing or empty; with `mark`, a missing or empty one is made (0700) and marked. Returns what it was. An
    earlier Engram's is left as it is: a daemon may hold it, so it is marked (`adopt`) once its lock is held."""
    state = inspect(root, setting)
    if state in ("missing", "empty") and not create:
        what = "does not exist" if state == "missing" else "is empty"
        raise ForeignDirectory(f"{setting} {root} {what}: not an Engram NVMe tier directory")
    if mark and state in ("missing", "empty"):  # nobody's yet: marked before anything (the lock file) is made
        private_dir(root)
        write_marker(root, fsync=fsync)
    return state


def adopt(root: Path, *, fsync: bool = True, setting: str = "tiers.nvme.path") -> None:
    """Mark an earlier Engram's directory (made 0700), its lock held: a check --fix beside the daemon serving it
    tightened and marked it before the lock refused the check."""
    private_dir(root)
    try:
        write_marker(root, fsync=fsync)
    except OSError as exc:
        # Recognised again by its files: a full disk must not stop a start that the build before the marker made
        # (degraded). A new directory fails in `claim`: unmarked, what a start made in it would not say whose it is.
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.warning("%s %s: the disk is full, so its %s marker file cannot be written (%s); the directory is taken "
                    "unmarked, as an earlier Engram's, and marked at a start with free space", setting, root, MARKER,
                    exc.strerror)


def write_marker(root: Path, *, fsync: bool = True) -> None:
    """The marker, written whole or not at all (temp file, fsync, rename, directory fsync); a failed write
    removes its temp file, so the directory is as it was."""
    tmp = root / f"{MARKER}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        try:
            os.write(fd, _TEXT.format(VERSION).encode())
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / MARKER)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        sync_directory(root)


def _marker_version(path: Path) -> int | None:
    try:
        with open(path, "rb") as fh:
            first = fh.read(256).split(b"\n", 1)[0].decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    m = _FIRST_LINE.fullmatch(first)
    return int(m.group(1)) if m else None


def _starts_with(path: Path, magics: tuple[bytes, ...]) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(8) in magics
    except OSError:
        return False


def _written_by_earlier_engram(root: Path, entries: set[str]) -> bool:
    """Evidence that a build from before the marker wrote here: what it and only it makes."""
    index = root / "index"
    if index.is_dir():
        for name in os.listdir(index):
            if (name == "snapshot" or name.startswith("journal.")) and _starts_with(
                    index / name, (SNAPSHOT_MAGIC, JOURNAL_MAGIC)):
                return True
    models = root / "models"
    if models.is_dir():
        for path in models.glob("*.json"):
            if len(path.stem) == 32 and _HEX.fullmatch(path.stem) and _is_model_file(path):
                return True
    blocks = root / "blocks"
    if blocks.is_dir():
        for sub in os.listdir(blocks):
            if len(sub) != 2 or not _HEX.fullmatch(sub) or not (blocks / sub).is_dir():
                continue
            for name in os.listdir(blocks / sub):
                stem = name.removesuffix(".blk")
                if (name.endswith(".blk") and len(stem) == 32 and stem.startswith(sub) and _HEX.fullmatch(stem)
                        and _starts_with(blocks / sub / name, (BLOCK_MAGIC,))):
                    return True
    # A start made blocks/ and tmp/, then its lock file, before any block or journal
    return {"blocks", "tmp", "engram.lock"} <= entries and (root / "blocks").is_dir() and (root / "tmp").is_dir()


def _is_model_file(path: Path) -> bool:
    try:
        spec = ModelSpec.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return spec.fingerprint.hex() == path.stem


__all__ = ["MARKER", "VERSION", "ForeignDirectory", "State", "adopt", "claim", "inspect", "write_marker"]
